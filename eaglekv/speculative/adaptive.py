"""Adaptive speculation: each decode step chooses, from measured costs and live acceptance,
plain decoding or one of a few draft shapes (num_steps, topk, num_draft_tokens), for the
whole batch or for the requests whose drafts are being accepted, the others decoding plainly
in the same step.

    expected tokens of request b under shape s = 1 + corr_s * sum_{i <= S_s} rate_b[i]
    step value = tokens of the step / (cost of its spec part + cost of its plain part)
    all-plain value = B / seconds per token of a plain step (of a chain where it can run one)

`rate_b[i]` is request b's exponentially averaged acceptance at draft position i (vLLM's and
llama.cpp's definition: accepted at position i / drafts at position i, so rate[1] >= rate[2]
>= ...). For a chain (topk 1) the sum is exact, E[accepted] = sum_i P(accepted >= i), so
`corr_s` = 1; for a tree it is learnt, calibrating the sum to what the tree really accepts
(more than the chain of its depth). Costs are seconds per step measured on this machine for
every (choice, batch bucket) that ran; `chain` cells hold seconds per token of a plain step
that decoded a chain of k tokens (`EngineConfig.num_scheduler_steps`: greedy batches under
decode graphs), i.e. the step's seconds / k. Each cell is explored the first time it is
needed, then kept as an exponential average and cached on disk per device, model, dtype and
draft (`$EAGLEKV_CACHE/costs/`), so a later engine starts informed.

A shape of depth S observes positions 1..S only. The positions past S keep their conditional
rate (rate[j] / rate[S], what they last showed relative to position S) and follow rate[S]
as it moves: without that, a request that ran a shallow shape while its acceptance rose would
judge the deeper shapes by the rates of its worse past, and stay shallow (a CPU run at batch 4
stayed at S1 for 60 of 66 steps with rate[1] = 1.0 while S5 accepts 4.4 there).

Every request starts optimistic about its own acceptance: each draft position adds
`optimism / sqrt(1 + drafts of this request observed there)` to its expected gain, so a new
request tries the deeper shapes until its own drafts have measured them, whatever the
engine-wide estimate it starts from says (that estimate can be far off: in issue 15's H200
run it put S5's accept length at 1.55 where S5 accepts 4.7, and batch 1 stayed plain).

Lossless whatever it chooses: the choice of step t is a function of the steps before t only
(their measured times and their acceptance counts), never of step t's random draws. (Under
CUDA graphs it is made while step t - 1 runs on the device, from the steps before t - 1:
AdaptiveWorker._while_device.) Given
that history, plain sampling emits exactly the target distribution, and so does speculative
sampling with any draft shape (the rejection rule is exact for any proposal). So every
step's tokens, conditioned on the past, follow the target distribution, and by induction the
whole output does; the choice only changes how many tokens a step produces and how fast.
Greedy outputs are the target's argmax chain whatever the step chose (a plain chain is k
greedy steps, each the same replay as a single one). The optimism that makes a request try
a shape is a function of its past drafts too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

PLAIN = "plain"          # a plain step of one token per request: its seconds
CHAIN = "chain"          # a plain step that decoded a chain of k tokens: its seconds / k
CATCHUP = "catchup"      # the draft catching up on plainly decoded tokens: seconds per token
#                          of each lagging request (charged to plain decoding, which caused it)
COST_VERSION = 2         # 2: chain cells; the acceptance summary without chain corrections
FREE_TRIES = 1           # a request's first speculative step is not held to the exploration budget
EXPLORE_ALLOWANCE = 1.0  # plain tokens' worth each new request adds to it
EXPLORE_CAP = 2.0        # unspent budget kept: at most this many plain tokens a request


def _block(rows: np.ndarray):
    """Index the per-row arrays by `rows`: a slice when they are consecutive and ascending (a
    batch's rows usually are), so reads are views and writes in place; else the rows."""
    n = len(rows)
    lo = int(rows[0])
    if int(rows[-1]) - lo == n - 1 and (n < 3 or bool((np.diff(rows) == 1).all())):
        return slice(lo, lo + n)
    return rows


@dataclass(frozen=True)
class Shape:
    S: int
    K: int
    N: int

    @property
    def label(self) -> str:
        return f"S{self.S}K{self.K}N{self.N}"


def bucket(n: int) -> int:
    """Costs are kept per power-of-two batch (the CUDA graph buckets up to 64)."""
    return 1 << max(0, (n - 1).bit_length())


# ---- costs ----------------------------------------------------------------------------------------
class CostTable:
    """Seconds per step for each (choice label, batch bucket) that has run. A cell's first
    observation is dropped on CUDA (a first call can include one-time work: a kernel
    compiled) and the next two seed it with their minimum; after that it is an exponential
    average with weight `alpha`, i.e. the mean step time, which is what tokens per second
    depend on. An observation is capped at 3x the estimate (a one-time spike: a compile, a
    page fault storm), and one below half the estimate moves it halfway (a seed taken in a
    slow moment). Until 2026-12-04 the average rose by `alpha` and fell by half the gap,
    which settles near a low quantile, not the mean: a choice whose steps vary (a speculative
    step with and without a draft catch-up, with more or fewer tokens to commit) was costed
    below its mean (on the H200 at batch 64, S5's cell read 6.8 ms against 7.5 ms a step
    measured end to end). A cell read from the disk cache is one observation short of known:
    the engine's first step of that choice (an exploration, as for a cell never measured)
    seeds it with the smaller of the two, so a cache written while the machine was busy
    cannot keep a choice out. Until 2026-12-06 a cached cell was known at once: on this
    CPU a run beside a test suite cached S5 at 591 ms a step (67 ms quiet), and the next
    engine decoded 2699 of 2729 held-out tokens plainly (0.92x plain; the periodic re-measure
    moves a cell halfway, at ever longer intervals, so it never recovered). `frozen`: tests
    fix the costs."""

    def __init__(self, path: Path | None = None, alpha: float = 0.1, drop_first: bool = True):
        """`drop_first`: discard a cell's first observation (on CUDA, where a first call
        compiles kernels; on CPU nothing compiles and exploring costs real time)."""
        self.path, self.alpha = path, alpha
        self.seed = 3 if drop_first else 2      # observations before a cell is known
        self.cells: dict[str, list[float]] = {}          # "label@bucket" -> [seconds, count]
        self.frozen = False
        self.epoch = 0        # bumped when a cell becomes known, and every 32 updates after
        self.saved_state: dict = {}     # the policy's acceptance summary, kept beside the costs
        self.state_fn = None            # () -> that summary, called when the table is saved
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text())
                if data.get("version") == COST_VERSION:
                    # one observation short of known: each cell is measured again by this
                    # engine's first step of it, which keeps the smaller of the two
                    self.cells = {k: [float(v[0]), min(int(v[1]), self.seed - 1)]
                                  for k, v in data["cells"].items()}
                    self.saved_state = dict(data.get("acceptance") or {})
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                self.cells, self.saved_state = {}, {}     # a damaged cache is rebuilt

    @classmethod
    def fixed(cls, per_request: dict[str, float], max_batch: int = 1024) -> "CostTable":
        """Frozen costs (tests): choice label -> seconds per request of a step, for every
        bucket (a step of b requests costs b times it)."""
        t = cls()
        b = 1
        while b <= max_batch:
            for label, sec in per_request.items():
                t.cells[cls.key(label, b)] = [sec * b, t.seed]
            b *= 2
        t.frozen = True
        return t

    @staticmethod
    def key(label: str, n: int) -> str:
        return f"{label}@{bucket(n)}"

    def known(self, label: str, n: int) -> bool:
        c = self.cells.get(self.key(label, n))
        return c is not None and c[1] >= self.seed

    def observe(self, label: str, n: int, seconds: float) -> None:
        if self.frozen or seconds <= 0:
            return
        k = self.key(label, n)
        c = self.cells.get(k)
        if c is None:      # with drop_first, the warm-up call is not kept
            self.cells[k] = [float("inf") if self.seed == 3 else seconds, 1]
        elif c[1] < self.seed:
            self.cells[k] = [min(c[0], seconds), c[1] + 1]
            if c[1] + 1 == self.seed:
                self.epoch += 1
                self.save()
        else:   # the mean: what throughput depends on (module docstring of CostTable)
            step = 0.5 if seconds < 0.5 * c[0] else self.alpha
            c[0] += step * (min(seconds, 3.0 * c[0]) - c[0])
            c[1] += 1
            if c[1] % 32 == 0:
                self.epoch += 1
            if c[1] % 64 == 0:
                self.save()

    def get(self, label: str, n: int) -> float | None:
        """The cell's seconds; an unknown cell is estimated from the same choice at another
        bucket: a chain's is the nearest known bucket's (the larger of two as near: a step
        of fewer requests costs no more), a shape's is scaled by plain decoding's ratio
        between the two buckets (None: no way to say). A plain cell of one-token steps is not
        estimated: the step it is needed for measures it, which costs nothing; a chain's
        exploration costs a whole chain (on an H100 at batch 16 the tail of a run, its last
        8, then 4, then 2 requests, explored a 32-token chain at each new bucket: ~80 of the
        run's ~240 ms, 2026-12-06)."""
        if self.known(label, n):
            return self.cells[self.key(label, n)][0]
        if label == CHAIN:
            return self._nearest(label, n)
        ref = next((r for r in (PLAIN, CHAIN) if self.known(r, n)), None)
        if label == PLAIN or (ref is None and self._nearest(CHAIN, n) is None):
            return None
        ref = ref or CHAIN
        here = self.get(ref, n)
        best = None
        for k, (sec, cnt) in self.cells.items():
            lab, _, b = k.rpartition("@")
            if lab == label and cnt >= self.seed and self.known(ref, int(b)):
                est = sec * here / self.cells[self.key(ref, int(b))][0]
                if best is None or abs(int(b) - bucket(n)) < best[0]:
                    best = (abs(int(b) - bucket(n)), est)
        return None if best is None else best[1]

    def _nearest(self, label: str, n: int) -> float | None:
        """`label`'s seconds at the known bucket nearest n's in powers of two (the larger of
        two as near)."""
        b, best = bucket(n).bit_length(), None
        for k, (sec, cnt) in self.cells.items():
            lab, _, kb = k.rpartition("@")
            if lab == label and cnt >= self.seed:
                d = (abs(int(kb).bit_length() - b), -int(kb))
                if best is None or d < best[0]:
                    best = (d, sec)
        return None if best is None else best[1]

    def save(self) -> None:
        if self.path is None or self.frozen:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            state = self.state_fn() if self.state_fn is not None else self.saved_state
            tmp.write_text(json.dumps({"version": COST_VERSION, "cells": self.cells,
                                       "acceptance": state}))
            os.replace(tmp, self.path)
        except OSError:
            pass                                          # a read-only cache dir: keep in memory


