"""Draft KV indexing for EAGLE tree drafting on a paged cache (DESIGN.md, "Draft KV indices").

Symbols: B requests, K = topk, S = num_steps, ps = page_size, L_b the committed KV length of
request b, row_b = req_pool_indices[b] its req_to_token row, W the req_to_token width.

Where draft token s of branch t of request b lives in row_b of req_to_token:
    ps == 1 or K == 1:  pos(b, t, s) = L_b + t*S + s
    ps > 1 and K > 1:   last = L_b % ps,  npp = ceil((last + S) / ps),
                        start = floor(L_b/ps)*ps + t*npp*ps + last,  pos(b, t, s) = start + s
Both are `pos = L_b + t*npp*ps + s` (ps == 1 gives npp*ps = S; K == 1 has only t = 0), which is
how the code computes them. Row b of req_to_token during a draft (ps == 1, K = 2, S = 3):

    col: 0 ........ L_b-1 | L_b    L_b+1  L_b+2 | L_b+3  L_b+4  L_b+5 | ...
         [ prefix (L_b)   | t0:s0  t0:s1  t0:s2 | t1:s0  t1:s1  t1:s2 ]

and one draft step's row of kv_indices, request-major then branch-major, each segment the
prefix and the branch's draft tokens so far (step i reads L_b + i + 1 entries):

    kv_indptr[i]:  0      L_0+i+1   2(L_0+i+1)    ...
    kv_indices[i]: [b0t0: prefix(L_0) draft(0..i)] [b0t1: prefix(L_0) draft(0..i)] [b1t0: ...] For ps > 1 and K > 1, branch t >= 1 also holds at
`region_start_t = floor(L_b/ps)*ps + t*npp*ps` a copy of the prefix's partial last page
(`last` slots), so that every branch sees whole pages.

Every public function runs the Triton kernel (`draft_kv_indices_triton.py`) on CUDA tensors, or on
CPU under TRITON_INTERPRET=1 with EAGLEKV_TRITON_ON_CPU=1; otherwise the PyTorch reference
(`*_torch`, also the CPU path). Guards: the CPU path raises `KVIndexError` before writing
anything; the Triton path records the error in the device buffer of `eaglekv.kernels.guard`
(raised at `raise_if_error()` inside a guard step, at once outside one).
"""

from __future__ import annotations

import operator

import torch

from eaglekv.errors import ConfigError, KVIndexError
from eaglekv.kernels.store_cache import check_indices, use_triton

INT32_LIMIT = 2**31


def draft_kv_indices_buffer_width(num_seqs: int, topk: int, max_context_len: int) -> int:
    """Width of one draft step's row of the kv_indices buffer: `num_seqs * topk * max_context_len`.

    Raises `ConfigError` when it is >= 2**31: the flat offsets into the row (and kv_indptr) are
    int32. The topk factor is mandatory (forgetting it under-allocates: SGLang #27338, #27460).
    """
    for name, v in (("num_seqs", num_seqs), ("topk", topk), ("max_context_len", max_context_len)):
        if operator.index(v) < 1:
            raise ConfigError(f"draft kv_indices buffer: {name}={v} must be >= 1")
    width = num_seqs * topk * max_context_len
    if width >= INT32_LIMIT:
        raise ConfigError(
            f"kv_indices flat offset would overflow int32: num_seqs * topk * max_context_len = "
            f"{num_seqs} * {topk} * {max_context_len} = {width} >= 2**31 = {INT32_LIMIT}; lower "
            f"max_running_requests, speculative topk or the context length")
    return width


def draft_kv_indices_used_len(seq_lens_sum: int, topk: int, bs: int, num_steps: int) -> int:
    """Used length of the last draft step's row: `seq_lens_sum * topk + bs * num_steps`, where
    `bs = B * K` is the number of branches (each sees its prefix plus up to S draft slots)."""
    return seq_lens_sum * topk + bs * num_steps


def check_draft_kv_indices_fit(used_len: int, width: int) -> None:
    """Raise `KVIndexError` (op "draft kv_indices", first_bad = used_len, limit = width,
    `used_len - width` offsets of `used_len` bad) when the used length exceeds the width."""
    if used_len > width:
        raise KVIndexError("draft kv_indices", used_len, width, used_len - width, used_len)


