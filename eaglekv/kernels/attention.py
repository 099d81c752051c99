"""Guarded paged attention: decode (one query per sequence) and extend (causal or tree mask).

Keys of sequence b are the slots `table[kv_start[b] + pos]` of its int32 table (a flat
`req_to_token.view(-1)` with `kv_start = req_pool_indices * W`, or the draft's `kv_indices`
with `kv_start = kv_indptr[:B]`), and K/V rows are `k_buffer[slot]`, `v_buffer[slot]`
(rows, Hkv, D). Every slot read must satisfy `0 <= slot < size_limit`.

- decode: query b attends to pos in [0, kv_len[b]).
- extend: query t of request b (q[q_start[b] + t], t < extend_len[b]) sits at position
  prefix_len[b] + t; it sees pos < prefix_len[b], and window key j (pos = prefix_len[b] + j,
  j < extend_len[b]) if j <= t (mask None) or mask[b, t, j] | (j == t) (tree mask).

Every table position read, `kv_start[b] + pos`, must lie in `[0, table.numel())` too (a corrupt
kv_start or kv_len would read past req_to_token or past a draft kv_indices buffer): the error
names the op as "<op> table position".

CUDA tensors run the Triton kernels (`attention_triton`: a bad slot or position is never read
and is reported at the step's sync); CPU tensors the PyTorch references below (`KVIndexError`
before computing).
Host checks read shapes and dtypes only, never device values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from eaglekv.errors import KVIndexError
from eaglekv.kernels.guard import check_indices
from eaglekv.kernels.store_cache import use_triton

MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 64


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132   # an H200's; only sizes the split count
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, max_kv_len: int, sm_count: int = 132) -> int:
    """Splits per (sequence, kv head) so that B * Hkv * splits >= 2 * SMs, capped at
    MAX_SPLITS and at cdiv(max_kv_len, MIN_KEYS_PER_SPLIT) (a host decision only). B is
    rounded up to a power of two, as the decode graphs' buckets are: the split count is a
    constant of the compiled kernel, so an eager decode of an odd batch (an adaptive step's
    plain part, the tail of a batch) reuses a graph bucket's kernel instead of compiling its
    own mid-run (~0.5 s on an H100)."""
    batch = 1 << max(0, (max(1, batch) - 1).bit_length())
    want = -(-2 * sm_count // (batch * kv_heads))
    by_len = -(-max(1, max_kv_len) // MIN_KEYS_PER_SPLIT)
    return max(1, min(MAX_SPLITS, want, by_len))


def _check_common(op, q, k_buffer, v_buffer, table, size_limit, scale, meta, out, q_rows):
    """Shape/dtype/device checks shared by decode and extend; returns (H, Hkv, D)."""
    if q.dim() != 3:
        raise ValueError(f"{op}: q has shape {tuple(q.shape)}, expected 3-D ({q_rows}, H, D)")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: q dtype {q.dtype}, expected float32, float16 or bfloat16")
    if k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"{op}: k_buffer {tuple(k_buffer.shape)} and v_buffer "
                         f"{tuple(v_buffer.shape)} must both be (rows, Hkv, D)")
    if not (k_buffer.is_contiguous() and v_buffer.is_contiguous()):
        raise ValueError(f"{op}: k_buffer and v_buffer must be contiguous")
    for name, x in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if x.dtype != q.dtype:
            raise TypeError(f"{op}: {name} dtype {x.dtype} != q dtype {q.dtype}")
    H, D = q.shape[1], q.shape[2]
    hkv = k_buffer.shape[1]
    if k_buffer.shape[2] != D:
        raise ValueError(f"{op}: head_dim {D} of q != {k_buffer.shape[2]} of k_buffer")
    if hkv == 0 or H % hkv:
        raise ValueError(f"{op}: {H} query heads is not a multiple of {hkv} kv heads")
    if table.dim() != 1 or table.dtype != torch.int32:
        raise TypeError(f"{op}: table must be a flat int32 tensor, got {table.dtype} of shape "
                        f"{tuple(table.shape)} (pass req_to_token.view(-1))")
    if table.numel() > 2**32:
        raise ValueError(f"{op}: table has {table.numel()} entries, the error key holds 2**32")
    if not isinstance(size_limit, int) or not 0 < size_limit <= k_buffer.shape[0]:
        raise ValueError(f"{op}: size_limit={size_limit} must be an int in [1, "
                         f"{k_buffer.shape[0]}] (the buffer's rows)")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"{op}: scale={scale!r} must be a finite float")
    B = None
    for name, x in meta:
        if x.dim() != 1 or x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op}: {name} must be a 1-D int64 (or int32) tensor, got "
                            f"{x.dtype} of shape {tuple(x.shape)}")
        if B is not None and x.shape[0] != B:
            raise ValueError(f"{op}: {name} has {x.shape[0]} entries, {meta[0][0]} has {B}")
        if x.shape[0] > 1 and x.stride(0) != 1:    # the kernels index it as packed
            raise ValueError(f"{op}: {name} has stride {x.stride(0)}; the kernels read it "
                             f"packed (stride 1): pass {name}.contiguous()")
        B = x.shape[0]
    tensors = [("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("table", table),
               *meta] + ([("out", out)] if out is not None else [])
    if len({x.device for _, x in tensors}) > 1:
        raise ValueError(f"{op}: tensors on different devices: "
                         + ", ".join(f"{n} on {x.device}" for n, x in tensors))
    return H, hkv, D


def _check_out(op, out, shape, dtype):
    if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype):
        raise ValueError(f"{op}: out is {out.dtype} {tuple(out.shape)}, expected {dtype} "
                         f"{tuple(shape)}")


def _check_positions(segments, n_table, op, layer):
    """KVIndexError ("<op> table position") unless every table position of every segment
    (start, n) lies in [0, n_table): a corrupt kv_start / kv_len (a request row past
    req_to_token, a segment past the draft's kv_indices). Names the first position past the
    end (else the negative one nearest 0) and counts them all, as the Triton kernels do."""
    count, past, neg = 0, None, None
    for start, n in segments:
        if n <= 0:
            continue
        n_neg = max(min(start + n, 0) - start, 0)
        n_past = max(start + n - max(start, n_table), 0)
        count += n_neg + n_past
        if n_past:
            past = max(start, n_table) if past is None else min(past, max(start, n_table))
        if n_neg:
            neg = min(start + n - 1, -1) if neg is None else max(neg, min(start + n - 1, -1))
    if count:
        raise KVIndexError(f"{op} table position", past if past is not None else neg, n_table,
                           count, n_table, layer=layer)


def _gather(table, start, n):
    """Slots table[start : start + n] as int64 (n,) (positions checked by _check_positions)."""
    return table[start:start + n].to(torch.int64)


def _check_all(slots, table, size_limit, op, layer):
    """One check (one host sync) over every request's slots: the first bad in request order,
    the count over the call, the layer."""
    try:
        check_indices(torch.cat(slots) if slots else table[:0], size_limit, op)
    except KVIndexError as e:
        raise e.with_layer(layer) if layer is not None else e


def _attend_ref(q, k, v, visible, scale):
    """q (Tq, H, D), k/v (S, Hkv, D), visible (Tq, S) bool -> (Tq, H, D), plain softmax."""
    G = q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)                  # fp32 (fp64 stays)
    k = k.to(acc).repeat_interleave(G, dim=1)                          # (S, H, D)
    v = v.to(acc).repeat_interleave(G, dim=1)
    s = torch.einsum("thd,shd->hts", q.to(acc), k) * scale             # (H, Tq, S)
    s = s.masked_fill(~visible[None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)                       # a row with no key -> 0
    return torch.einsum("hts,shd->thd", p, v)                          # (Tq, H, D)


def decode_attention_torch(q, k_buffer, v_buffer, table, kv_start, kv_len, scale, *,
                           size_limit: int, layer: int | None = None) -> torch.Tensor:
    """PyTorch reference and CPU path: all slots checked first, then one request at a time."""
    B = q.shape[0]
    starts, lens = kv_start.tolist(), kv_len.tolist()
    _check_positions(zip(starts, lens), table.numel(), "decode_attention", layer)
    slots = [_gather(table, starts[b], max(lens[b], 0)) for b in range(B)]
    _check_all(slots, table, size_limit, "decode_attention", layer)
    out = torch.zeros_like(q)
    for b in range(B):
        if lens[b]:
            vis = torch.ones(1, lens[b], dtype=torch.bool, device=q.device)
            out[b] = _attend_ref(q[b:b + 1], k_buffer[slots[b]], v_buffer[slots[b]], vis,
                                 scale)[0].to(q.dtype)
    return out


def extend_attention_torch(q, k_buffer, v_buffer, table, kv_start, prefix_len, extend_len,
                           q_start, scale, *, size_limit: int, mask=None,
                           layer: int | None = None, out=None) -> torch.Tensor:
    """PyTorch reference and CPU path; rows of `out` outside every request's queries stay as
    they were (zeros when out is None)."""
    B = kv_start.shape[0]
    starts, pre, ext, q0 = (x.tolist() for x in (kv_start, prefix_len, extend_len, q_start))
    for b in range(B):
        if pre[b] < 0:
            raise ValueError(f"extend_attention: prefix_len {pre[b]} of request {b} < 0")
    _check_positions(zip(starts, [p + max(e, 0) for p, e in zip(pre, ext)]), table.numel(),
                     "extend_attention", layer)
    slots = [_gather(table, starts[b], pre[b] + max(ext[b], 0)) for b in range(B)]
    _check_all(slots, table, size_limit, "extend_attention", layer)
    res = torch.zeros_like(q) if out is None else out.clone()
    for b in range(B):
        p, e = pre[b], ext[b]
        if e == 0:
            continue
        if q0[b] < 0 or q0[b] + e > q.shape[0]:
            raise ValueError(f"extend_attention: queries [{q0[b]}, {q0[b] + e}) of request {b} "
                             f"outside q of {q.shape[0]} tokens")
        if b + 1 < B and q0[b] < q0[b + 1] < q0[b] + e:   # the Triton kernel stops there
            raise ValueError(f"extend_attention: queries [{q0[b]}, {q0[b] + e}) of request {b} "
                             f"run into request {b + 1}'s, which start at {q0[b + 1]}")
        t = torch.arange(e, device=q.device)
        if mask is None:
            window = t[None, :] <= t[:, None]                          # (e, e) causal
        else:
            if e > mask.shape[1]:
                raise ValueError(f"extend_attention: extend_len {e} of request {b} > mask "
                                 f"width {mask.shape[1]}")
            window = mask[b, :e, :e] | torch.eye(e, dtype=torch.bool, device=q.device)
        vis = torch.cat([torch.ones(e, p, dtype=torch.bool, device=q.device), window], 1)
        res[q0[b]:q0[b] + e] = _attend_ref(q[q0[b]:q0[b] + e], k_buffer[slots[b]],
                                           v_buffer[slots[b]], vis, scale).to(q.dtype)
    return res


_TRITON_IMPL = None


def _triton_impl():
    """The Triton module, imported on first use (CPU-only installs never import Triton)."""
    global _TRITON_IMPL
    if _TRITON_IMPL is None:
        from eaglekv.kernels import attention_triton
        _TRITON_IMPL = attention_triton
    return _TRITON_IMPL


@dataclass
class DecodePartials:
    """A Triton decode attention's output still in its split-K partials (`defer_merge`):
    `out` (B, H, D) is not written until `finish()` merges mid_o (B, H, S, DP) and mid_lse (B,
    H, S) into it; `fused.gemv_merge` merges them inside the o projection instead."""
    out: torch.Tensor
    mid_o: torch.Tensor
    mid_lse: torch.Tensor
    head_dim: int

    def finish(self) -> torch.Tensor:
        return _triton_impl().merge_decode_partials(self.mid_o, self.mid_lse, self.out)


def decode_attention(q, k_buffer, v_buffer, table, kv_start, kv_len, scale, *, size_limit,
                     num_splits=None, max_kv_len=None, layer=None, out=None,
                     checked=True, defer_merge=False, one_token=False):
    """q (B, H, D) -> (B, H, D): query b over the keys pos < kv_len[b] (split-K on CUDA).

    `num_splits` defaults from `max_kv_len` (a host bound, default table.numel()) and B;
    `out` receives the result (graph capture). A slot outside [0, size_limit) is never read.
    `checked=False`: the caller has checked every table position and slot this call reads
    (`table_guard.guard_table_rows`), so the Triton kernel reads them without checks (the
    PyTorch path checks whatever it is told). `defer_merge`: the Triton path may return
    `DecodePartials` (split-K, the merge not yet run) instead of a tensor. `one_token`: only
    each query's last key was stored by the forward this call is part of (a target decode):
    with `checked=False` the Triton kernel may read the others before its PDL wait
    (`attention_triton.DECODE_PREFETCH`).
    """
    op = "decode_attention"
    H, hkv, D = _check_common(op, q, k_buffer, v_buffer, table, size_limit, scale,
                              [("kv_start", kv_start), ("kv_len", kv_len)], out, "B")
    if kv_start.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: kv_start has {kv_start.shape[0]} entries, q {q.shape[0]} rows")
    _check_out(op, out, q.shape, q.dtype)
    if max_kv_len is None:
        max_kv_len = table.numel()
    if num_splits is None:
        num_splits = default_num_splits(q.shape[0], hkv, max_kv_len, _sm_count(q.device))
    if not isinstance(num_splits, int) or not 1 <= num_splits <= 64:
        raise ValueError(f"{op}: num_splits={num_splits} must be an int in [1, 64]")
    if not use_triton(q):
        res = decode_attention_torch(q, k_buffer, v_buffer, table, kv_start, kv_len, scale,
                                     size_limit=size_limit, layer=layer)
        return res if out is None else out.copy_(res)
    out = torch.empty_like(q) if out is None else out
    return _triton_impl().decode_attention_triton(q, k_buffer, v_buffer, table, kv_start,
                                                  kv_len, float(scale), size_limit,
                                                  num_splits, layer, out, checked, defer_merge,
                                                  one_token)


def extend_attention(q, k_buffer, v_buffer, table, kv_start, prefix_len, extend_len, q_start,
                     scale, *, size_limit, mask=None, max_extend=None, layer=None,
                     out=None, checked=True, num_splits=None, max_keys=None) -> torch.Tensor:
    """q (T, H, D) -> (T, H, D): request b's queries over its cached prefix and its window
    (causal, or the tree `mask` (B, Nmax, Nmax) bool). `max_extend` (host bound on
    extend_len, default T) sizes the grid. Rows outside every request's queries are not
    written (undefined when `out` is None on CUDA). `checked=False` as in
    `decode_attention`. On CUDA a short extend of few requests splits its prefix over
    `num_splits` programs (default from the grid and `max_keys`, a host bound on a request's
    prefix + extend; `attention_triton.extend_num_splits`)."""
    op = "extend_attention"
    meta = [("kv_start", kv_start), ("prefix_len", prefix_len), ("extend_len", extend_len),
            ("q_start", q_start)]
    _check_common(op, q, k_buffer, v_buffer, table, size_limit, scale, meta, out, "T")
    _check_out(op, out, q.shape, q.dtype)
    B = kv_start.shape[0]
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 3 or mask.shape[0] != B \
                or mask.shape[1] != mask.shape[2]:
            raise ValueError(f"{op}: mask is {mask.dtype} {tuple(mask.shape)}, expected bool "
                             f"({B}, Nmax, Nmax)")
        if mask.device != q.device:
            raise ValueError(f"{op}: mask on {mask.device}, q on {q.device}")
    max_extend = q.shape[0] if max_extend is None else max_extend
    if not isinstance(max_extend, int) or not 0 <= max_extend <= q.shape[0]:
        raise ValueError(f"{op}: max_extend={max_extend} must be an int in [0, {q.shape[0]}]")
    if num_splits is not None and (not isinstance(num_splits, int) or not 1 <= num_splits <= 64):
        raise ValueError(f"{op}: num_splits={num_splits} must be an int in [1, 64]")
    if not use_triton(q):
        res = extend_attention_torch(q, k_buffer, v_buffer, table, kv_start, prefix_len,
                                     extend_len, q_start, scale, size_limit=size_limit,
                                     mask=mask, layer=layer, out=out)
        return res if out is None else out.copy_(res)
    out = torch.empty_like(q) if out is None else out
    return _triton_impl().extend_attention_triton(q, k_buffer, v_buffer, table, kv_start,
                                                  prefix_len, extend_len, q_start, float(scale),
                                                  size_limit, mask, max_extend, layer, out,
                                                  checked, num_splits, max_keys)
