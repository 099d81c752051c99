"""Guarded KV row moves, `cache[dst[i]] = cache[src[i]]` for every layer's K and V (used for
compaction of accepted speculative tokens). Both index lists are checked against the pool's
`size_limit` before any address is formed."""

from __future__ import annotations

import torch

from eaglekv.kernels.guard import guard_indices


def move_kv(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], dst: torch.Tensor,
            src: torch.Tensor, size_limit: int) -> None:
    """Copy rows src -> dst in each cache. CPU: raises `KVIndexError` before any write. CUDA:
    a bad index is redirected to the padding slot 0 and raised at the step's sync."""
    checked = _checked(dst, src, size_limit)
    if checked is None:
        return
    dst_ok, src_ok = checked
    for cache in list(k_caches) + list(v_caches):
        rows = cache.index_select(0, src_ok)      # read all first: src and dst may overlap
        cache.index_copy_(0, dst_ok, rows)


def move_kv_stacked(kv: torch.Tensor, dst: torch.Tensor, src: torch.Tensor,
                    size_limit: int) -> None:
    """`move_kv` over a pool kept as one tensor `kv` (2, layers, rows, ...): every layer's K
    and V rows src -> dst in two ops (four a layer otherwise: 120 launches for 30 layers)."""
    checked = _checked(dst, src, size_limit)
    if checked is None:
        return
    dst_ok, src_ok = checked
    rows = kv.index_select(2, src_ok)             # read all first: src and dst may overlap
    kv.index_copy_(2, dst_ok, rows)


def _checked(dst: torch.Tensor, src: torch.Tensor, size_limit: int):
    """(dst, src) flat int64 and guarded, or None when there is nothing to move."""
    if dst.shape != src.shape:
        raise ValueError(f"move_kv: dst {tuple(dst.shape)} and src {tuple(src.shape)} differ")
    if dst.numel() == 0:
        return None
    src_ok = guard_indices(src, size_limit, "move_kv src").reshape(-1).to(torch.int64)
    dst_ok = guard_indices(dst, size_limit, "move_kv dst").reshape(-1).to(torch.int64)
    return dst_ok, src_ok