def draft_region_extra(topk: int, num_steps: int, page_size: int) -> int:
    """req_to_token columns past max_context_len the draft needs in the worst case.

    The last draft position is `L + (K-1)*npp*ps + S - 1` with `npp = ceil((L%ps + S)/ps)`,
    largest for `L % ps = ps - 1`, so extra = `(K-1) * ceil((ps-1+S)/ps) * ps + S`
    (= K*S for ps == 1; = S for K == 1). The verify window (N) is not included.
    """
    _check_geometry(topk, num_steps, page_size)
    npp_max = -(-(page_size - 1 + num_steps) // page_size)
    return (topk - 1) * npp_max * page_size + num_steps


def _check_geometry(topk: int, num_steps: int, page_size: int) -> None:
    for name, v in (("topk", topk), ("num_steps", num_steps), ("page_size", page_size)):
        if operator.index(v) < 1:
            raise ValueError(f"draft kv indexing: {name}={v} must be >= 1")


def branch_geometry(L: torch.Tensor, num_steps: int, page_size: int):
    """Per request: `last = L % ps`, `stride = npp*ps` with `npp = ceil((last + S)/ps)`, and
    `base = floor(L/ps)*ps = L - last`. Branch t's region starts at `base + t*stride`."""
    last = L % page_size                                             # (B,)
    npp = torch.div(last + num_steps + page_size - 1, page_size, rounding_mode="floor")
    return last, npp * page_size, L - last


def needs_prefix_copy(topk: int, page_size: int) -> bool:
    """Branches t >= 1 hold a copy of the partial last page only for ps > 1 and K > 1."""
    return page_size > 1 and topk > 1


def _check_tables(op, req_to_token, req_pool_indices, seq_lens, topk, num_steps, page_size):
    _check_geometry(topk, num_steps, page_size)
    if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: req_to_token must be a 2-D int32/int64 table, got "
                        f"{tuple(req_to_token.shape)} {req_to_token.dtype}")
    if req_pool_indices.dim() != 1 or seq_lens.shape != req_pool_indices.shape:
        raise ValueError(f"{op}: req_pool_indices {tuple(req_pool_indices.shape)} and seq_lens "
                         f"{tuple(seq_lens.shape)} must both be (B,)")
    for name, x in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op}: {name} dtype {x.dtype}, expected int32 or int64")
        if x.device != req_to_token.device:
            raise ValueError(f"{op}: {name} is on {x.device}, req_to_token on "
                             f"{req_to_token.device}")


# ---------------------------------------------------------------- draft token positions

def draft_token_positions_torch(seq_lens: torch.Tensor, topk: int, num_steps: int,
                                page_size: int) -> torch.Tensor:
    """Reference: (B,) lengths -> (B, K, S) int64 positions `pos = L_b + t*npp_b*ps + s`."""
    _check_geometry(topk, num_steps, page_size)
    L = seq_lens.to(torch.int64)                                     # (B,)
    _, stride, _ = branch_geometry(L, num_steps, page_size)          # (B,)
    t = torch.arange(topk, device=L.device)
    s = torch.arange(num_steps, device=L.device)
    return L[:, None, None] + t[None, :, None] * stride[:, None, None] + s[None, None, :]


def draft_token_positions(seq_lens: torch.Tensor, topk: int, num_steps: int,
                          page_size: int) -> torch.Tensor:
    """req_to_token position of draft token s of branch t of request b, (B, K, S) int64:
    ps == 1 or K == 1: `L_b + t*S + s`; ps > 1 and K > 1: `floor(L_b/ps)*ps + t*npp*ps + last
    + s` with `last = L_b % ps`, `npp = ceil((last + S)/ps)`."""
    if use_triton(seq_lens):
        from eaglekv.kernels.draft_kv_indices_triton import draft_token_positions_triton
        _check_geometry(topk, num_steps, page_size)
        return draft_token_positions_triton(seq_lens, topk, num_steps, page_size)
    return draft_token_positions_torch(seq_lens, topk, num_steps, page_size)


# ---------------------------------------------------------------- assign draft cache locs

