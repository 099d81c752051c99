"""Per-layer K/V buffers `[size + page_size, kv_heads, head_dim]` addressed by slot id."""

from __future__ import annotations

import torch

from eaglekv.errors import ConfigError, KVIndexError
from eaglekv.kernels import store_cache
from eaglekv.kernels.move_kv import move_kv_stacked


class KVPool:
    def __init__(self, size: int, page_size: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if size < 1 or num_layers < 1 or kv_heads < 1 or head_dim < 1:
            raise ConfigError(f"KVPool(size={size}, layers={num_layers}, kv_heads={kv_heads}, "
                              f"head_dim={head_dim}): every value must be >= 1")
        self.size, self.page_size = size, page_size
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype = dtype
        rows = size + page_size  # slots [0, page_size) are the padding page
        # one tensor (K|V, layer, slot, head, dim); each layer's K and V are contiguous views
        # of it, and a move of rows across every layer is two ops (`move_kv_stacked`)
        self.kv = torch.zeros(2, num_layers, rows, kv_heads, head_dim, dtype=dtype,
                              device=device)
        self.k_buffer, self.v_buffer = list(self.kv[0]), list(self.kv[1])

    @property
    def size_limit(self) -> int:
        """Valid slot range is `[0, size + page_size)` (the padding page included)."""
        return self.size + self.page_size

    @staticmethod
    def bytes_per_slot(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:  # a negative index would wrap to another layer
            raise KVIndexError("kv_pool layer", layer, self.num_layers, 1, 1)

    def set_kv_buffer(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_layer(layer)
        try:
            store_cache(k, v, self.k_buffer[layer], self.v_buffer[layer], loc,
                        size_limit=self.size_limit, layer=layer)
        except KVIndexError as e:
            raise e.with_layer(layer) from None

    def move_kv(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Every layer: K/V of slot src[i] -> slot dst[i] (guarded against size_limit)."""
        move_kv_stacked(self.kv, dst, src, self.size_limit)

    def get_kv_buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_layer(layer)
        return self.k_buffer[layer], self.v_buffer[layer]
