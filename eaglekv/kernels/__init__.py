"""Kernels that turn slot ids into addresses. Each has a PyTorch reference (the CPU path)."""

from eaglekv.kernels.guard import guard_indices, kv_guard
from eaglekv.kernels.move_kv import move_kv
from eaglekv.kernels.store_cache import default_num_split, store_cache, store_cache_torch

__all__ = ["default_num_split", "guard_indices", "kv_guard", "move_kv", "store_cache",
           "store_cache_torch"]