def _check_assign(req_to_token, req_pool_indices, seq_lens, out_cache_loc, topk, num_steps,
                  page_size, prefix_copy_locs):
    op = "assign_draft_cache_locs"
    _check_tables(op, req_to_token, req_pool_indices, seq_lens, topk, num_steps, page_size)
    B = seq_lens.numel()
    if out_cache_loc.numel() != B * topk * num_steps:
        raise ValueError(f"{op}: out_cache_loc has {out_cache_loc.numel()} slots, expected "
                         f"B*K*S = {B}*{topk}*{num_steps} laid out [b][t][s]")
    for name, x in (("out_cache_loc", out_cache_loc), ("prefix_copy_locs", prefix_copy_locs)):
        if x is not None and (x.dtype not in (torch.int32, torch.int64)
                              or x.device != req_to_token.device):
            raise TypeError(f"{op}: {name} must be int32/int64 on {req_to_token.device}, got "
                            f"{x.dtype} on {x.device}")
    if needs_prefix_copy(topk, page_size):
        want = (B, topk - 1, page_size)
        if prefix_copy_locs is None or tuple(prefix_copy_locs.shape) != want:
            got = None if prefix_copy_locs is None else tuple(prefix_copy_locs.shape)
            raise ValueError(f"{op}: page_size={page_size} > 1 and topk={topk} > 1 need "
                             f"prefix_copy_locs of shape (B, K-1, ps) = {want}, got {got}")
    elif prefix_copy_locs is not None:
        raise ValueError(f"{op}: prefix_copy_locs is only used when page_size > 1 and topk > 1 "
                         f"(page_size={page_size}, topk={topk}); pass None")


def assign_draft_cache_locs_torch(req_to_token, req_pool_indices, seq_lens, out_cache_loc,
                                  topk, num_steps, page_size, prefix_copy_locs=None) -> None:
    """Reference: check rows and positions, then write (nothing is written if one is bad)."""
    _check_assign(req_to_token, req_pool_indices, seq_lens, out_cache_loc, topk, num_steps,
                  page_size, prefix_copy_locs)
    B, (R, W) = seq_lens.numel(), req_to_token.shape
    rows = req_pool_indices.to(torch.int64)                          # (B,)
    check_indices(rows, R, "assign_draft_cache_locs req_pool_indices")
    pos = draft_token_positions_torch(seq_lens, topk, num_steps, page_size)   # (B, K, S)
    check_indices(pos, W, "assign_draft_cache_locs position")
    r = rows[:, None, None].expand_as(pos)                           # (B, K, S)
    req_to_token[r, pos] = out_cache_loc.reshape(B, topk, num_steps).to(req_to_token.dtype)
    if needs_prefix_copy(topk, page_size):
        # req_to_token[row_b, floor(L_b/ps)*ps + t*npp*ps + j] = prefix_copy_locs[b, t-1, j],
        # for 1 <= t < K and j < last_b
        last, stride, base = branch_geometry(seq_lens.to(torch.int64), num_steps, page_size)
        t = torch.arange(1, topk, device=rows.device)[None, :, None]          # (1, K-1, 1)
        j = torch.arange(page_size, device=rows.device)[None, None, :]        # (1, 1, ps)
        cols = base[:, None, None] + t * stride[:, None, None] + j            # (B, K-1, ps)
        keep = (j < last[:, None, None]).expand_as(cols)                      # (B, K-1, ps)
        rc = rows[:, None, None].expand_as(cols)
        req_to_token[rc[keep], cols[keep]] = prefix_copy_locs[keep].to(req_to_token.dtype)


def assign_draft_cache_locs(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                            seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, topk: int,
                            num_steps: int, page_size: int,
                            prefix_copy_locs: torch.Tensor | None = None) -> None:
    """`req_to_token[row_b, pos(b, t, s)] = out_cache_loc[b, t, s]` (out_cache_loc (B*K*S,)
    laid out [b][t][s]); for ps > 1 and K > 1 also the copied partial page of branch t >= 1:
    `req_to_token[row_b, floor(L_b/ps)*ps + t*npp*ps + j] = prefix_copy_locs[b, t-1, j]` for
    j < last_b (prefix_copy_locs (B, K-1, ps); entries j >= last_b are ignored).

    Guarded: every row must lie in [0, R) and every position in [0, W); otherwise
    `KVIndexError` names the first bad one and nothing of the batch is written. The slot
    values are not range-checked here (they come from the allocator); they are checked where
    they become addresses (`store_cache`, `generate_draft_decode_kv_indices`).
    """
    if not use_triton(req_to_token):
        return assign_draft_cache_locs_torch(req_to_token, req_pool_indices, seq_lens,
                                             out_cache_loc, topk, num_steps, page_size,
                                             prefix_copy_locs)
    from eaglekv.kernels.draft_kv_indices_triton import assign_draft_cache_locs_triton
    _check_assign(req_to_token, req_pool_indices, seq_lens, out_cache_loc, topk, num_steps,
                  page_size, prefix_copy_locs)
    assign_draft_cache_locs_triton(req_to_token, req_pool_indices, seq_lens, out_cache_loc,
                                   topk, num_steps, page_size, prefix_copy_locs)


