"""How many KV slots the pool gets: `max_total_tokens`, or a fraction of free memory."""

from __future__ import annotations

import os

import torch

from eaglekv.config import EngineConfig
from eaglekv.errors import ConfigError
from eaglekv.memory import KVPool
from eaglekv.model.config import ModelConfig


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_kv_size(cfg: EngineConfig, mc: ModelConfig, max_context_len: int,
                 extra_bytes_per_slot: int = 0, reserved_bytes: int = 0) -> int:
    """`extra_bytes_per_slot`: the draft's KV per slot (its pool shares the slot ids);
    `reserved_bytes`: memory the engine takes after sizing the pool (a CPU speculative
    engine's weights reordered for oneDNN): the fraction is of what is free without it."""
    ps = cfg.page_size
    per_slot = KVPool.bytes_per_slot(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                     cfg.torch_dtype) + extra_bytes_per_slot
    if cfg.max_total_tokens is not None:
        return -(-cfg.max_total_tokens // ps) * ps      # whole pages
    free = max(0, free_memory_bytes(torch.device(cfg.device)) - reserved_bytes)
    budget = int(free * cfg.mem_fraction)
    useful = cfg.max_running_requests * max_context_len  # more could never be used
    size = min(budget // per_slot, useful) // ps * ps
    if size < ps:
        raise ConfigError(f"mem_fraction={cfg.mem_fraction} leaves {budget} bytes for the KV pool, "
                          f"less than one page ({ps * per_slot} bytes)")
    return size
