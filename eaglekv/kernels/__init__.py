"""Kernels that turn slot ids into addresses. Each has a PyTorch reference (the CPU path)."""

from eaglekv.kernels.store_cache import default_num_split, store_cache, store_cache_torch

__all__ = ["default_num_split", "store_cache", "store_cache_torch"]
