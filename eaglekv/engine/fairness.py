"""The scheduler's fairness rule: who gets the step's prefill tokens, and who gets a free row.

Prefill budget (`prefill_shares`). A step takes every decode first (one token each), then the
requests still prefilling share what is left of `chunked_prefill_size` max-min fairly
(water-filling): each gets an equal share; a request that needs less than its share takes only
what it needs and the rest is shared among the others; an uneven remainder goes one token each
to the earliest arrivals. So a short prompt beside a 4000-token one completes its prefill in
its first step, and the long one still advances every step (it is never starved);
`chunked_prefill_size` stays the cap on a step's prefill tokens, so decode steps stay short.

Admission (`next_to_admit`). Every request belongs to a group: the call it came from (the n
choices or the prompt list of one HTTP request), by default itself. A request waiting again
after a preemption is admitted first, as before (they are at the front of `waiting`);
otherwise the next free row goes to the waiting request whose group has the fewest running
requests, ties to the earliest arrival. A single request arriving behind a 128-way fan-out
gets the next free row, and two large groups end up with equal shares of the rows. The chosen
request is admitted only if the KV pool has room for it; otherwise admission waits (the next
in line is not skipped, so a large request is not starved by smaller ones).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def prefill_shares(demands: Sequence[int], budget: int) -> list[int]:
    """Max-min fair split of `budget` tokens over `demands` (tokens each prefilling request
    still needs, in arrival order) -> tokens each one gets this step, same order.

    E.g. demands [4000, 5, 300], budget 512: 5 <= 512 / 3 takes 5; 300 > 507 / 2 = 253.5, so
    the other two split 507: [254, 5, 253] (the odd token to the earlier arrival).
    """
    n = len(demands)
    shares = [0] * n
    left = max(budget, 0)
    order = sorted(range(n), key=lambda i: (demands[i], i))          # smallest need first
    k = 0
    # demand <= left // (n - k), an equal share of what is left: it takes what it needs
    while k < n and demands[order[k]] * (n - k) <= left:
        shares[order[k]] = demands[order[k]]
        left -= demands[order[k]]
        k += 1
    # the rest each need more than an equal share: split evenly, remainder to the earliest
    rest = sorted(order[k:])
    if rest:
        q, r = divmod(left, len(rest))
        for j, i in enumerate(rest):
            shares[i] = q + (j < r)
    return shares


def next_to_admit(waiting: Sequence, running_per_group: Counter) -> int:
    """Index in `waiting` (Req, arrival order, preempted ones first) of the request to admit
    next: a preempted one at the front, else the first whose group has the fewest running
    requests. O(len(waiting)); stops at the first group with none running."""
    if waiting[0].preempted:
        return 0
    best, fewest = 0, None
    for i, req in enumerate(waiting):
        n = running_per_group[req.group]
        if fewest is None or n < fewest:
            best, fewest = i, n
            if n == 0:
                break
    return best
