"""The device side of `guard.guard_indices` in one Triton launch: range-check n indices, write
a safe copy (a bad entry becomes 0, the padding slot) and record the bad ones in the guard's
error buffer, `[count, min key]`, key = key_base + flat position. Replaces the dozen torch ops
(two compares, an or, an arange, a where, a min and a sum, their adds) that each guard cost a
captured speculative step (~84 of its 665 kernels at S5 on the H200, 2026-12-04).

Imports go one way: `guard` imports this module (inside a function), never the reverse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["n", "low", "limit", "key_base"])
def _guard_range_kernel(idx_ptr, out_ptr, err_ptr, n, low, limit, key_base,
                        BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    x = tl.load(idx_ptr + i, mask=live, other=0)
    bad = live & ((x < low) | (x >= limit))
    zero = i * 0
    tl.atomic_add(err_ptr + zero, zero + 1, mask=bad, sem="relaxed")
    tl.atomic_min(err_ptr + 1 + zero, key_base + i, mask=bad, sem="relaxed")
    tl.store(out_ptr + i, tl.where(bad, 0, x), mask=live)


def guard_range_triton(flat: torch.Tensor, low: int, limit: int, err: torch.Tensor,
                       key_base: int) -> torch.Tensor:
    """flat: contiguous 1-D integer indices -> a safe copy (same dtype); err: the guard's
    (2,) int64 buffer. No host sync, graph-capturable."""
    out = torch.empty_like(flat)
    n = flat.numel()
    if n:
        _guard_range_kernel[(triton.cdiv(n, BLOCK),)](flat, out, err, n, low, limit, key_base,
                                                      BLOCK=BLOCK)
    return out