# ---------------------------------------------------------------- draft decode kv indices

def _check_decode(req_to_token, req_pool_indices, seq_lens, topk, num_steps, page_size,
                  kv_indices, kv_indptr, size_limit) -> None:
    op = "generate_draft_decode_kv_indices"
    _check_tables(op, req_to_token, req_pool_indices, seq_lens, topk, num_steps, page_size)
    nb = seq_lens.numel() * topk
    if kv_indices.dim() != 2 or kv_indices.shape[0] != num_steps:
        raise ValueError(f"{op}: kv_indices has shape {tuple(kv_indices.shape)}, expected "
                         f"(num_steps={num_steps}, width)")
    if kv_indptr.dim() != 2 or kv_indptr.shape[0] != num_steps or kv_indptr.shape[1] < nb + 1:
        raise ValueError(f"{op}: kv_indptr has shape {tuple(kv_indptr.shape)}, expected "
                         f"(num_steps={num_steps}, >= B*K+1 = {nb + 1})")
    for name, x in (("kv_indices", kv_indices), ("kv_indptr", kv_indptr)):
        if x.dtype not in (torch.int32, torch.int64) or x.device != req_to_token.device:
            raise TypeError(f"{op}: {name} must be int32/int64 on {req_to_token.device}, got "
                            f"{x.dtype} on {x.device}")
    if operator.index(size_limit) < 1:
        raise ValueError(f"{op}: size_limit={size_limit} must be >= 1")


def _check_fit(seq_lens, topk, num_steps, kv_indices, seq_lens_sum) -> None:
    """`used_len = sum(L)*K + B*K*S <= kv_indices.shape[1]`, from the host sum when given."""
    total = int(seq_lens.sum()) if seq_lens_sum is None else operator.index(seq_lens_sum)
    bs = seq_lens.numel() * topk
    check_draft_kv_indices_fit(draft_kv_indices_used_len(total, topk, bs, num_steps),
                               kv_indices.shape[1])


def _branch_reads(L, topk, it, stride, base):
    """Step with `it` draft tokens visible: kv_indptr (B*K+1,) and, for every element of the
    row, its branch's request b, branch t, index i in the segment and req_to_token column.

    Segment of (b, t) starts at `K*sum_{j<b} L_j + b*it*K + t*(L_b + it)` (the cumulative sum of
    the segment lengths L_b + it) and reads column `i + (i >= base_b) * t*stride_b`, i < L_b+it:
    the prefix below the partial page, then (t >= 1, ps > 1) the copied page, then the drafts.
    """
    B = L.numel()
    seg = (L[:, None] + it).expand(B, topk).reshape(-1)             # (B*K,) L_b + it
    indptr = torch.zeros(B * topk + 1, dtype=torch.int64, device=L.device)
    torch.cumsum(seg, 0, out=indptr[1:])                            # (B*K+1,)
    branch = torch.repeat_interleave(torch.arange(B * topk, device=L.device), seg)  # (total,)
    i = torch.arange(branch.numel(), device=L.device) - indptr[branch]             # (total,)
    b, t = branch // topk, branch % topk
    col = i + torch.where(i >= base[b], t * stride[b], torch.zeros_like(i))        # (total,)
    return indptr, b, t, i, col