def cost_cache_path(identity: dict) -> Path | None:
    """Where this device + model + draft's costs are kept (None: `EAGLEKV_CACHE=""`)."""
    root = os.environ.get("EAGLEKV_CACHE", str(Path.home() / ".cache" / "eaglekv"))
    if not root:
        return None
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / "costs" / f"{key}.json"


# ---- acceptance -----------------------------------------------------------------------------------
@dataclass
class Choice:
    shape: Shape | None                # the spec part's shape (None: every request plain)
    spec: list[int] = field(default_factory=list)      # indices into the batch
    plain: list[int] = field(default_factory=list)
    explore: bool = False              # run to measure an unknown cost

    @property
    def label(self) -> str:
        if self.shape is None:
            return PLAIN
        return self.shape.label + ("" if not self.plain else "+plain")


class AdaptivePolicy:
    """The choice each step (see the module docstring). Per-request state lives in arrays
    indexed by the request's req_to_token row (a new request in a row starts from the
    engine-wide rates), so a batch-64 step costs a few vector ops, not 64 Python loops.

    `alpha`: a request's rate average; `alpha_engine`: the engine-wide one new requests start
    from; `alpha_prior`: the engine's slow average (a step's requests count as at most
    `step_weight` observations there: they share one moment of their generations, and one
    batch-64 step at the start of 64 stories must not overwrite what the engine learnt). A
    request that decodes plainly drifts (`beta` of the way a token) back to its own slow
    average (`alpha_slow`, started at the larger of the engine's two), so a request that was
    good and collapsed is tried again, and one that is steadily poor is not. A request switched
    off waits 2, 4, 8 ... up to `max_wait` plainly decoded tokens (doubling each time it is
    switched off again; each run of two speculative steps in a row halves the backoff again),
    then is tried if its drifted rates say so: a collapsed request costs its batch a probe now
    and then, ever more rarely. `optimism`: a request's expected gain under a shape gets, per
    draft position, `optimism / sqrt(1 + n)` more while n of its own drafts at that depth
    have been observed, so a few unlucky first drafts cannot switch speculation off for good,
    and a deeper shape is measured on each request before it is judged. A speculative step of
    depth S ages what the request saw deeper than S: those counts shrink by `forget` a step,
    so the optimism about depths not drafted lately grows back and a shallow shape cannot
    keep the deeper ones out on old evidence (they are measured again now and then).
    `shrink` (0: off; `CHAINED` under CUDA graphs): the choice reads each request's rates
    shrunk toward the engine's slow average as if that were `shrink` drafts of its own
    (`_own`).

    The optimism is budgeted once a request has drafts of its own: a choice that only the
    optimism makes (without it another one, or plain decoding, is worth more) is expected to
    cost time, cost - (its tokens without the optimism) / (the best value without it), in
    plain tokens' worth. It is taken only while what such choices cost so far stays within
    `explore_budget` of the tokens made plus `EXPLORE_ALLOWANCE` per request seen, else the
    best choice without optimism is taken. A request's first try is free (it measures the
    request), and a choice the estimates say pays is never held back. On a CPU where a speculative step costs 3-4 plain steps, each
    new request used to try S5 four or five times (the `make demo` prompt ran ~10% below
    plain)."""

    # the settings where choices run as chains of whole steps (CUDA graphs: AdaptiveWorker
    # sets them; hold_all and engine_after below). On an H100 at batch 1 (2026-12-06, the step traces of
    # bench/results/gpu_bench_h100_20261206_diag.json) a request's first chain, over the
    # hardest tokens of its answer, made the policy decode a 16-32 token plain chain and
    # then alternate S3 and S5 chains with single steps between: 0.79x the fixed S5. In
    # eaglekv.testing.adaptive_sim's replay of that (text with easy and hard stretches,
    # the H100's step costs) the policy as it was ran 0.972x the fixed S5 and with these
    # 1.000x; on text with longer hard stretches 0.972x -> 0.984x
    # (bench/results/adaptive_sim_cpu_20261206.json).
    CHAINED = {"shrink": 12.0, "alpha": 0.15, "hold_all": True, "engine_after": 6,
               "whole_batch": True}

    def __init__(self, shapes: list[Shape], costs: CostTable, prior: float = 0.7,
                 alpha: float = 0.3, alpha_engine: float = 0.05, alpha_prior: float = 0.01,
                 beta: float = 0.1, max_wait: int = 64, optimism: float = 0.5,
                 step_weight: int = 8, forget: float = 0.1, explore_budget: float = 0.01,
                 shrink: float = 0.0):
        self.shapes = list(shapes)
        self.depth = D = max(s.S for s in shapes)
        self.costs = costs
        self.alpha, self.alpha_engine, self.alpha_prior, self.beta = (alpha, alpha_engine,
                                                                      alpha_prior, beta)
        self.max_wait, self.optimism, self.step_weight = max_wait, optimism, step_weight
        self.forget = forget
        self.shrink = shrink
        # a request's first `engine_after` speculative steps teach its own rates only, not
        # the engine's (engine_rates, prior): the start of an answer, where the draft has the
        # least context, is systematically harder (the H100's traces: every request's first
        # S5 chain accepted ~1 draft a step, ~3.7 later), and at batch 64 sixty-four such
        # starts at once dragged the engine's averages down far enough that the whole batch
        # decoded two plain chains (2026-12-06)
        self.engine_after = 0
        self.explore_budget = explore_budget
        self.explore_cap = EXPLORE_CAP     # (read when built: the bench's `_nocap` modes)
        self.explore_spent = 0.0       # plain tokens' worth of time optimistic choices cost
        self.explore_room = 0.0        # EXPLORE_ALLOWANCE per request seen
        self.emitted = 0               # tokens the steps made, every request
        self.alpha_slow = 0.05
        start = prior ** np.arange(1, D + 1)
        self.engine_rates = start.copy()
        self.prior = start.copy()
        self.corr = {s: 1.0 for s in shapes}        # learnt for trees only (module docstring)
        self.seen = 0                       # the deepest draft position observed
        # per row: rates (rows, D), drafts seen, tokens to wait, failed probes, speculating,
        # owner rid
        self.rates = np.zeros((0, D))
        self.nobs = np.zeros((0, D))        # the request's own drafts observed at each depth
        self.slow = np.zeros((0, D))        # each request's slow average: where it drifts back
        self.wait = np.zeros(0, dtype=np.int64)
        self.probes = np.zeros(0, dtype=np.int64)
        self.on = np.zeros(0, dtype=bool)
        self.owner = np.zeros(0, dtype=np.int64)
        self.counts: dict[str, int] = {}
        self.explored = 0              # choices made to measure a cost (or re-measure it)
        self.last: Choice | None = None
        self.steps = 0
        self._curves: dict[tuple, np.ndarray] = {}
        self.refresh_every = 128
        self.next_refresh = 128
        self.replan_every = 8          # an all-plain choice holds this many tokens (batch > 1)
        self._plain_key, self._plain_left = None, 0
        # a speculative choice that pays on the estimates alone holds this many more steps of
        # the same batch (the choice's numpy work was ~0.1 ms of a 2.8 ms step at batch 1 on
        # the H200), unless a step accepts under half of what was expected (`_spec_left` = 0)
        self.hold_spec = 3
        self._spec_key, self._spec_left, self._spec_choice = None, 0, None
        self._one_sure = False
        # hold every whole-batch speculative choice, not only the sure ones (AdaptiveWorker,
        # where steps chain): a choice made on optimism then runs as a chain too. Held only
        # when sure, an optimistic S5 ran single steps on an H100 (a sync each, ~1.9 ms
        # against 1.6 in a chain), and their costs, averaged into S5's cell, made a shallower
        # shape look surer, so more of S5's steps were optimistic singles (2026-12-06)
        self.hold_all = False
        self.scalar_one = True         # observe_spec's batch-1 path in scalars (_observe_one)
        # where steps chain, a batch is split (some requests plain, the others speculating) only
        # when no shape pays for the whole batch: a split step runs its speculative part as one
        # step, not a chain, beside a plain step (two replays, a sync each), while a collapsed
        # request speculating in a whole-batch chain costs little more than its verify rows.
        # On an H100 at batch 64 (2026-12-06) eight split steps at the tail of a run made ~60
        # tokens each in ~4.3 ms; the S5 chains around them ~100 tokens a ms
        self.whole_batch = False
        self._all_known = None         # (bucket, epoch, chain, table) whose cells are all known
        # shapes deeper than `gated_depth` (None: none gated) are candidates for a batch only
        # while its requests' mean rate at draft position `gated_depth` is >= `gate_rate`:
        # only then can drafts past that depth be accepted often enough to pay for a longer
        # chain. Until then they are not explored, chosen or re-measured (`_open_shapes`).
        # The device defaults gate the 7-step chain behind S5 (config.ADAPTIVE_GATED_SHAPES):
        # added ungated, S7 was explored and chosen on held-out prompts where it loses (an
        # H100, 2026-12-06: 1.31x -> 1.17x plain at batch 1) while it wins on easy text
        # (the bench prompt: 1.76x -> 1.86x, the fixed S7 1.95x)
        self.gated_depth: int | None = None
        self.gate_rate = 0.5
        self._open = self.shapes
        self._restore(costs.saved_state)
        costs.state_fn = self._summary_state

    # ---- what the last engine learnt ------------------------------------------------------------
    def _summary_state(self) -> dict:
        return {"depth": self.depth, "engine_rates": self.engine_rates.tolist(),
                "prior": self.prior.tolist(), "seen": self.seen,
                "corr": {s.label: c for s, c in self.corr.items() if s.K > 1}}

    def _restore(self, st: dict) -> None:
        """Start from the acceptance the last engine on this device, model and draft saw
        (saved beside the costs): its rates as the prior, its trees' corrections. Each new
        request is still optimistic until its own drafts are observed. Ignored if
        malformed."""
        try:
            if st.get("depth") != self.depth:
                return
            rates = np.clip(np.array(st["engine_rates"], dtype=np.float64), 0.0, 1.0)
            prior = np.clip(np.array(st["prior"], dtype=np.float64), 0.0, 1.0)
            if rates.shape != (self.depth,) or prior.shape != rates.shape:
                return
            self.engine_rates, self.prior = rates, prior
            self.seen = int(min(max(int(st["seen"]), 0), self.depth))
            for s in self.shapes:
                c = st["corr"].get(s.label)
                if s.K > 1 and isinstance(c, (int, float)) and 0 < c <= 4:
                    self.corr[s] = float(c)
        except (KeyError, TypeError, ValueError, AttributeError):
            return

    # ---- per request ---------------------------------------------------------------------------
    def _rows(self, reqs) -> np.ndarray:
        """The requests' rows; a row whose request changed starts from the engine's rates."""
        if len(reqs) == 1:     # batch 1: no generator, no vector compare (host time a step)
            r = reqs[0]
            if r.row < len(self.owner) and self.owner[r.row] == r.rid:
                return np.array([r.row], dtype=np.int64)
        rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=len(reqs))
        rids = np.fromiter((r.rid for r in reqs), dtype=np.int64, count=len(reqs))
        if rows.max() >= len(self.owner):
            n = int(rows.max()) + 1
            grow = n - len(self.owner)
            self.rates = np.concatenate([self.rates, np.zeros((grow, self.depth))])
            self.nobs = np.concatenate([self.nobs, np.zeros((grow, self.depth))])
            self.slow = np.concatenate([self.slow, np.zeros((grow, self.depth))])
            self.wait = np.concatenate([self.wait, np.zeros(grow, dtype=np.int64)])
            self.probes = np.concatenate([self.probes, np.zeros(grow, dtype=np.int64)])
            self.on = np.concatenate([self.on, np.zeros(grow, dtype=bool)])
            self.owner = np.concatenate([self.owner, np.full(grow, -1, dtype=np.int64)])
        fresh = self.owner[rows] != rids
        if fresh.any():
            f = rows[fresh]
            self.rates[f], self.nobs[f] = self.engine_rates, 0.0
            self.slow[f] = np.maximum(self.engine_rates, self.prior)
            self.wait[f], self.probes[f], self.on[f] = 0, 0, False   # not switched off yet
            self.owner[f] = rids[fresh]
            self.explore_room += EXPLORE_ALLOWANCE * len(f)
            self._spec_left = self._plain_left = 0     # a new request: no held choice
        return rows

    def state(self, req):
        """A request's rates (a writable view of its row) and counters, for tests and logs."""
        row = int(self._rows([req])[0])
        return SimpleNamespace(rates=self.rates[row], nobs=self.nobs[row],
                               slow=self.slow[row], wait=int(self.wait[row]),
                               probes=int(self.probes[row]), speculating=bool(self.on[row]))

    def _own(self, rows: np.ndarray) -> np.ndarray:
        """(n, D) the requests' rates as the choice reads them: each position's average
        shrunk toward the engine's slow average `prior` as if that were w more drafts of the
        request's own, rate = (nobs * own + w * prior) / (nobs + w), w = shrink *
        (shrink / (shrink + nobs))**2 (the empirical-Bayes estimate of a request's acceptance
        from few drafts, the prior's weight fading as the request's own drafts accumulate:
        12 drafts' worth at the start, 3 after 12 of its own, 1.3 after 24). A request's
        first chain, often over the hardest tokens of its answer, cannot outweigh what every
        request before it showed; one whose drafts keep failing outweighs it after about two
        chains (a constant weight of 12 kept a collapsed request speculating for 21 steps in
        `test_switches_off_and_back_on_as_acceptance_changes`, against 13 now and 8 without
        shrinking)."""
        R = self.rates[rows]
        if self.shrink <= 0:
            return R
        n = self.nobs[rows]
        w = self.shrink * (self.shrink / (self.shrink + n)) ** 2
        return (n * R + w * self.prior) / (n + w)

    def expected(self, rates: np.ndarray, shape: Shape) -> float:
        """Expected accepted draft tokens under `shape` (rates made non-increasing)."""
        eff = np.minimum.accumulate(self._extrapolated(rates[None, :])[0, :shape.S])
        return min(self.corr[shape] * float(eff.sum()), float(shape.S))

    def _extrapolated(self, rates: np.ndarray) -> np.ndarray:
        """(n, D) rates with the positions deeper than any observed one continued at the
        last observed conditional rate (rate[d] / rate[d - 1]): a deep shape never tried is
        judged by how the acceptance falls off so far, not by the prior it started from."""
        d = self.seen
        if d == 0 or d >= self.depth:
            return rates
        out = rates.copy()
        last = out[:, d - 1]
        q = np.clip(last / np.maximum(out[:, d - 2], 1e-6), 0.0, 1.0) if d >= 2 else last
        for i in range(d, self.depth):
            out[:, i] = out[:, i - 1] * q
        return out

    def _bonus(self, rows: np.ndarray) -> np.ndarray:
        """(n, D) optimism for what each request has seen little of: bonus[b, i] = the sum
        over draft positions d <= i of `optimism / sqrt(1 + its drafts observed at d)` (a
        depth it never drafted adds the whole `optimism`, so it tries a deeper shape and
        measures it). Under shape s a request's gain gets bonus[b, S_s - 1]."""
        return self.optimism * (1.0 / np.sqrt(1.0 + self.nobs[rows])).cumsum(1)

    # ---- the choice ----------------------------------------------------------------------------
    def choose(self, reqs, chain: bool = False) -> Choice:
        """`chain`: an all-plain step of this batch would decode a chain (greedy, decode
        graphs, num_scheduler_steps > 1), so plain decoding is valued at the chain's seconds
        per token; a split step's plain part is one token a request."""
        B = len(reqs)
        costs = self.costs
        self.steps += 1
        alone = CHAIN if chain else PLAIN              # the all-plain step's cost cell
        rows = self._rows(reqs)
        self._open = self._open_shapes(rows)
        known = (bucket(B), costs.epoch, chain, id(costs), len(self._open))
        if self._all_known != known:          # whether a cell is None changes only with the
            if self._alone_cost(alone, B) is None:            # epoch (or the gate)
                return self._chosen(Choice(None, [], list(range(B)), explore=True))
            for s in self._open:            # a shape never measured at this size: try it
                if costs.get(s.label, B) is None:
                    return self._chosen(Choice(s, list(range(B)), [], explore=True))
            self._all_known = known
        key = (rows.tobytes(), self.costs.epoch, chain)
        if self._spec_key == key and self._spec_left > 0:
            self._spec_left -= 1          # the same batch: the last sure choice holds
            return self._chosen(self._refresh(B, self._spec_choice) or self._spec_choice)
        self._spec_key = None
        if self._plain_key == key and self._plain_left > 0:
            # an all-plain batch as before: rates only drift
            return self._chosen(self._refresh(B, None) or Choice(None, [], list(range(B))))
        self._plain_key = None
        waiting = self.wait[rows] > 0
        if waiting.all():
            return self._chosen(self._refresh(B, None) or Choice(None, [], list(range(B))))
        per_token = self._alone_cost(alone, B) + self.catch_up_cost(B)
        room = self._room(reqs)
        if B == 1:      # the latency case, in scalars (numpy's per-call cost would dominate)
            c = self._choose_one(int(rows[0]), self._extrapolated(self._own(rows))[0],
                                 self._bonus(rows)[0], per_token,
                                 np.inf if room is None else float(room[0]))
            return self._chosen(self._hold(key, c) if self._one_sure else c)
        # (B, D) rates made non-increasing, summed: cum[b, i] = expected accepted of depth i+1
        cum = np.minimum.accumulate(self._extrapolated(self._own(rows)), axis=1).cumsum(1)
        bonus = self._bonus(rows)                                              # (B, D)
        k = np.arange(B + 1)                                                   # spec part size
        plain_cost = self._cost_curve(PLAIN, B)                                # [n] for n = 0..B
        best_v, best = B / per_token, Choice(None, [], list(range(B)))
        sure_v, sure, best_tc = best_v, best, None       # without the optimism; best's (t, c)
        whole_v, whole = best_v, None                    # the whole batch (`whole_batch`)
        for s in self._open:
            gain = np.minimum(self.corr[s] * cum[:, s.S - 1], s.S)
            if room is not None:
                gain = np.minimum(gain, room)
            if self.whole_batch:    # the waiting requests too, at their own rates
                v = (B + float(gain.sum())) / self._cost_curve(s.label, B)[B]
                if v > whole_v:
                    whole_v, whole = v, Choice(s, list(range(B)), [])
            gain = np.where(waiting, -np.inf, gain)
            opt = bonus[:, s.S - 1]                                            # (B,)
            if room is not None:                 # nothing to learn past a budget's end
                opt = np.where(room < s.S, 0.0, opt)
            order = np.argsort(-(gain + opt), kind="stable")
            g, u = gain[order], opt[order]
            usable = int(np.isfinite(g).sum())                 # the waiting ones sort last
            # k requests' expected gains, plus their optimism added as independent errors
            # (sqrt of the sum of squares): k fresh requests are not k times as uncertain
            tokens = B + np.concatenate([[0.0], np.cumsum(g[:usable])
                                         + np.sqrt(np.cumsum(u[:usable] ** 2))])  # k = 0..usable
            cost = self._cost_curve(s.label, B)[:usable + 1] + plain_cost[B - k[:usable + 1]]
            value = tokens / cost
            value[0] = -np.inf                                 # k = 0 is plain decoding
            i = int(np.argmax(value)) if usable else 0
            sure_t = B + np.concatenate([[0.0], np.cumsum(g[:usable])])
            if usable and value[i] > best_v:
                best_v, best_tc = value[i], (float(sure_t[i]), float(cost[i]))
                best = Choice(s, sorted(order[:i].tolist()), sorted(order[i:].tolist()))
            sv = sure_t / cost
            sv[0] = -np.inf
            j = int(np.argmax(sv)) if usable else 0
            if usable and sv[j] > sure_v:
                sure_v = sv[j]
                sure = Choice(s, sorted(order[:j].tolist()), sorted(order[j:].tolist()))
        if (best_tc is not None and (best.shape, best.spec) != (sure.shape, sure.spec)
                and (self.nobs[rows[best.spec], 0] >= FREE_TRIES).all()
                and not self._afford((best_tc[1] - best_tc[0] / sure_v) * B / per_token
                                     * self._run_steps(), B)):
            best = sure
        if whole is not None and best.plain:     # a split (or plain) where the whole batch pays
            best = whole
        if best.shape is None:         # reuse for the next few tokens of the same batch
            self._plain_key, self._plain_left = key, self.replan_every
        elif best == sure or self.hold_all:    # without the optimism (or any, chained)
            self._hold(key, best)
        return self._chosen(self._refresh(B, best) or best)

    def _open_shapes(self, rows: np.ndarray) -> list[Shape]:
        """The candidates for a batch of these rows: every shape, or (`gated_depth` set) those
        no deeper than it while the rows' mean rate there is below `gate_rate`."""
        if self.gated_depth is None:
            return self.shapes
        d = self.gated_depth - 1
        r = self._own(rows)[:, d]
        if float(r.mean()) >= self.gate_rate:
            return self.shapes
        return [s for s in self.shapes if s.S <= self.gated_depth]

    def _room(self, reqs) -> np.ndarray | None:
        """(B,) drafts each request can still use: its budget left (max_new_tokens) less the
        token a step makes anyway; None while no request is within the deepest shape's reach
        of its budget's end (the common case: no cap). A request 1 token from its end gains
        nothing from a speculative step: on an H100 the last step of a batch-16 run was an S5
        step (2.35 ms) for one token where a plain one costs ~0.8 ms (2026-12-06). The
        budget is a count of past tokens: the choice stays a function of the past."""
        room = np.fromiter((r.params.max_new_tokens - len(r.output_ids) - 1 for r in reqs),
                           dtype=np.float64, count=len(reqs)) if hasattr(reqs[0], "params") \
            else None
        if room is None or room.min() >= self.depth:
            return None
        return np.maximum(room, 0.0)

    def _alone_cost(self, alone: str, B: int) -> float | None:
        """Seconds a token of an all-plain step of B requests (`alone`: CHAIN or PLAIN). Where
        steps chain (`whole_batch`), a one-token plain step not measured at B's bucket is
        taken from the nearest bucket's, else from the chain's: such steps come only at the
        end of requests' budgets (a chain needs two tokens left) or with sampling requests,
        and exploring one there cost a 1-2 ms step of a few tokens where a chain of
        speculative steps would have run (an H100 at batch 64, 2026-12-06). Elsewhere (the
        CPU) it is measured by the step that needs it."""
        c = self.costs.get(alone, B)
        if c is None and alone == PLAIN and self.whole_batch:
            c = self.costs._nearest(PLAIN, B)
            c = self.costs.get(CHAIN, B) if c is None else c
        return c

    def _run_steps(self) -> int:
        """Steps a whole-batch speculative choice runs before the next choice (a held one:
        1 + hold_spec); what an optimistic choice's cost is multiplied by."""
        return 1 + self.hold_spec if self.hold_all else 1

    def held_steps(self) -> int:
        """Steps the choice just made is held beyond this one (the same batch, a sure choice:
        `_hold`): a worker may run them now, chained before one sync (`consume_held`)."""
        return self._spec_left if self._spec_key is not None else 0

    def consume_held(self, n: int) -> None:
        """`n` held steps ran chained with the step just chosen: they are not chosen again."""
        self._spec_left = max(0, self._spec_left - n)

    def _hold(self, key, c: Choice) -> Choice:
        """A speculative choice of the whole batch, made without the optimism and not an
        exploration: kept for the next `hold_spec` steps of the same batch (`key`)."""
        if c.shape is not None and not c.explore and not c.plain and self.hold_spec > 0:
            self._spec_key, self._spec_left, self._spec_choice = key, self.hold_spec, c
        return c

    def _choose_one(self, row: int, rates: np.ndarray, bonus: np.ndarray,
                    per_token: float, room: float = np.inf) -> Choice:
        """Batch 1: the request's row, rates (D,) and bonus (D,); plain costs `per_token`;
        `room`: the drafts its budget can still use (`_room`)."""
        best_v, best, best_tc = 1 / per_token, Choice(None, [], [0]), None   # with optimism
        sure_v, sure = best_v, best                                          # without
        run, total = float("inf"), 0.0
        sums = []
        for r in rates.tolist():          # expected accepted of each depth, rates non-increasing
            run = min(run, r)
            total += run
            sums.append(total)
        bonus = bonus.tolist()
        for s in self._open:
            tokens = 1 + min(self.corr[s] * sums[s.S - 1], s.S, room)
            cost = self._cost_curve(s.label, 1)[1]
            v = (tokens + (bonus[s.S - 1] if room >= s.S else 0.0)) / cost
            if v > best_v:
                best_v, best, best_tc = v, Choice(s, [0], []), (tokens, cost)
            if tokens / cost > sure_v:
                sure_v, sure = tokens / cost, Choice(s, [0], [])
        if best_tc is not None and best.shape != sure.shape and self.nobs[row, 0] >= FREE_TRIES:
            tokens, cost = best_tc
            if not self._afford((cost - tokens / sure_v) / per_token * self._run_steps()):
                best = sure
        self._one_sure = best == sure or self.hold_all     # may be held
        return self._refresh(1, best) or best

    def plain_horizon(self, reqs, longest: int) -> int:
        """How many tokens an all-plain step of `reqs` chosen just now should decode before
        the batch is chosen for again (the length of its chain, at most `longest`).

        A batch whose every request waits out a backoff decodes the shortest wait; else one
        chosen plain on its estimates decodes until the drift of its rates back toward their
        slow averages (`observe_plain`: 1 - (1 - beta)^n of the way after n tokens) would make
        a shape pay again, the first of n = 1, 2, 4, ... that does, or `longest` if none
        does: a dip in good requests' acceptance costs a few plain tokens, not a whole chain
        of 32. At batch 1 on an H100 one such chain cost about 30 tokens a request (0.76x the
        fixed S5's speed); at batch 64 (2026-12-06, the EAGLE-3 head) the start of 64 answers,
        the hardest tokens for the draft, made the batch decode a 32-token plain chain (36 ms)
        where S5 then accepted 4 drafts a step again (~16 ms for those tokens). A batch is
        judged by its requests' mean rates (the waiting ones left out). Lossless like the
        choice: a function of the past steps' acceptance only."""
        if longest <= 1:
            return max(longest, 1)
        B = len(reqs)
        rows = self._rows(reqs)
        wait = self.wait[rows]
        if (wait > 0).all():
            return min(int(wait.min()), longest)
        per_token = self._cost_curve(PLAIN, B)[B]
        chain = self.costs.get(CHAIN, B)
        if chain is not None:
            per_token = chain + self.catch_up_cost(B)
        live = rows[wait <= 0]
        rates, slow = self._own(live).mean(0), self.slow[live].mean(0)
        shapes = self._open_shapes(live)
        n = 1
        while n < longest:
            drifted = rates + (1 - (1 - self.beta) ** n) * (slow - rates)
            if self._spec_value(self._extrapolated(drifted[None, :])[0], B,
                                shapes) > B / per_token:
                break
            n *= 2
        n = min(n, longest)
        self._plain_left = min(self._plain_left, n)     # the batch is chosen for after it
        return n

    def _spec_value(self, rates: np.ndarray, B: int = 1, shapes=None) -> float:
        """The best shape's (of `shapes`, default all) expected tokens per second for a step
        of B requests with these rates each, without the optimism (at batch 1
        `_choose_one`'s sure value)."""
        run, total, sums = float("inf"), 0.0, []
        for r in rates.tolist():
            run = min(run, r)
            total += run
            sums.append(total)
        return max(B * (1 + min(self.corr[s] * sums[s.S - 1], s.S))
                   / self._cost_curve(s.label, B)[B] for s in (shapes or self.shapes))

    def catch_up_cost(self, n: int) -> float:
        """Seconds a plainly decoded token of each of n requests costs later, when the draft
        catches up on it before their next speculative step (0 until measured at n's
        bucket: a dict lookup, this runs every step)."""
        c = self.costs.cells.get(CostTable.key(CATCHUP, n))
        return c[0] if c is not None and c[1] >= self.costs.seed else 0.0

    def _afford(self, loss: float, B: int = 1) -> bool:
        """An optimistic choice for a step of B requests expected to cost `loss` plain tokens'
        worth of time: whether the exploration budget has room (then it is spent). What is
        not spent does not pile up past `EXPLORE_CAP` plain tokens a request of the step:
        with a draft whose drafts always fail (a random head, `adaptive_random_draft`) on
        this CPU, the budget that the earlier requests left let each new batch-1 request try
        S5 and S3 eight times before it decoded plainly (0.90x plain, 2026-12-06)."""
        if loss <= 0:
            return True
        room = self.explore_room + self.explore_budget * self.emitted - self.explore_spent
        cap = self.explore_cap * B
        if room > cap:                     # the excess is forfeited, not saved
            self.explore_spent += room - cap
            room = cap
        if loss > room:
            return False
        self.explore_spent += loss
        return True

    def _cost_curve(self, label: str, B: int) -> np.ndarray:
        """[n] seconds of a step of n requests for n = 0..B (0 at n = 0, inf if unknown),
        recomputed when the cost table's epoch moves. A one-token plain step not measured at
        a size yet is estimated by the chain's seconds per token there (a split step, which
        needs it, then measures it)."""
        key = (label, B, self.costs.epoch, id(self.costs))
        hit = self._curves.get(key)
        if hit is not None:
            return hit
        if len(self._curves) > 4096:
            self._curves.clear()
        out = np.zeros(B + 1)
        cache: dict[int, float] = {}
        for n in range(1, B + 1):
            b = bucket(n)
            if b not in cache:
                c = self.costs.get(label, n)
                if c is None and label == PLAIN:
                    c = self.costs.get(CHAIN, n)
                if c is not None and label == PLAIN:
                    c += self.catch_up_cost(n)
                cache[b] = np.inf if c is None else c
            out[n] = cache[b]
        self._curves[key] = out
        return out

    def _refresh(self, B: int, best: Choice | None) -> Choice | None:
        """Now and then (every `refresh_every` steps, then less often) re-measure the whole
        batch under a shape not chosen lately, so a cost measured badly once, or one that
        drifted (longer contexts), cannot keep a shape out for good."""
        if self.steps < self.next_refresh or self.costs.frozen:
            return None
        self.refresh_every = min(2 * self.refresh_every, 4096)
        self.next_refresh = self.steps + self.refresh_every
        stale = [s for s in self._open if best is None or best.shape != s]
        if not stale:
            return None
        s = stale[(self.steps // self.refresh_every) % len(stale)]
        return Choice(s, list(range(B)), [], explore=True)

    def _chosen(self, c: Choice) -> Choice:
        self.counts[c.label] = self.counts.get(c.label, 0) + 1
        self.explored += c.explore
        self.last = c
        return c

    # ---- what happened -------------------------------------------------------------------------
    def observe_plain(self, reqs, tokens: int = 1) -> None:
        """Requests that decoded `tokens` each plainly (a chain: k) drift back toward their
        slow average, `beta` of the way a token, and count the tokens off their wait (see the
        class doc)."""
        rows = self._rows(reqs)
        off = rows[self.on[rows]]             # switched off now: wait before the next try
        self.probes[off] += 1
        self.wait[off] = np.minimum(2 ** np.minimum(self.probes[off], 30), self.max_wait)
        self.on[rows] = False
        self.wait[rows] = np.maximum(0, self.wait[rows] - tokens)
        drift = 1 - (1 - self.beta) ** tokens
        self.rates[rows] += drift * (self.slow[rows] - self.rates[rows])
        self._plain_left -= tokens
        self.emitted += tokens * len(reqs)

    def observe_spec(self, reqs, shape: Shape, accepted: list[int | None]) -> None:
        """Accepted draft tokens of each request of a speculative step (None: it failed)."""
        keep = [i for i, a in enumerate(accepted) if a is not None]
        if not keep:
            self._spec_left = 0
            return
        self.emitted += len(keep) + sum(accepted[i] for i in keep)
        if len(keep) == 1 and shape.K == 1 and self.scalar_one:
            self._observe_one(reqs[keep[0]], shape.S, int(accepted[keep[0]]))
            return
        rows = self._rows([reqs[i] for i in keep])
        a = np.array([accepted[i] for i in keep], dtype=np.float64)           # (m,)
        S, m = shape.S, len(keep)
        at = _block(rows)           # a slice where the rows are consecutive: views, no gathers
        on = self.on[at]
        probes = self.probes[at]    # speculating two steps in a row: the backoff shrinks
        self.probes[at] = np.where(on, np.maximum(0, probes - 1), probes)
        self.on[at] = True
        R, slow, nobs = self.rates[at], self.slow[at], self.nobs[at]          # (m, D) each
        teach = nobs[:, 0] >= self.engine_after    # the engine learns from these (class doc)
        est = np.minimum.accumulate(R[:, :S], axis=1).sum(1)                  # (m,)
        if a.sum() < 0.5 * est.sum() or m < len(accepted):
            self._spec_left = 0        # a poor (or failed) step: choose again next step
        w = min(m, self.step_weight)           # a step's requests: at most step_weight
        if shape.K > 1:                        # observations; w sequential EMA steps, in one
            # calibrated against the chain sum the choice reads (`_own`: under the chained
            # settings the rates shrunk toward the engine's; against the raw rates, a tree run
            # at a request's hard start learnt a correction that then overrated it later)
            own = est if self.shrink <= 0 else np.minimum.accumulate(
                self._own(rows)[:, :S], axis=1).sum(1)
            ok = own > 0.05
            if ok.any():
                ratio = float(np.minimum(a[ok] / own[ok], 4.0).mean())
                self.corr[shape] += (1 - 0.98 ** min(int(ok.sum()), w)) * (ratio - self.corr[shape])
        x = (a[:, None] >= np.arange(1, S + 1)[None, :]).astype(np.float64)   # (m, S)
        last = R[:, S - 1].copy()
        R[:, :S] += self.alpha * (x - R[:, :S])
        if S < self.depth:   # the positions this shape does not reach follow its last one,
            nobs[:, S:] *= 1 - self.forget    # and what they showed ages
            scale = np.where(last > 0.05, R[:, S - 1] / np.maximum(last, 0.05), 1.0)
            R[:, S:] = np.minimum(R[:, S:] * scale[:, None], R[:, S - 1:S])
        slow[:, :S] += self.alpha_slow * (x - slow[:, :S])
        nobs[:, :S] += 1
        if not isinstance(at, slice):          # gathered copies: write them back
            self.rates[at], self.slow[at], self.nobs[at] = R, slow, nobs
        if teach.any():
            mean = x[teach].mean(0)
            w = min(int(teach.sum()), self.step_weight)
            self.engine_rates[:S] += (1 - (1 - self.alpha_engine) ** w) * (mean - self.engine_rates[:S])
            self.prior[:S] += (1 - (1 - self.alpha_prior) ** w) * (mean - self.prior[:S])
        self.seen = max(self.seen, S)

    def observe_chain(self, reqs, shape: Shape, accepted: list[list[int | None]]) -> None:
        """A chain's k steps of `reqs` under `shape`: accepted[j][i], request i at step j
        (None: it stopped, or failed). The same as k `observe_spec` calls in order (tested
        equal), in one pass where every request ran every step of a chain shape (K = 1) and
        more than one request speculated: the per-step numpy work was ~0.5 ms of a batch-16
        chain's host time (bench/host_step.py), against ~13 ms for the chain on an H100."""
        k, m = len(accepted), len(reqs)
        whole = all(a is not None for step in accepted for a in step)
        if k == 1 or shape.K > 1 or not whole or (m == 1 and self.scalar_one):
            for step in accepted:
                self.observe_spec(reqs, shape, list(step))
            return
        A = np.asarray(accepted, dtype=np.float64)                            # (k, m)
        self.emitted += int(A.size + A.sum())
        rows = self._rows(reqs)
        S = shape.S
        at = _block(rows)
        on = self.on[at]                # sequentially: -1 on the first step if it was on,
        self.probes[at] = np.maximum(0, self.probes[at] - (k - 1) - on)   # then each step
        self.on[at] = True
        R, slow, nobs = self.rates[at], self.slow[at], self.nobs[at]          # (m, D) each
        X = (A[:, :, None] >= np.arange(1, S + 1)).astype(np.float64)         # (k, m, S)
        n0 = nobs[:, 0].copy()
        deep = S < self.depth
        for j in range(k):              # the rates step by step (a poor step, the deep follow)
            est = np.minimum.accumulate(R[:, :S], axis=1).sum()
            if A[j].sum() < 0.5 * est:
                self._spec_left = 0
            last = R[:, S - 1].copy() if deep else None
            R[:, :S] += self.alpha * (X[j] - R[:, :S])
            if deep:
                scale = np.where(last > 0.05, R[:, S - 1] / np.maximum(last, 0.05), 1.0)
                R[:, S:] = np.minimum(R[:, S:] * scale[:, None], R[:, S - 1:S])
        if deep:
            nobs[:, S:] *= (1 - self.forget) ** k
        keep = (1 - self.alpha_slow) ** np.arange(k - 1, -1, -1)             # (k,) newest 1
        slow[:, :S] = ((1 - self.alpha_slow) ** k) * slow[:, :S] + self.alpha_slow * np.einsum(
            "j,jms->ms", keep, X)
        nobs[:, :S] += k
        if not isinstance(at, slice):
            self.rates[at], self.slow[at], self.nobs[at] = R, slow, nobs
        for j in range(k):              # the engine's averages, from the requests past their start
            teach = n0 + j >= self.engine_after
            t = int(teach.sum())
            if t:
                mean = X[j][teach].mean(0)
                w = min(t, self.step_weight)
                self.engine_rates[:S] += (1 - (1 - self.alpha_engine) ** w) * (
                    mean - self.engine_rates[:S])
                self.prior[:S] += (1 - (1 - self.alpha_prior) ** w) * (mean - self.prior[:S])
        self.seen = max(self.seen, S)

    def _observe_one(self, req, S: int, a: int) -> None:
        """observe_spec for one request of a chain shape, in Python scalars: the same
        arithmetic element by element (tested equal), without numpy's per-call cost, which at
        batch 1 was most of the policy's host time a step (bench/host_step.py)."""
        row = int(self._rows([req])[0])
        if self.on[row]:
            self.probes[row] = max(0, int(self.probes[row]) - 1)
        self.on[row] = True
        rates, slow, nobs = self.rates[row], self.slow[row], self.nobs[row]
        run, est = float("inf"), 0.0
        for i in range(S):
            run = min(run, float(rates[i]))
            est += run
        if a < 0.5 * est:
            self._spec_left = 0        # a poor step: choose again next step
        teach = nobs[0] >= self.engine_after
        ge = 1 - (1 - self.alpha_engine) ** 1 if teach else 0.0
        gp = 1 - (1 - self.alpha_prior) ** 1 if teach else 0.0
        last = float(rates[S - 1])
        for i in range(S):
            x = 1.0 if a >= i + 1 else 0.0
            rates[i] += self.alpha * (x - rates[i])
            slow[i] += self.alpha_slow * (x - slow[i])
            nobs[i] += 1
            self.engine_rates[i] += ge * (x - self.engine_rates[i])
            self.prior[i] += gp * (x - self.prior[i])
        if S < self.depth:   # as observe_spec: the deeper positions follow position S
            top = float(rates[S - 1])
            scale = top / max(last, 0.05) if last > 0.05 else 1.0
            for i in range(S, self.depth):
                rates[i] = min(rates[i] * scale, top)
                nobs[i] *= 1 - self.forget
        self.seen = max(self.seen, S)

    # ---- saying why ----------------------------------------------------------------------------
    def plain_cost(self, batch: int) -> float | None:
        """Seconds per token of plain decoding at `batch`: of a chain where one was measured."""
        c = self.costs.get(CHAIN, batch)
        return self.costs.get(PLAIN, batch) if c is None else c

    def summary(self, batch: int = 1) -> str:
        """One sentence: what the steps were and why, at `batch` (e.g. for `make demo`)."""
        counts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items(),
                                                         key=lambda kv: -kv[1]))
        plain = self.plain_cost(batch)
        best = None
        for s in self.shapes:
            c = self.costs.get(s.label, batch)
            if plain is not None and c is not None:
                e = 1 + self.expected(self.engine_rates, s)
                if best is None or e / c > best[0]:
                    best = (e / c, s, c / plain, e)
        if best is None:
            why = "costs not measured yet"
        else:
            _, s, ratio, e = best
            on = e > ratio
            why = (f"speculation {'pays' if on else 'off'} at batch {batch} on this machine: "
                   f"the best shape {s.label} costs {ratio:.2f} plain tokens for an expected "
                   f"accept length {e:.2f}")
        return f"adaptive steps: {counts or 'none'}; {why}"

    def explain(self, batch: int) -> str:
        """One line per choice at `batch`: its cost against plain decoding (per token, of a
        chain where one ran), the tokens a step is expected to give with the engine-wide
        acceptance, and tokens/s."""
        plain = self.plain_cost(batch)
        if plain is None:
            return f"batch {batch}: plain decoding not measured yet"
        how = "a token in chains" if self.costs.known(CHAIN, batch) else "a step"
        lines = [f"batch {batch}: plain {1e3 * plain:.2f} ms {how}, "
                 f"{batch / plain:.1f} tok/s"]
        for s in self.shapes:
            c = self.costs.get(s.label, batch)
            e = 1 + self.expected(self.engine_rates, s)
            lines.append(f"  {s.label}: " + ("cost unknown" if c is None else
                         f"{1e3 * c:.1f} ms/step = {c / plain:.2f} plain tokens, expected "
                         f"accept length {e:.2f} -> {batch * e / c:.1f} tok/s"))
        return "\n".join(lines)
