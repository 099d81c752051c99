"""Triton kernels for draft KV indexing (references and formulas in `spec_utils.py`).

Every index that becomes an address is checked in the kernel. A bad one is masked (never
dereferenced) and recorded in the device error buffer of `eaglekv.kernels.guard`, keyed by
`call_id * 2**32 + flat position` in the tensor registered for that check, so the host can
name the bad value at `raise_if_error()`. No host sync happens here inside a guard step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eaglekv.kernels.guard import checks_enabled, device_assert_enabled, kv_guard

_BIG = tl.constexpr(2**62)   # larger than any flat position: the neutral element of min
DECODE_BLOCK = 256           # segment elements per loop iteration of the decode kernel


@triton.jit
def _geometry(L, S: tl.constexpr, PS: tl.constexpr):
    """last = L % ps, stride = npp*ps with npp = ceil((last + S)/ps), base = L - last."""
    last = L % PS
    npp = (last + S + PS - 1) // PS
    return last, npp * PS, L - last


@triton.jit
def _record(err_ptr, bad, where, key_base):
    """err[0] += number of bad lanes; err[1] = min(err[1], key_base + earliest bad `where`)."""
    n = tl.sum(bad.to(tl.int64), axis=0)
    if n > 0:
        tl.atomic_add(err_ptr, n, sem="relaxed")
        tl.atomic_min(err_ptr + 1, key_base + tl.min(tl.where(bad, where, _BIG), axis=0),
                      sem="relaxed")


@triton.jit
def _positions_kernel(lens_ptr, pos_ptr, K: tl.constexpr, S: tl.constexpr, PS: tl.constexpr,
                      BKS: tl.constexpr):
    """Program b: pos[b, t, s] = L_b + t*npp_b*ps + s for t < K, s < S."""
    b = tl.program_id(0).to(tl.int64)
    L = tl.load(lens_ptr + b).to(tl.int64)
    _, stride, _ = _geometry(L, S, PS)
    e = tl.arange(0, BKS)                                  # (BKS,) flat t*S + s
    t, s = e // S, e % S
    tl.store(pos_ptr + b * (K * S) + e, L + t * stride + s, mask=e < K * S)


@triton.jit
def _assign_kernel(rtt_ptr, rtt_s0, rtt_s1, rows_ptr, lens_ptr, loc_ptr, copy_ptr,
                   c_s0, c_s1, c_s2, pos_ptr, err_ptr, row_key, pos_key, B, R, W,
                   K: tl.constexpr, S: tl.constexpr, PS: tl.constexpr, COPY: tl.constexpr,
                   BB: tl.constexpr, BKS: tl.constexpr, BCP: tl.constexpr,
                   ASSERT: tl.constexpr, CHECK: tl.constexpr):
    """Program b writes request b's draft slots (and copied partial pages) into req_to_token,
    but only if every row and position of the whole batch is in range (each program checks
    the batch: B is small), so a bad request leaves the table untouched."""
    # 1. the batch check: row in [0, R), lowest position L >= 0, highest L + (K-1)*stride + S-1 < W
    n_bad = tl.zeros([BB], dtype=tl.int32)
    if CHECK:                                              # (off: measurement only)
        for b0 in range(0, B, BB):
            bb = b0 + tl.arange(0, BB)                     # (BB,)
            mb = bb < B
            Ls = tl.load(lens_ptr + bb, mask=mb, other=0).to(tl.int64)
            rs = tl.load(rows_ptr + bb, mask=mb, other=0).to(tl.int64)
            _, st, _ = _geometry(Ls, S, PS)
            hi = Ls + (K - 1) * st + (S - 1)
            n_bad += (mb & ((rs < 0) | (rs >= R) | (Ls < 0) | (hi >= W))).to(tl.int32)
    batch_ok = tl.sum(n_bad, axis=0) == 0
    # 2. this request: report its bad row / positions, then write
    b = tl.program_id(0).to(tl.int64)
    L = tl.load(lens_ptr + b).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    last, stride, base = _geometry(L, S, PS)
    if CHECK:
        if (row < 0) | (row >= R):
            tl.atomic_add(err_ptr, tl.full([], 1, tl.int64), sem="relaxed")
            tl.atomic_min(err_ptr + 1, row_key + b, sem="relaxed")
    e = tl.arange(0, BKS)                                  # (BKS,) flat t*S + s
    t, s = e // S, e % S
    m = e < K * S
    flat = b * (K * S) + e                                 # index into out_cache_loc / pos
    pos = L + t * stride + s                               # (BKS,)
    tl.store(pos_ptr + flat, pos, mask=m)
    if CHECK:
        pbad = m & ((pos < 0) | (pos >= W))
        _record(err_ptr, pbad, flat, pos_key)
        if ASSERT:
            tl.device_assert(~pbad, "assign_draft_cache_locs: position past req_to_token width")
    ok = m & ((tl.zeros([BKS], dtype=tl.int32) + batch_ok.to(tl.int32)) != 0)
    loc = tl.load(loc_ptr + flat, mask=ok, other=0)
    tl.store(rtt_ptr + row * rtt_s0 + pos * rtt_s1, loc.to(rtt_ptr.dtype.element_ty), mask=ok)
    if COPY:
        # req_to_token[row, base + t*stride + j] = copy[b, t-1, j] for 1 <= t < K, j < last
        c = tl.arange(0, BCP)                              # (BCP,) flat (t-1)*ps + j
        tc, j = 1 + c // PS, c % PS
        mc = (c < (K - 1) * PS) & (j < last)
        mc = mc & ((tl.zeros([BCP], dtype=tl.int32) + batch_ok.to(tl.int32)) != 0)
        src = tl.load(copy_ptr + b * c_s0 + (tc - 1) * c_s1 + j * c_s2, mask=mc, other=0)
        col = base + tc * stride + j
        tl.store(rtt_ptr + row * rtt_s0 + col * rtt_s1, src.to(rtt_ptr.dtype.element_ty),
                 mask=mc)


@triton.jit
def _decode_kv_indices_kernel(rtt_ptr, rtt_s0, rtt_s1, rows_ptr, lens_ptr, starts_ptr,
                              kv_ptr, kv_s0, kv_s1, ip_ptr, ip_s0, ip_s1, pos_ptr, err_ptr,
                              row_key, pos_key, slot_key, B, R, W, width, size_limit,
                              K: tl.constexpr, S: tl.constexpr, PS: tl.constexpr,
                              BS: tl.constexpr, BLOCK: tl.constexpr, ASSERT: tl.constexpr,
                              CHECK: tl.constexpr):
    """Program (b*K + t, step): the segment of branch (b, t) in row `step` of kv_indices.

    Element i < L_b + it of the segment is `req_to_token[row_b, i + (i >= base_b)*t*stride_b]`.
    Errors are reported by the last step only (it reads a superset of the others), and the
    shared prefix below the partial page by branch t == 0 only: each table entry counts once.
    """
    br = tl.program_id(0).to(tl.int64)
    step = tl.program_id(1)
    b, t = br // K, br % K
    it = (step + 1).to(tl.int64)
    L = tl.load(lens_ptr + b).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    start = tl.load(starts_ptr + b).to(tl.int64)           # sum_{j<b} L_j
    _, stride, base = _geometry(L, S, PS)
    # kv_indptr[step, b*K + t] = K*sum_{j<b} L_j + b*it*K + t*(L_b + it)
    off = K * start + b * it * K + t * (L + it)
    tl.store(ip_ptr + step * ip_s0 + br * ip_s1, off.to(ip_ptr.dtype.element_ty))
    if br == B * K - 1:  # kv_indptr[step, B*K] = K*sum(L) + B*K*it
        tl.store(ip_ptr + step * ip_s0 + (br + 1) * ip_s1,
                 (off + L + it).to(ip_ptr.dtype.element_ty))
    last_step = step == S - 1
    if CHECK:
        row_ok = (row >= 0) & (row < R)
        if last_step & (t == 0) & (~row_ok):
            tl.atomic_add(err_ptr, tl.full([], 1, tl.int64), sem="relaxed")
            tl.atomic_min(err_ptr + 1, row_key + b, sem="relaxed")
    else:                                                  # measurement only
        row_ok = row == row
    # positions of this branch's S draft tokens (last step only), checked against W
    s = tl.arange(0, BS)
    ps_m = (s < S) & ((tl.zeros([BS], dtype=tl.int32) + last_step.to(tl.int32)) != 0)
    pos = L + t * stride + s
    tl.store(pos_ptr + br * S + s, pos, mask=ps_m)
    if CHECK:
        pbad = ps_m & ((pos < 0) | (pos >= W))
        _record(err_ptr, pbad, br * S + s, pos_key)
    row_v = (tl.zeros([BLOCK], dtype=tl.int32) + row_ok.to(tl.int32)) != 0
    report_v = (tl.zeros([BLOCK], dtype=tl.int32) + last_step.to(tl.int32)) != 0
    first_v = (tl.zeros([BLOCK], dtype=tl.int32) + (t == 0).to(tl.int32)) != 0
    n = L + it
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK).to(tl.int64)          # (BLOCK,)
        m = i < n
        col = i + tl.where(i >= base, t * stride, 0)
        if CHECK:
            lm = m & row_v & (col >= 0) & (col < W)
            v = tl.load(rtt_ptr + row * rtt_s0 + col * rtt_s1, mask=lm, other=0).to(tl.int64)
            v_ok = (v >= 0) & (v < size_limit)
            sbad = lm & (~v_ok) & report_v & (first_v | (i >= base))
            _record(err_ptr, sbad, row * W + col, slot_key)
            if ASSERT:
                tl.device_assert(~(lm & ~v_ok), "draft kv_indices: slot out of range")
            out = tl.where(lm & v_ok, v, 0)
        else:
            out = tl.load(rtt_ptr + row * rtt_s0 + col * rtt_s1, mask=m, other=0)
        tl.store(kv_ptr + step * kv_s0 + (off + i) * kv_s1, out.to(kv_ptr.dtype.element_ty),
                 mask=m & (off + i < width))


def draft_token_positions_triton(seq_lens, topk: int, num_steps: int,
                                 page_size: int) -> torch.Tensor:
    B = seq_lens.numel()
    pos = torch.empty(B, topk, num_steps, dtype=torch.int64, device=seq_lens.device)
    if B:
        _positions_kernel[(B,)](seq_lens, pos, K=topk, S=num_steps, PS=page_size,
                                BKS=triton.next_power_of_2(topk * num_steps))
    return pos


def assign_draft_cache_locs_triton(req_to_token, req_pool_indices, seq_lens, out_cache_loc,
                                   topk: int, num_steps: int, page_size: int,
                                   prefix_copy_locs) -> None:
    B = seq_lens.numel()
    if B == 0:
        return
    (R, W), dev = req_to_token.shape, req_to_token.device
    guard = kv_guard(dev)
    pos = torch.empty(B * topk * num_steps, dtype=torch.int64, device=dev)  # filled by kernel
    row_id = guard.register("assign_draft_cache_locs req_pool_indices", R, req_pool_indices,
                            None)
    pos_id = guard.register("assign_draft_cache_locs position", W, pos, None)
    copy = prefix_copy_locs is not None
    cp = prefix_copy_locs if copy else out_cache_loc
    cs = prefix_copy_locs.stride() if copy else (0, 0, 0)
    _assign_kernel[(B,)](
        req_to_token, req_to_token.stride(0), req_to_token.stride(1), req_pool_indices,
        seq_lens, out_cache_loc.reshape(-1), cp, *cs, pos, guard.err, row_id << 32,
        pos_id << 32, B, R, W, K=topk, S=num_steps, PS=page_size, COPY=copy,
        BB=min(256, triton.next_power_of_2(B)), BKS=triton.next_power_of_2(topk * num_steps),
        BCP=triton.next_power_of_2(max(1, (topk - 1) * page_size)),
        ASSERT=device_assert_enabled(), CHECK=checks_enabled(),
        debug=device_assert_enabled())  # assert needs debug
    guard.after_launch()


def generate_draft_decode_kv_indices_triton(req_to_token, req_pool_indices, seq_lens,
                                            topk: int, num_steps: int, page_size: int,
                                            kv_indices, kv_indptr, size_limit: int) -> None:
    B = seq_lens.numel()
    if B == 0:
        kv_indptr[:, 0] = 0
        return
    (R, W), dev = req_to_token.shape, req_to_token.device
    if R * W >= 2**32:   # the error key holds the flat table position in its low 32 bits
        raise ValueError(f"generate_draft_decode_kv_indices: req_to_token has {R * W} entries; "
                         f"the guarded kernel addresses at most 2**32")
    guard = kv_guard(dev)
    lens = seq_lens.to(torch.int64)
    starts = torch.cumsum(lens, 0) - lens                   # (B,) sum_{j<b} L_j
    pos = torch.empty(B * topk * num_steps, dtype=torch.int64, device=dev)  # filled by kernel
    row_id = guard.register("draft kv_indices req_pool_indices", R, req_pool_indices, None)
    pos_id = guard.register("draft kv_indices req_to_token column", W, pos, None)
    slot_id = guard.register("draft kv_indices", size_limit, req_to_token, None)
    _decode_kv_indices_kernel[(B * topk, num_steps)](
        req_to_token, req_to_token.stride(0), req_to_token.stride(1), req_pool_indices, lens,
        starts, kv_indices, kv_indices.stride(0), kv_indices.stride(1), kv_indptr,
        kv_indptr.stride(0), kv_indptr.stride(1), pos, guard.err, row_id << 32, pos_id << 32,
        slot_id << 32, B, R, W, kv_indices.shape[1], size_limit, K=topk, S=num_steps,
        PS=page_size, BS=triton.next_power_of_2(num_steps), BLOCK=DECODE_BLOCK,
        ASSERT=device_assert_enabled(), CHECK=checks_enabled(),
        debug=device_assert_enabled())  # assert needs debug
    guard.after_launch()