def generate_draft_decode_kv_indices_torch(req_to_token, req_pool_indices, seq_lens, topk,
                                           num_steps, page_size, kv_indices, kv_indptr,
                                           size_limit, *, seq_lens_sum=None) -> None:
    """Reference: check the used length, rows, positions and every slot read, then write."""
    _check_decode(req_to_token, req_pool_indices, seq_lens, topk, num_steps, page_size,
                  kv_indices, kv_indptr, size_limit)
    L, rows = seq_lens.to(torch.int64), req_pool_indices.to(torch.int64)  # (B,), (B,)
    if seq_lens_sum is not None and seq_lens_sum != int(L.sum()):
        raise ValueError(f"generate_draft_decode_kv_indices: seq_lens_sum={seq_lens_sum} but "
                         f"seq_lens sum to {int(L.sum())}")
    _check_fit(L, topk, num_steps, kv_indices, None)
    R, W = req_to_token.shape
    check_indices(rows, R, "draft kv_indices req_pool_indices")
    pos = draft_token_positions_torch(L, topk, num_steps, page_size)      # (B, K, S)
    check_indices(pos, W, "draft kv_indices req_to_token column")
    _, stride, base = branch_geometry(L, num_steps, page_size)
    steps = [_branch_reads(L, topk, it, stride, base) for it in range(1, num_steps + 1)]
    # the last step reads everything the others read; count each table entry once
    _, b, t, i, col = steps[-1]
    vals = req_to_token[rows[b], col].to(torch.int64)                     # (total,)
    bad = ((vals < 0) | (vals >= size_limit)) & ((t == 0) | (i >= base[b]))
    if bool(bad.any()):
        first = int((rows[b] * W + col)[bad].min())                       # earliest entry
        raise KVIndexError("draft kv_indices", int(req_to_token.reshape(-1)[first]), size_limit,
                           int(bad.sum()), req_to_token.numel())
    for step, (indptr, b, _, _, col) in enumerate(steps):
        kv_indices[step, :col.numel()] = req_to_token[rows[b], col].to(kv_indices.dtype)
        kv_indptr[step, :indptr.numel()] = indptr.to(kv_indptr.dtype)


def generate_draft_decode_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                     seq_lens: torch.Tensor, topk: int, num_steps: int,
                                     page_size: int, kv_indices: torch.Tensor,
                                     kv_indptr: torch.Tensor, size_limit: int, *,
                                     seq_lens_sum: int | None = None) -> None:
    """Fill the per-step kv lists the draft decode attends over (kv_indices (S, width),
    kv_indptr (S, >= B*K+1); int32 or int64).

    Step `step` (it = step + 1 draft tokens visible): branch (b, t) owns the segment starting
    at `K * sum_{j<b} L_j + b*it*K + t*(L_b + it)` = `kv_indptr[step, b*K + t]`, total
    `kv_indptr[step, B*K] = K*sum(L) + B*K*it`. The segment holds the prefix, then the `it`
    draft slots `req_to_token[row_b, pos(b, t, s)]`, s < it. Prefix: ps == 1, K == 1 or t == 0:
    `req_to_token[row_b, :L_b]`; otherwise `req_to_token[row_b, :L_b - last_b]` followed by the
    copied partial page `req_to_token[row_b, region_start_t : region_start_t + last_b]`.

    Guards, in this order: `used_len(sum(L), K, B*K, S) <= width` (host check, from
    `seq_lens_sum` when given, else one sum over seq_lens: a host sync on CUDA, so the engine
    passes it); rows in [0, R); positions in [0, W); every slot read in [0, size_limit). A bad
    slot is never written (Triton writes the padding slot 0 instead; the CPU path writes
    nothing at all) and raises `KVIndexError` naming the bad value at the earliest table
    entry, counting each table entry once, out of `req_to_token.numel()`.
    """
    if not use_triton(kv_indices):
        return generate_draft_decode_kv_indices_torch(
            req_to_token, req_pool_indices, seq_lens, topk, num_steps, page_size, kv_indices,
            kv_indptr, size_limit, seq_lens_sum=seq_lens_sum)
    from eaglekv.kernels.draft_kv_indices_triton import generate_draft_decode_kv_indices_triton
    _check_decode(req_to_token, req_pool_indices, seq_lens, topk, num_steps, page_size,
                  kv_indices, kv_indptr, size_limit)
    _check_fit(seq_lens, topk, num_steps, kv_indices, seq_lens_sum)
    generate_draft_decode_kv_indices_triton(req_to_token, req_pool_indices, seq_lens, topk,
                                            num_steps, page_size, kv_indices, kv_indptr,
                                            size_limit)
