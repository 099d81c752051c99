"""The device side of `guard.guard_indices` in one Triton launch: range-check n indices, write
a safe copy (a bad entry becomes 0, the padding slot) and record the bad ones in the guard's
error buffer, `[count, min key, value, value's key]`, key = key_base + flat position: the
kernel also records the first bad value with its key when that key becomes the minimum, so the
host names the value the check saw even if the indices are overwritten before the sync (a chain
of captured steps). One program walks the blocks in order (a step's guarded index lists are a few
thousand entries), so the value and its key come from one place; above `ONE_PROGRAM_MAX`
entries the blocks spread over programs and the value is left to the host. Replaces the dozen torch ops
(two compares, an or, an arange, a where, a min and a sum, their adds) that each guard cost a
captured speculative step (~84 of its 665 kernels at S5 on the H200, 2026-12-04).

Imports go one way: `guard` imports this module (inside a function), never the reverse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
ONE_PROGRAM_MAX = 16 * BLOCK    # above it (a torch-backend gather of whole contexts), one
                                # program a block, and the host reads the value back
NO_ERROR: tl.constexpr = tl.constexpr(2**62)     # `guard.NO_ERROR`


@triton.jit(do_not_specialize=["n", "low", "limit", "key_base"])
def _guard_range_kernel(idx_ptr, out_ptr, err_ptr, n, low, limit, key_base,
                        BLOCK: tl.constexpr):
    # program p walks blocks p, p + P, ... in order; with one program (the usual case) its
    # first bad entry and that entry's value come from one place, and only then is the value
    # recorded (several programs would race on the value's slot)
    nprog = tl.num_programs(0)
    count = tl.zeros((), tl.int64)
    first = tl.full((), NO_ERROR, tl.int64)
    value = tl.zeros((), tl.int64)
    for start in range(tl.program_id(0) * BLOCK, n, BLOCK * nprog):
        i = start + tl.arange(0, BLOCK).to(tl.int64)
        live = i < n
        x = tl.load(idx_ptr + i, mask=live, other=0)
        bad = live & ((x < low) | (x >= limit))
        key = tl.where(bad, key_base + i, NO_ERROR)
        block_first = tl.min(key, axis=0)
        block_value = tl.sum(tl.where(key == block_first, x.to(tl.int64), 0), axis=0)
        value = tl.where(block_first < first, block_value, value)
        first = tl.minimum(first, block_first)
        count += tl.sum(bad.to(tl.int64), axis=0)
        tl.store(out_ptr + i, tl.where(bad, 0, x), mask=live)
    if count > 0:
        tl.atomic_add(err_ptr, count, sem="relaxed")
        old = tl.atomic_min(err_ptr + 1, first, sem="relaxed")
        if (first < old) & (nprog == 1):    # this call's first error is the step's first
            tl.store(err_ptr + 2, value)
            tl.store(err_ptr + 3, first)


def guard_range_triton(flat: torch.Tensor, low: int, limit: int, err: torch.Tensor,
                       key_base: int) -> torch.Tensor:
    """flat: contiguous 1-D integer indices -> a safe copy (same dtype); err: the guard's
    (2,) int64 buffer. No host sync, graph-capturable."""
    out = torch.empty_like(flat)
    n = flat.numel()
    if n:
        _guard_range_kernel[(1 if n <= ONE_PROGRAM_MAX else triton.cdiv(n, BLOCK),)](flat, out, err, n, low, limit, key_base,
                                                      BLOCK=BLOCK)
    return out
