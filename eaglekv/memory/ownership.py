"""Slot ownership, a checked mode: which request row owns each KV slot, and the checks that a
step writes, moves and frees only slots it may.

    owner[slot] = FREE (0)    not handed out
                  PAD (-2)    the padding page [0, page_size): dummy rows may write it
                  FRESH (-1)  handed out by the allocator, not yet committed to a request
                              (this step's plan slots, draft slots, the verify window)
                  r > 0       committed to req_to_token row r (a position < its kv_len)

Transitions: the allocator marks what it hands out FRESH and what it takes back FREE
(`on_alloc`, `on_free`); `begin_step` (the engine, after planning, before the runner) commits
every running request's slots before its step to its row, after checking that they are FRESH
or already its own. Checks, each raising `KVOwnershipError` (a `KVIndexError`, so the engine
fails only the step's requests and keeps serving) before anything is written:

  begin_step   a request's row holds a slot committed to another row (req_to_token corrupt)
  write        a K/V store into a committed slot: a step only writes slots handed out in it
               (`lenient` pools, the adaptive draft catching up over its requests' own
               tokens: also slots committed to a row of this step)
  move         dst as a write; src FRESH, PAD or committed to a row of this step
  free         (AllocatorError) freeing a row's committed slot without every other slot of
               that row its req_to_token row still references: only a release frees those

Granularity: a committed slot is pinned to its row (another request's committed KV can never
be written, moved over or freed by a step); a FRESH slot is known to be in flight, not for
which request of the step. Reads are checked against the pool range (`guard_indices`) and
by `begin_step` for the committed rows, not per read. Off by default: the allocator and the
pools test one attribute for None. On: `Engine.check_ownership()` or EAGLEKV_CHECK_OWNERSHIP=1.
"""

from __future__ import annotations

import torch

from eaglekv.errors import AllocatorError, KVIndexError

FREE, FRESH, PAD = 0, -1, -2


class KVOwnershipError(KVIndexError):
    """A valid slot that the step may not touch: it belongs to another request."""

    def __init__(self, op: str, slot: int, owner: int, allowed: str, num_bad: int,
                 num_total: int, layer: int | None = None, limit: int = 0):
        self.op, self.first_bad, self.limit, self.owner = op, slot, limit, owner
        self.num_bad, self.num_total, self.layer, self.low = num_bad, num_total, layer, 0
        self.step_bad, self.allowed = None, allowed
        where = f"{op} (layer {layer}, " if layer is not None else f"{op} ("
        super(KVIndexError, self).__init__(
            f"slot {slot} in {where}{num_bad} of {num_total} indices bad) is "
            f"{describe(owner)}; this step may only touch {allowed}")

    def with_layer(self, layer: int) -> "KVOwnershipError":
        return KVOwnershipError(self.op, self.first_bad, self.owner, self.allowed, self.num_bad,
                                self.num_total, layer=layer, limit=self.limit)


def describe(owner: int) -> str:
    return {FREE: "free (not handed out)", FRESH: "in flight (handed out, uncommitted)",
            PAD: "the padding page"}.get(owner, f"committed to request row {owner}")


