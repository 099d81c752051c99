"""The device side of `greedy.greedy_pick`: program r scans row r in blocks of BLOCK logits,
keeping the running max (fp32), the first index reaching it and the validity flags; writes
`[token, valid]`. Reference: `greedy.greedy_pick_torch`.

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
    r = tl.program_id(0).to(tl.int64)
    base = x_ptr + r * s0
    best = tl.full([1], float("-inf"), tl.float32)                     # running max
    idx = tl.zeros([1], tl.int64)                                       # its first index
    fin = tl.zeros([1], tl.int1)                                        # some x > -inf
    bad = tl.zeros([1], tl.int1)                                        # some NaN or +inf
    for v0 in range(0, V, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        live = i < V
        x = tl.load(base + i, mask=live, other=float("-inf")).to(tl.float32)
        bad = bad | tl.max((live & ~(x < float("inf"))).to(tl.int32), 0) > 0
        fin = fin | tl.max((x > float("-inf")).to(tl.int32), 0) > 0
        xm = tl.where(x == x, x, float("-inf"))                         # NaN out of the max
        m = tl.max(xm, 0)
        j = tl.min(tl.where(xm == m, i, V), 0)                          # first index of m
        take = m > best                                                 # strictly: keep first
        idx = tl.where(take, j.to(tl.int64), idx)
        best = tl.where(take, m, best)
    valid = fin & ~bad
    o = tl.arange(0, 1)
    tl.store(out_ptr + r * 2 + o, idx)
    tl.store(out_ptr + r * 2 + 1 + o, valid.to(tl.int64))


def greedy_pick_triton(logits: torch.Tensor) -> torch.Tensor:
    R, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(R, 2, dtype=torch.int64, device=logits.device)
    if R:
        _greedy_pick_kernel[(R,)](logits, out, V, logits.stride(0), BLOCK=BLOCK, num_warps=8)
    return out
