"""Triton `store_cache`: program (token block, split); row i of k/v -> row indices[i].

An index outside `[0, size_limit)` is masked (nothing written) and recorded in the device
error buffer of `eaglekv.kernels.guard`; CHECK=False is the unchecked variant, kept only for
the benchmark comparison.
"""

from __future__ import annotations

import triton
import triton.language as tl

from eaglekv.kernels.guard import device_assert_enabled, kv_guard


@triton.jit
def _store_cache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, idx_ptr, err_ptr, call_key, n_tokens,
                        k_s0, k_s1, v_s0, v_s1, kc_s0, vc_s0, row, size_limit,
                        CHECK: tl.constexpr, ASSERT: tl.constexpr, SPLIT: tl.constexpr,
                        TOK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, part): tokens [i*TOK, (i+1)*TOK), columns [part*chunk, (part+1)*chunk)."""
    part = tl.program_id(1)
    toks = (tl.program_id(0) * TOK + tl.arange(0, TOK)).to(tl.int64)   # (TOK,)
    tmask = toks < n_tokens
    slot = tl.load(idx_ptr + toks, mask=tmask, other=0).to(tl.int64)    # (TOK,)
    ok = tmask
    if CHECK:
        ok = tmask & (slot >= 0) & (slot < size_limit)
        # count once per token: only the part-0 programs report (vector compare, no scalar mask)
        first_part = (tl.zeros([TOK], dtype=tl.int32) + part) == 0
        bad = tmask & (~ok) & first_part
        num_bad = tl.sum(bad.to(tl.int32), axis=0)
        if num_bad > 0:
            tl.atomic_add(err_ptr, num_bad.to(tl.int64))
            first = tl.min(tl.where(bad, toks, n_tokens), axis=0)
            tl.atomic_min(err_ptr + 1, first + call_key)
    if ASSERT:
        tl.device_assert(~tmask | ((slot >= 0) & (slot < size_limit)),
                         "store_cache: slot out of range")
    chunk = row // SPLIT
    start = part * chunk
    for off in range(0, chunk, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)                          # (BLOCK,)
        m = ok[:, None] & (cols[None, :] < start + chunk)                 # (TOK, BLOCK)
        kx = tl.load(k_ptr + toks[:, None] * k_s0 + cols[None, :] * k_s1, mask=m)
        vx = tl.load(v_ptr + toks[:, None] * v_s0 + cols[None, :] * v_s1, mask=m)
        tl.store(kc_ptr + slot[:, None] * kc_s0 + cols[None, :], kx, mask=m)
        tl.store(vc_ptr + slot[:, None] * vc_s0 + cols[None, :], vx, mask=m)


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
    tok = max(1, min(16, 4096 // block, triton.next_power_of_2(n)))  # ~4K elements a program
    _store_cache_kernel[(triton.cdiv(n, tok), split)](
        k2, v2, kc2, vc2, indices.reshape(-1), guard.err, call_id << 32, n,
        k2.stride(0), k2.stride(1), v2.stride(0), v2.stride(1), kc2.stride(0), vc2.stride(0),
        row, limit, CHECK=check, ASSERT=device_assert_enabled() and check, SPLIT=split,
        TOK=tok, BLOCK=block)
    if check:
        guard.after_launch()
