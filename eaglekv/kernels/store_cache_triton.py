"""Triton `store_cache`: one program per (token, split); row i of k/v -> row indices[i].

An index outside `[0, size_limit)` is masked (nothing written) and recorded in the device
error buffer of `eaglekv.kernels.guard`; CHECK=False is the unchecked variant, kept only for
the benchmark comparison.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eaglekv.kernels.guard import device_assert_enabled, kv_guard


@triton.jit
def _store_cache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, idx_ptr, err_ptr, call_key,
                        k_s0, k_s1, v_s0, v_s1, kc_s0, vc_s0, row, size_limit,
                        CHECK: tl.constexpr, ASSERT: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK: tl.constexpr):
    t = tl.program_id(0)
    part = tl.program_id(1)
    slot = tl.load(idx_ptr + t).to(tl.int64)
    chunk = row // SPLIT
    start = part * chunk
    cols0 = tl.arange(0, BLOCK)
    # the slot as a vector, so its bound check combines with the column mask (the
    # interpreter rejects scalar & vector masks)
    slot_v = tl.zeros([BLOCK], dtype=tl.int64) + slot
    in_range = (slot_v >= 0) & (slot_v < size_limit)
    if ASSERT:
        tl.device_assert((slot >= 0) & (slot < size_limit), "store_cache: slot out of range")
    if CHECK:
        bad = (slot < 0) | (slot >= size_limit)
        if bad & (part == 0):
            tl.atomic_add(err_ptr, 1)
            tl.atomic_min(err_ptr + 1, t.to(tl.int64) + call_key)
    for off in range(0, chunk, BLOCK):
        cols = start + off + cols0
        m = cols < start + chunk
        if CHECK:
            m = m & in_range
        kx = tl.load(k_ptr + t * k_s0 + cols * k_s1, mask=m)
        vx = tl.load(v_ptr + t * v_s0 + cols * v_s1, mask=m)
        tl.store(kc_ptr + slot_v * kc_s0 + cols, kx, mask=m)
        tl.store(vc_ptr + slot_v * vc_s0 + cols, vx, mask=m)


def store_cache_triton(k2, v2, kc2, vc2, indices, limit: int, split: int, *, check: bool = True,
                       layer: int | None = None) -> None:
    """k2/v2: (n, row) any strides; kc2/vc2: (slots, row) contiguous rows."""
    n, row = k2.shape
    if n == 0:
        return
    guard = kv_guard(k2.device)
    call_id = guard.register("store_cache", limit, indices, layer) if check else 0
    chunk = row // split
    block = min(1024, triton.next_power_of_2(chunk))
    _store_cache_kernel[(n, split)](
        k2, v2, kc2, vc2, indices.reshape(-1), guard.err, call_id << 32,
        k2.stride(0), k2.stride(1), v2.stride(0), v2.stride(1), kc2.stride(0), vc2.stride(0),
        row, limit, CHECK=check, ASSERT=device_assert_enabled() and check, SPLIT=split,
        BLOCK=block)
    if check:
        guard.after_launch()
