"""Builds the speculative pieces the engine needs from its SpecConfig."""

from __future__ import annotations

import torch

from eaglekv.config import SpecConfig
from eaglekv.errors import ConfigError
from eaglekv.memory import KVPool
from eaglekv.model.config import ModelConfig


def load_draft(spec: SpecConfig, target: ModelConfig, seed: int):
    """(draft config, state dict) of the configured draft, checked against the target."""
    from eaglekv.spec.draft_loader import EagleDraftConfig, load_eagle_draft, random_eagle_draft
    if spec.algorithm != "eagle":
        raise ConfigError(f"speculative algorithm={spec.algorithm!r} is not served yet; "
                          f"use 'eagle'")
    if spec.draft_model == "random":
        cfg_dict, sd = random_eagle_draft(target, seed=seed)
        return EagleDraftConfig.from_dict(cfg_dict, sd), sd
    return load_eagle_draft(spec.draft_model, target)


def draft_bytes_per_slot(draft_cfg, dtype: torch.dtype) -> int:
    return 0 if draft_cfg is None else KVPool.bytes_per_slot(*draft_cfg.kv_shape, dtype)


def extra_columns(spec: SpecConfig, page_size: int) -> int:
    """req_to_token columns past max_context_len for the draft regions and the verify window."""
    S, K, N, ps = spec.num_steps, spec.topk, spec.num_draft_tokens, page_size
    if ps == 1 or K == 1:
        draft = K * S
    else:  # branch regions of ceil((last + S) / ps) pages each, starting in the prefix's page
        draft = ps + K * (-(-(ps - 1 + S) // ps)) * ps
    return max(draft, N) + S


def build_worker(engine, spec: SpecConfig, draft_ckpt, drafter=None):
    from eaglekv.spec.drafter import EagleDrafter
    from eaglekv.spec.eagle_draft import EagleDraftModel
    from eaglekv.spec.eagle_worker import EagleWorker
    if drafter is None:
        cfg, sd = draft_ckpt
        model = EagleDraftModel(cfg, sd, engine.model, engine.config.torch_dtype, engine.device)
        drafter = EagleDrafter(model, engine.allocator.size, engine.config.page_size,
                               engine.req_to_token, engine.config.torch_dtype, engine.device)
    return EagleWorker(engine, drafter, spec)
