"""The device side of `greedy.greedy_pick`: each row's logits scanned in blocks of BLOCK, each
lane keeping its running max (fp32), the first index reaching it and the validity flags,
reduced across the lanes at the end; writes `[token, valid]`. Reference:
`greedy.greedy_pick_torch`.

Few rows (a decode, a verify or a draft step of a small batch: R <= SPLIT_MAX_ROWS, e.g. a
batch-16 verify of 6 nodes, 96 rows) split each row over
up to MAX_SPLITS programs of CHUNK logits, whose partials [max, first index, flags] a second
launch of R programs reduces (the max of the maxima, the lowest index reaching it, the flags
or-ed). One program scanning SmolLM2's 49152 logits took 10.7 us a token at batch 1 on an
H100 (2026-12-05 18:50, `_greedy_pick_kernel`, 343 us of a 32-token chain's 19.3 ms): one
SM's bandwidth for 98 KB. Many rows keep one program a row (the GPU is full already).

NaN compares false everywhere: a block's max ignores it and `x < inf` fails on it, so a row
with a NaN is not valid (its token is then any index: unused). Graph-ready: no host sync, the
grids from host ints.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096                 # logits a lane block of the one-program-a-row kernel
CHUNK = 2048                 # logits a program of the split kernel
SPLIT_BLOCK = 1024
MAX_SPLITS = 32
SPLIT_MAX_ROWS = 128         # rows above this: one program a row (then ~1 program an SM or
                             # more: the scan is bandwidth-bound either way)


@triton.jit
def _scan(base, lo, hi, BLOCK: tl.constexpr):
    """Logits [lo, hi) of one row -> (max, first index of it, some x > -inf, some NaN or
    +inf). Each lane keeps its own running max, first index and flags over the blocks (lane l
    sees indices lo + l, lo + l + BLOCK, ... in order, so a strict > keeps its first), reduced
    across the lanes once at the end: no reduction inside the loop, whose four a block kept
    the scan latency-bound (15 us a launch for 49152 logits on an H100, 2026-12-05)."""
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)                 # running max a lane
    idx = tl.zeros([BLOCK], tl.int32)                                   # its first index
    fin = tl.zeros([BLOCK], tl.int1)                                    # some x > -inf
    bad = tl.zeros([BLOCK], tl.int1)                                    # some NaN or +inf
    for v0 in range(lo, hi, BLOCK):
        i = v0 + lane
        live = i < hi
        x = tl.load(base + i, mask=live, other=float("-inf")).to(tl.float32)
        bad = bad | (live & ~(x < float("inf")))
        fin = fin | (x > float("-inf"))
        take = x > best                            # NaN compares false: never taken
        idx = tl.where(take, i, idx)
        best = tl.where(take, x, best)
    m = tl.max(best, 0)
    j = tl.min(tl.where(best == m, idx, hi), 0)                         # first index of m
    return m, j, tl.max(fin.to(tl.int32), 0), tl.max(bad.to(tl.int32), 0)


@triton.jit
def _store_pick(out_ptr, r, m, j, fin, bad):
    j = tl.where(m > float("-inf"), j, 0)          # no finite logit: index 0, as before
    valid = (fin > 0) & (bad == 0)
    o = tl.arange(0, 1)
    tl.store(out_ptr + r * 2 + o, tl.zeros([1], tl.int64) + j.to(tl.int64))
    tl.store(out_ptr + r * 2 + 1 + o, tl.zeros([1], tl.int64) + valid.to(tl.int64))


@triton.jit(do_not_specialize=["V"])
def _greedy_pick_kernel(x_ptr, out_ptr, V, s0, BLOCK: tl.constexpr):
    """Program r: row r whole."""
    r = tl.program_id(0).to(tl.int64)
    m, j, fin, bad = _scan(x_ptr + r * s0, 0, V, BLOCK)
    _store_pick(out_ptr, r, m, j, fin, bad)


@triton.jit(do_not_specialize=["V", "chunk"])
def _greedy_part_kernel(x_ptr, pm_ptr, pi_ptr, V, s0, chunk, P: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program (r, p): logits [p * chunk, min((p + 1) * chunk, V)) of row r -> its partial:
    pm[r, p] = max, pi[r, p] = [first index, fin + 2 * bad]."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    lo = p * chunk
    m, j, fin, bad = _scan(x_ptr + r * s0, lo, tl.minimum(lo + chunk, V), BLOCK)
    o = tl.arange(0, 1)
    tl.store(pm_ptr + r * P + p + o, tl.zeros([1], tl.float32) + m)
    tl.store(pi_ptr + (r * P + p) * 2 + o, tl.zeros([1], tl.int32) + j)
    tl.store(pi_ptr + (r * P + p) * 2 + 1 + o, tl.zeros([1], tl.int32) + fin + 2 * bad)


@triton.jit
def _greedy_reduce_kernel(pm_ptr, pi_ptr, out_ptr, V, P: tl.constexpr, PP: tl.constexpr):
    """Program r: row r's P partials -> [token, valid]. The chunks are in index order and
    each partial's index is the first of its own max, so the lowest index among the partials
    reaching the row's max is the row's first."""
    r = tl.program_id(0).to(tl.int64)
    q = tl.arange(0, PP)
    live = q < P
    m = tl.load(pm_ptr + r * P + q, mask=live, other=float("-inf"))
    j = tl.load(pi_ptr + (r * P + q) * 2, mask=live, other=V)
    f = tl.load(pi_ptr + (r * P + q) * 2 + 1, mask=live, other=0)
    best = tl.max(m, 0)
    first = tl.min(tl.where(live & (m == best), j, V), 0)
    _store_pick(out_ptr, r, best, first, tl.max(f & 1, 0), tl.max(f >> 1, 0))


def split_count(rows: int, V: int) -> int:
    """Programs a row of the split pick (1: one program a row, no partials)."""
    if rows > SPLIT_MAX_ROWS:
        return 1
    return max(1, min(MAX_SPLITS, -(-V // CHUNK)))


def greedy_pick_triton(logits: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """splits: programs a row (None: `split_count`; tests force either path)."""
    R, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(R, 2, dtype=torch.int64, device=logits.device)
    if not R:
        return out
    P = split_count(R, V) if splits is None else max(1, min(splits, V))
    if P == 1:
        _greedy_pick_kernel[(R,)](logits, out, V, logits.stride(0), BLOCK=BLOCK, num_warps=8)
        return out
    chunk = -(-V // P)
    P = -(-V // chunk)                             # no empty chunk
    pm = torch.empty(R, P, dtype=torch.float32, device=logits.device)
    pi = torch.empty(R, P, 2, dtype=torch.int32, device=logits.device)
    _greedy_part_kernel[(R, P)](logits, pm, pi, V, logits.stride(0), chunk, P=P,
                                BLOCK=min(SPLIT_BLOCK, triton.next_power_of_2(chunk)),
                                num_warps=4)
    _greedy_reduce_kernel[(R,)](pm, pi, out, V, P=P, PP=triton.next_power_of_2(P),
                                num_warps=1)
    return out
