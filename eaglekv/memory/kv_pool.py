"""Per-layer K/V buffers `[size + page_size, kv_heads, head_dim]` addressed by slot id."""

from __future__ import annotations

import math
import mmap
import weakref

import torch

from eaglekv.errors import ConfigError, KVIndexError
from eaglekv.kernels import store_cache
from eaglekv.kernels.guard import guard_indices
from eaglekv.kernels.store_cache import WRITE_CHECKS
from eaglekv.kernels.move_kv import move_kv_stacked


class KVPool:
    # tests: rows of a known pattern before and after every layer's K and V rows
    # (`canaries_intact`), where a write through an unchecked index would land
    canary_rows = 0
    CANARY = 1234.5

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
        c = self.canary_rows
        # On the CPU the pool lives in an anonymous memory map: zeros, like torch.zeros, but a
        # page is only committed (resident) once a K/V row on it is written, so a short
        # `generate` does not pay for the whole pool (issue 17: 180 MiB of a 968 MiB peak)
        shape = (2, num_layers, rows + 2 * c, kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            self._map = mmap.mmap(-1, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
            full = torch.frombuffer(self._map, dtype=dtype).view(shape)
        else:
            full = torch.zeros(shape, dtype=dtype, device=device)
        full[:, :, :c] = full[:, :, rows + c:] = self.CANARY
        self.kv = full[:, :, c:c + rows] if c else full
        self._full = full
        self.k_buffer, self.v_buffer = list(self.kv[0]), list(self.kv[1])
        # the ownership checked mode (memory/ownership.py): None, or the SlotOwners whose
        # rules a store or move must follow (`lenient`: a draft that catches up over its
        # requests' committed tokens)
        self.owners, self.lenient = None, False

    def canaries_intact(self) -> bool:
        c = self.canary_rows
        if not c:
            return True
        edge = torch.cat([self._full[:, :, :c], self._full[:, :, -c:]], 2)
        return bool((edge == self.CANARY).all())

    def watch(self, owners, lenient: bool = False) -> None:
        """Check every store and move against `owners` (memory/ownership.py); None: stop.
        Stores are seen through store_cache's WRITE_CHECKS, whatever calls it (the fused
        RoPE + store of the Triton backend's CPU path too)."""
        self.owners, self.lenient = owners, lenient
        key = self._full.untyped_storage().data_ptr()
        if owners is None:
            WRITE_CHECKS.pop(key, None)
            return
        ref = weakref.ref(self)

        def check(indices):
            pool = ref()            # a dead pool's storage may be reused by another one
            if pool is not None and pool.owners is not None:
                pool.owners.check_write("store_cache", indices, pool.lenient)
        WRITE_CHECKS[key] = check

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
        if self.owners is not None:
            self.owners.check_move(dst, src, self.lenient)
        move_kv_stacked(self.kv, dst, src, self.size_limit)

    def guard_reads(self, kv_idx: torch.Tensor,
                    op: str = "attention kv gather") -> torch.Tensor:
        """The slots an attention reads, (rows, keys): guarded against size_limit
        (`guard_indices`) and, in the ownership checked mode, each row reading the committed
        K/V of one request only."""
        kv_idx = guard_indices(kv_idx, self.size_limit, op)
        if self.owners is not None:
            self.owners.check_reads(op, kv_idx)
        return kv_idx

    def check_segment_reads(self, kv_indices: torch.Tensor, starts: torch.Tensor,
                            lens: tuple[int, ...]) -> None:
        """In the ownership checked mode, the reads of n sequences whose slots are
        `kv_indices[starts[i] : starts[i] + lens[i]]` (a draft step's branches): each reads
        the committed K/V of one request only. Nothing to do when the mode is off."""
        if self.owners is None or not lens:
            return
        pos = torch.arange(max(lens), device=starts.device)                     # (Smax,)
        valid = pos[None, :] < torch.tensor(lens, device=starts.device)[:, None]  # (n, Smax)
        flat = torch.where(valid, starts[:len(lens), None].to(torch.int64) + pos[None, :], 0)
        slots = torch.where(valid, kv_indices[flat].to(torch.int64), 0)          # (n, Smax)
        self.owners.check_reads("attention kv gather", slots)

    def get_kv_buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_layer(layer)
        return self.k_buffer[layer], self.v_buffer[layer]
