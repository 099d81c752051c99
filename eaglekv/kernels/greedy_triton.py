"""The device side of `greedy.greedy_pick`: program r scans row r in blocks of BLOCK logits,
each lane keeping its running max (fp32), the first index reaching it and the validity flags,
reduced across the lanes at the end; writes `[token, valid]`. Reference:
`greedy.greedy_pick_torch`.

NaN compares false everywhere: a block's max ignores it and `x < inf` fails on it, so a row
with a NaN is not valid (its token is then any index: unused). Graph-ready: no host sync, the
grid (R,) from a host int.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit(do_not_specialize=["V"])
def _greedy_pick_kernel(x_ptr, out_ptr, V, s0, BLOCK: tl.constexpr):
    # each lane keeps its own running max, first index and flags over the blocks (lane l sees
    # indices l, l + BLOCK, ... in order, so a strict > keeps its first), reduced across the
    # lanes once at the end: no reduction inside the loop, whose four a block kept the row's
    # scan latency-bound (15 us a launch for SmolLM2's 49152 logits on an H100, 2026-12-05)
    r = tl.program_id(0).to(tl.int64)
    base = x_ptr + r * s0
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)                 # running max a lane
    idx = tl.zeros([BLOCK], tl.int32)                                   # its first index
    fin = tl.zeros([BLOCK], tl.int1)                                    # some x > -inf
    bad = tl.zeros([BLOCK], tl.int1)                                    # some NaN or +inf
    for v0 in range(0, V, BLOCK):
        i = v0 + lane
        live = i < V
        x = tl.load(base + i, mask=live, other=float("-inf")).to(tl.float32)
        bad = bad | (live & ~(x < float("inf")))
        fin = fin | (x > float("-inf"))
        take = x > best                            # NaN compares false: never taken
        idx = tl.where(take, i, idx)
        best = tl.where(take, x, best)
    m = tl.max(best, 0)
    j = tl.min(tl.where(best == m, idx, V), 0)                          # first index of m
    j = tl.where(m > float("-inf"), j, 0)          # no finite logit: index 0, as before
    valid = (tl.max(fin.to(tl.int32), 0) > 0) & (tl.max(bad.to(tl.int32), 0) == 0)
    o = tl.arange(0, 1)
    tl.store(out_ptr + r * 2 + o, tl.zeros([1], tl.int64) + j.to(tl.int64))
    tl.store(out_ptr + r * 2 + 1 + o, tl.zeros([1], tl.int64) + valid.to(tl.int64))


def greedy_pick_triton(logits: torch.Tensor) -> torch.Tensor:
    R, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(R, 2, dtype=torch.int64, device=logits.device)
    if R:
        _greedy_pick_kernel[(R,)](logits, out, V, logits.stride(0), BLOCK=BLOCK, num_warps=8)
    return out
