"""Guarded KV scatter: row i of k/v goes to row `indices[i]` of the caches.

A row is one token's K (or V) for all kv heads, `heads * head_dim` elements, viewed 2-D as
`[num_tokens, row]`. Every index must satisfy `0 <= index < size_limit`; otherwise
`KVIndexError` (first bad index, count, limit) is raised and nothing is written.
"""

from __future__ import annotations

import math
import os

import torch

from eaglekv.kernels.guard import check_indices, checks_enabled


# The ownership checked mode (memory/ownership.py): a cache's storage data_ptr -> a check
# run on the indices of every CPU store into it, after the range check, before the write.
# Empty (one dict test per store) unless a KVPool is watched.
WRITE_CHECKS: dict = {}


def default_num_split(row_bytes: int) -> int:
    """How many workers share one row: 4 if row_bytes % 2048 == 0, 2 if % 1024 == 0, else 1."""
    if row_bytes % 2048 == 0:
        return 4
    if row_bytes % 1024 == 0:
        return 2
    return 1


def _as_rows(x: torch.Tensor, n: int, name: str) -> torch.Tensor:
    if x.dim() < 1 or x.shape[0] != n:
        raise ValueError(f"store_cache: {name} has shape {tuple(x.shape)}, expected {n} rows")
    row = math.prod(x.shape[1:])
    return x.reshape(n, row)  # copies only if the layout is not viewable: strides are honoured


def resolve_args(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 indices: torch.Tensor, row_bytes: int, num_split: int, size_limit: int):
    """Shared argument checks of every store_cache path; returns (k2, v2, kc2, vc2, limit, split)."""
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"store_cache: indices dtype {indices.dtype}, expected int32 or int64")
    devices = {name: x.device for name, x in (("k", k), ("v", v), ("k_cache", k_cache),
                                               ("v_cache", v_cache), ("indices", indices))}
    if len(set(devices.values())) > 1:   # a pointer from another device is not an address here
        raise ValueError("store_cache: tensors on different devices: "
                         + ", ".join(f"{n} on {d}" for n, d in devices.items()))
    n = indices.numel()
    k2, v2 = _as_rows(k, n, "k"), _as_rows(v, n, "v")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_cache: k_cache and v_cache must be contiguous")
    kc2, vc2 = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    for name, x, c in (("k", k2, kc2), ("v", v2, vc2)):
        if x.shape[1] != c.shape[1]:
            raise ValueError(f"store_cache: {name} rows have {x.shape[1]} elements, "
                             f"cache rows {c.shape[1]}")
        if x.dtype != c.dtype:
            raise TypeError(f"store_cache: {name} dtype {x.dtype} != cache dtype {c.dtype}")
    actual_row_bytes = k2.shape[1] * k2.element_size()
    if row_bytes and row_bytes != actual_row_bytes:
        raise ValueError(f"store_cache: row_bytes={row_bytes} but rows are {actual_row_bytes} bytes")
    split = num_split or default_num_split(actual_row_bytes)
    if split < 1 or k2.shape[1] % split:
        raise ValueError(f"store_cache: num_split={split} must divide the row of {k2.shape[1]} "
                         f"elements")
    limit = size_limit or k_cache.shape[0]
    if limit > k_cache.shape[0] or limit > v_cache.shape[0]:
        raise ValueError(f"store_cache: size_limit={limit} exceeds the cache of "
                         f"{min(k_cache.shape[0], v_cache.shape[0])} rows")
    return k2, v2, kc2, vc2, limit, split


def store_cache_torch(k, v, k_cache, v_cache, indices, *, row_bytes: int = 0, num_split: int = 0,
                      size_limit: int = 0) -> None:
    """PyTorch reference and CPU path: validate all indices, then scatter."""
    k2, v2, kc2, vc2, limit, _ = resolve_args(k, v, k_cache, v_cache, indices, row_bytes,
                                              num_split, size_limit)
    if indices.numel() == 0:
        return
    check_indices(indices, limit, "store_cache")
    if WRITE_CHECKS:
        check = WRITE_CHECKS.get(k_cache.untyped_storage().data_ptr())
        if check is not None:
            check(indices)
    idx = indices.reshape(-1).to(torch.int64)
    kc2.index_copy_(0, idx, k2)
    vc2.index_copy_(0, idx, v2)


_TRITON_IMPL = None


def _triton_impl():
    """The Triton module, imported on first use (CPU-only installs never import Triton)."""
    global _TRITON_IMPL
    if _TRITON_IMPL is None:
        from eaglekv.kernels import store_cache_triton
        _TRITON_IMPL = store_cache_triton
    return _TRITON_IMPL


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors take the Triton kernel; CPU tensors only when the tests ask for the Triton
    interpreter (TRITON_INTERPRET=1 and EAGLEKV_TRITON_ON_CPU=1)."""
    return x.is_cuda or (os.environ.get("EAGLEKV_TRITON_ON_CPU") == "1"
                         and os.environ.get("TRITON_INTERPRET") == "1")


def store_cache(k, v, k_cache, v_cache, indices, *, row_bytes: int = 0, num_split: int = 0,
                size_limit: int = 0, layer: int | None = None, checked: bool = True) -> None:
    """Scatter K/V rows into the caches; a slot outside `[0, size_limit)` is never written.

    CPU (PyTorch path): raises `KVIndexError` before writing anything. CUDA (Triton): the bad
    rows are masked and the error is raised at the step's host sync (`kernels.guard`), or at
    once outside an engine step. `checked=False` (unchecked kernel) exists for benchmarks only.
    Repeated calls with the same shapes skip the checks and Triton's dispatch (see
    `store_cache_triton`); `EAGLEKV_TRITON_FAST_LAUNCH=0` turns that off.
    """
    if not use_triton(k):
        return store_cache_torch(k, v, k_cache, v_cache, indices, row_bytes=row_bytes,
                                 num_split=num_split, size_limit=size_limit)
    st = _triton_impl()
    checked = checked and checks_enabled()
    if st.fast_launch_enabled():
        st.store_cache_triton_fast(k, v, k_cache, v_cache, indices, row_bytes, num_split,
                                   size_limit, layer, checked, resolve_args)
        return
    k2, v2, kc2, vc2, limit, split = resolve_args(k, v, k_cache, v_cache, indices, row_bytes,
                                                  num_split, size_limit)
    st.store_cache_triton(k2, v2, kc2, vc2, indices, limit, split, check=checked, layer=layer)
