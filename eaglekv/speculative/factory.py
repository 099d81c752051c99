"""Builds the speculative pieces the engine needs from its SpecConfig.

algorithm   draft checkpoint (or "random")                    drafter / worker
eagle       EAGLE-1/2 head (fc + one layer)                   EagleDrafter / EagleWorker
eagle3      EAGLE-3 head (fc 3H->H, midlayer, d2t, draft vocab) Eagle3Drafter / EagleWorker
multi_layer_eagle  eaglekv layout of S EAGLE layers            MultiLayerEagleDraftWorker /
                                                              MultiLayerEagleWorker
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eaglekv.config import SpecConfig
from eaglekv.errors import ConfigError
from eaglekv.memory import KVPool
from eaglekv.model.config import ModelConfig


@dataclass
class DraftCheckpoint:
    algorithm: str
    config: object
    state_dict: dict
    num_pools: int = 1            # one-layer KV pools the draft keeps (S for multi-layer)


DEFAULT_DRAFTS = {"eagle": Path(__file__).resolve().parent.parent / "drafts"
                  / "smollm2-135m-instruct-eagle"}


def draft_path(spec: SpecConfig) -> str:
    """`draft_model="default"`: the head shipped for the default model (SmolLM2-135M-Instruct,
    trained here by self-distillation, see eaglekv/training/train_draft.py)."""
    if spec.draft_model != "default":
        return spec.draft_model
    if spec.algorithm not in DEFAULT_DRAFTS:
        raise ConfigError(f"draft_model='default' exists only for algorithm "
                          f"{sorted(DEFAULT_DRAFTS)}, not {spec.algorithm!r}; pass a checkpoint")
    return str(DEFAULT_DRAFTS[spec.algorithm])


def load_draft(spec: SpecConfig, target: ModelConfig, seed: int) -> DraftCheckpoint:
    """The configured draft's config and weights, checked against the target (and against
    the algorithm: a checkpoint of another draft family is refused with what it is)."""
    random = spec.draft_model == "random"
    if spec.algorithm == "eagle":
        from eaglekv.model.draft_checkpoint import EagleDraftConfig, load_eagle_draft, random_eagle_draft
        if random:
            d, sd = random_eagle_draft(target, seed=seed)
            return DraftCheckpoint("eagle", EagleDraftConfig.from_dict(d, sd), sd)
        return DraftCheckpoint("eagle", *load_eagle_draft(draft_path(spec), target))
    if spec.algorithm == "eagle3":
        from eaglekv.model.eagle3_checkpoint import (Eagle3DraftConfig, load_eagle3_draft,
                                                random_eagle3_draft)
        if random:
            d, sd = random_eagle3_draft(target, draft_vocab_size=max(2, target.vocab_size // 2),
                                        seed=seed)
            return DraftCheckpoint("eagle3", Eagle3DraftConfig.from_dict(d, sd), sd)
        return DraftCheckpoint("eagle3", *load_eagle3_draft(spec.draft_model, target))
    from eaglekv.model.multi_layer_eagle import (MultiLayerDraftConfig, load_multi_layer_draft,
                                                random_multi_layer_draft)
    if random:
        d, sd = random_multi_layer_draft(target, num_layers=spec.num_steps, seed=seed)
        cfg = MultiLayerDraftConfig.from_dict(d, sd)
    else:
        cfg, sd = load_multi_layer_draft(spec.draft_model, target)
    return DraftCheckpoint("multi_layer_eagle", cfg, sd, num_pools=cfg.num_layers)


def draft_bytes_per_slot(ckpt: DraftCheckpoint | None, dtype: torch.dtype) -> int:
    if ckpt is None:
        return 0
    return ckpt.num_pools * KVPool.bytes_per_slot(*ckpt.config.kv_shape, dtype)


def extra_columns(spec: SpecConfig, page_size: int) -> int:
    """req_to_token columns past max_context_len for the draft regions and the verify window."""
    from eaglekv.kernels.draft_kv_indices import draft_region_extra
    return max(draft_region_extra(spec.topk, spec.num_steps, page_size),
               spec.num_draft_tokens) + page_size + spec.num_steps


def build_worker(engine, spec: SpecConfig, ckpt: DraftCheckpoint | None, drafter=None):
    from eaglekv.speculative.eagle_worker import EagleWorker
    from eaglekv.speculative.multi_layer_eagle_worker import MultiLayerEagleWorker
    worker_cls = MultiLayerEagleWorker if spec.algorithm == "multi_layer_eagle" else EagleWorker
    if drafter is None:
        drafter = _build_drafter(engine, spec, ckpt)
    return worker_cls(engine, drafter, spec)


def _build_drafter(engine, spec, ckpt: DraftCheckpoint):
    from eaglekv.speculative.drafter import Eagle3Drafter, EagleDrafter
    from eaglekv.speculative.multi_layer_eagle_worker import MultiLayerEagleDraftWorker
    cfg = engine.config
    args = (engine.allocator.size, cfg.page_size, engine.req_to_token, cfg.torch_dtype,
            engine.device)
    if ckpt.algorithm == "eagle":
        from eaglekv.model.eagle import EagleDraftModel
        model = EagleDraftModel(ckpt.config, ckpt.state_dict, engine.model, cfg.torch_dtype,
                                engine.device)
        return EagleDrafter(model, *args)
    if ckpt.algorithm == "eagle3":
        from eaglekv.model.eagle3 import Eagle3DraftModel
        model = Eagle3DraftModel(ckpt.config, ckpt.state_dict, engine.model, cfg.torch_dtype,
                                 engine.device)
        return Eagle3Drafter(model, *args, num_target_layers=engine.model_config.num_layers)
    from eaglekv.model.multi_layer_eagle import MultiLayerDraftModel
    model = MultiLayerDraftModel(ckpt.config, ckpt.state_dict, engine.model, cfg.torch_dtype,
                                 engine.device)
    return MultiLayerEagleDraftWorker(model, spec, *args)