class SlotOwners:
    def __init__(self, num_slots: int, page_size: int, req_to_token):
        """`req_to_token`: the ReqToTokenPool whose rows the owners are."""
        self.owner = torch.zeros(num_slots, dtype=torch.int64)                  # (slots,)
        self.owner[:page_size] = PAD
        self.req_to_token = req_to_token
        self.step_rows = torch.zeros(0, dtype=torch.int64)    # rows of the running step

    # ---- the allocator's side ---------------------------------------------------------------
    def on_alloc(self, slots: torch.Tensor) -> None:
        self.owner[slots] = FRESH

    def on_free(self, slots: torch.Tensor) -> None:
        """Check a free (slots int64 cpu, in range, in use), then mark them FREE."""
        own = self.owner[slots]
        for r in own[own > 0].unique().tolist():
            table = self.req_to_token.req_to_token[r].to("cpu", torch.int64)
            still = table[(table >= 0) & (table < self.owner.numel())]
            held = still[self.owner[still] == r].unique()      # its committed, referenced
            missing = held[~torch.isin(held, slots)]
            if missing.numel():
                raise AllocatorError(
                    f"ownership: free of slot {int(slots[own == r][0])} committed to request "
                    f"row {r} without the rest of that row ({missing.numel()} of its slots, "
                    f"e.g. {missing[:3].tolist()}, stay referenced): only the release of "
                    f"row {r} frees its committed slots")
        self.owner[slots] = FREE

    # ---- the engine's side ------------------------------------------------------------------
    def begin_step(self, running, plan) -> None:
        """Commit each running request's slots before this step to its row (checking them),
        and note the step's rows; the plan's new slots stay FRESH."""
        new = {}
        if plan.kind == "extend":
            new = {id(r): p for r, p in zip(plan.reqs, plan.prefix_lens)}
        r2t = self.req_to_token.req_to_token
        stepping = {id(r) for r in plan.reqs}
        for r in running:
            upto = new.get(id(r), r.kv_len)
            if not r.row or not r.kv_len:
                continue
            slots = r2t[r.row, :r.kv_len].to("cpu", torch.int64)                 # (kv_len,)
            if id(r) not in stepping:     # checked when it steps; its new slots commit now
                ok = (slots[:upto] >= 0) & (slots[:upto] < self.owner.numel())
                s = slots[:upto][ok]
                self.owner[s[self.owner[s] == FRESH]] = r.row
                continue
            ok_range = (slots >= 0) & (slots < self.owner.numel())
            if not bool(ok_range.all()):
                bad = slots[~ok_range]
                raise KVIndexError("req_to_token row", int(bad[0]), self.owner.numel(),
                                   bad.numel(), slots.numel())
            own = self.owner[slots]
            old, fresh = own[:upto], own[upto:]
            bad = torch.cat([slots[:upto][(old != FRESH) & (old != r.row)],
                             slots[upto:][fresh != FRESH]])
            if bad.numel():
                s = int(bad[0])
                raise KVOwnershipError("req_to_token row", s, int(self.owner[s]),
                                       f"its own slots (row {r.row})", bad.numel(),
                                       slots.numel(), limit=self.owner.numel())
            self.owner[slots[:upto]] = r.row
        self.step_rows = torch.tensor([r.row for r in plan.reqs], dtype=torch.int64)

    def scrub(self, reqs) -> None:
        """A failed step: clear entries of the requests' rows that point at another row's
        committed slot, so that their release frees only what is theirs."""
        r2t = self.req_to_token.req_to_token
        for r in reqs:
            if not r.row or not r.kv_len:
                continue
            slots = r2t[r.row, :r.kv_len].to("cpu", torch.int64)
            ok = (slots >= 0) & (slots < self.owner.numel())
            own = torch.full_like(slots, FREE)
            own[ok] = self.owner[slots[ok]]
            foreign = (own > 0) & (own != r.row)
            if foreign.any():
                r2t[r.row, :r.kv_len] = torch.where(foreign, 0, slots).to(r2t.dtype).to(
                    r2t.device)

    # ---- the pools' side --------------------------------------------------------------------
    def check_write(self, op: str, slots: torch.Tensor, lenient: bool = False,
                    layer: int | None = None) -> None:
        """Every slot FRESH or PAD (lenient: or committed to a row of this step)."""
        flat = slots.reshape(-1).to("cpu", torch.int64)
        flat = flat[(flat >= 0) & (flat < self.owner.numel())]   # the range guard's job
        own = self.owner[flat]
        ok = (own == FRESH) | (own == PAD)
        if lenient:
            ok |= torch.isin(own, self.step_rows)
        if not bool(ok.all()):
            s = int(flat[~ok][0])
            allowed = ("slots handed out in this step" + (" or committed to its requests"
                                                          if lenient else ""))
            raise KVOwnershipError(op, s, int(self.owner[s]), allowed, int((~ok).sum()),
                                   slots.numel(), layer=layer, limit=self.owner.numel())

    def check_reads(self, op: str, kv_idx: torch.Tensor) -> None:
        """kv_idx (rows, keys), one attention row per query sequence: a row reads the
        committed K/V of one request at most (its prefix) besides in-flight and padding
        slots, and no free slot."""
        if kv_idx.dim() != 2 or not kv_idx.numel():
            return
        own = self.owner[kv_idx.to("cpu", torch.int64)]                         # (n, S)
        freed = own == FREE
        rows = torch.where(own > 0, own, torch.full_like(own, -1))             # (n, S)
        least = torch.where(own > 0, own, torch.full_like(own, 2**62)).amin(1)    # (n,)
        top = rows.amax(1)                                                      # (n,)
        # one committed owner per row: its least and largest committed owner agree
        mixed = (top > 0) & (least != top)
        if bool(freed.any()) or bool(mixed.any()):
            if bool(freed.any()):
                i, j = (int(x) for x in freed.nonzero()[0])
            else:   # name the slot of the owner that is not the row's usual one
                i = int(mixed.nonzero()[0])
                vals, counts = rows[i][rows[i] > 0].unique(return_counts=True)
                minority = int(vals[counts.argmin()])
                j = int((rows[i] == minority).nonzero()[0])
            s = int(kv_idx[i, j])
            raise KVOwnershipError(op, s, int(self.owner[s]),
                                   "the committed slots of one request per row", 1,
                                   kv_idx.numel(), limit=self.owner.numel())

    def check_move(self, dst: torch.Tensor, src: torch.Tensor, lenient: bool = False) -> None:
        self.check_write("move_kv dst", dst, lenient)
        self.check_write("move_kv src", src, lenient=True)


def kv_pools(root, depth: int = 3) -> list:
    """Every KVPool reachable from `root` through attributes, lists and dicts (the target's,
    the draft's, a multi-layer draft's S pools), each once."""
    from eaglekv.memory.kv_pool import KVPool
    found, seen, frontier = [], set(), [root]
    for _ in range(depth + 1):
        nxt = []
        for obj in frontier:
            if id(obj) in seen or isinstance(obj, (torch.Tensor, str, int, float)):
                continue
            seen.add(id(obj))
            if isinstance(obj, KVPool):
                found.append(obj)
            elif isinstance(obj, (list, tuple)):
                nxt.extend(obj)
            elif isinstance(obj, dict):
                nxt.extend(obj.values())
            elif hasattr(obj, "__dict__"):
                nxt.extend(vars(obj).values())
        frontier = nxt
    return found


def attach(allocator, req_to_token, pools: list, target, lenient_drafts: bool,
           on: bool = True) -> SlotOwners | None:
    """Switch the checked mode on (or off) for an allocator and its pools; the slots in use
    now count as FRESH until the next `begin_step` commits them to their rows."""
    owners = None
    if on:
        owners = SlotOwners(allocator.size + allocator.page_size, allocator.page_size,
                            req_to_token)
        owners.owner[allocator.used_slots()] = FRESH
    allocator.owners = owners
    for pool in pools:
        pool.watch(owners, lenient_drafts and pool is not target)
    return owners
