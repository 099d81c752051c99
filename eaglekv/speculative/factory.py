"""The speculative families, one record each: how to load the draft checkpoint, build its
drafter, and which runner drives it.

algorithm          draft checkpoint (or "random")                  drafter / runner
eagle              EAGLE-1/2 head (fc + one layer)                  EagleDrafter / EagleWorker
eagle3             EAGLE-3 head (fc 3H->H, midlayer, d2t, vocab)   Eagle3Drafter / EagleWorker
multi_layer_eagle  eaglekv layout of S EAGLE layers                 MultiLayerEagleDraftWorker /
                                                                   MultiLayerEagleWorker
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eaglekv.config import SpecConfig
from eaglekv.errors import ConfigError
from eaglekv.memory import KVPool
from eaglekv.model.config import ModelConfig
from eaglekv.model.draft_checkpoint import EagleDraftConfig, load_eagle_draft, random_eagle_draft
from eaglekv.model.draft_io import read_draft_vocab
from eaglekv.model.eagle import EagleDraftModel
from eaglekv.model.eagle3 import Eagle3DraftModel
from eaglekv.model.eagle3_checkpoint import (Eagle3DraftConfig, load_eagle3_draft,
                                             random_eagle3_draft)
from eaglekv.model.multi_layer_eagle import (MultiLayerDraftConfig, MultiLayerDraftModel,
                                             load_multi_layer_draft, random_multi_layer_draft)
from eaglekv.runner import RunnerResources
from eaglekv.speculative.drafter import Eagle3Drafter, EagleDrafter
from eaglekv.speculative.eagle_worker import EagleWorker, spec_chain_steps
from eaglekv.speculative.multi_layer_eagle_worker import (MultiLayerEagleDraftWorker,
                                                          MultiLayerEagleWorker)


@dataclass
class DraftCheckpoint:
    algorithm: str
    config: object
    state_dict: dict
    num_pools: int = 1            # one-layer KV pools the draft keeps (S for multi-layer)
    vocab_ids: torch.Tensor | None = None   # EAGLE-1/2: the ids it may propose (None: all)


_DRAFTS = Path(__file__).resolve().parent.parent / "drafts"
DEFAULT_DRAFTS = {"eagle": _DRAFTS / "smollm2-135m-instruct-eagle",
                  "eagle3": _DRAFTS / "smollm2-135m-instruct-eagle3"}


def draft_path(spec: SpecConfig) -> str:
    """`draft_model="default"`: the head shipped for the default model (SmolLM2-135M-Instruct,
    trained here, see eaglekv/training/ and the README.md beside each head)."""
    if spec.draft_model != "default":
        return spec.draft_model
    if spec.algorithm not in DEFAULT_DRAFTS:
        raise ConfigError(f"draft_model='default' exists only for algorithm "
                          f"{sorted(DEFAULT_DRAFTS)}, not {spec.algorithm!r}; pass a checkpoint")
    return str(DEFAULT_DRAFTS[spec.algorithm])


# ---- the three families ------------------------------------------------------------------------
def _load_eagle(spec, target, seed) -> DraftCheckpoint:
    if spec.draft_model == "random":
        d, sd = random_eagle_draft(target, seed=seed)
        return DraftCheckpoint("eagle", EagleDraftConfig.from_dict(d, sd), sd)
    path = draft_path(spec)
    return DraftCheckpoint("eagle", *load_eagle_draft(path, target),
                           vocab_ids=read_draft_vocab(path, target.vocab_size))


def _load_eagle3(spec, target, seed) -> DraftCheckpoint:
    if spec.draft_model == "random":
        d, sd = random_eagle3_draft(target, draft_vocab_size=max(2, target.vocab_size // 2),
                                    seed=seed)
        return DraftCheckpoint("eagle3", Eagle3DraftConfig.from_dict(d, sd), sd)
    return DraftCheckpoint("eagle3", *load_eagle3_draft(draft_path(spec), target))


def _load_multi_layer(spec, target, seed) -> DraftCheckpoint:
    if spec.draft_model == "random":
        d, sd = random_multi_layer_draft(target, num_layers=spec.num_steps, seed=seed)
        cfg = MultiLayerDraftConfig.from_dict(d, sd)
    else:
        cfg, sd = load_multi_layer_draft(spec.draft_model, target)
    return DraftCheckpoint("multi_layer_eagle", cfg, sd, num_pools=cfg.num_layers)


def _pool_args(res: RunnerResources) -> tuple:
    return (res.allocator.size, res.page_size, res.req_to_token, res.dtype, res.device)


def _eagle_drafter(res, spec, ckpt):
    model = EagleDraftModel(ckpt.config, ckpt.state_dict, res.model, res.dtype, res.device,
                            vocab_ids=ckpt.vocab_ids)
    return EagleDrafter(model, *_pool_args(res), backend_cls=type(res.backend))


def _eagle3_drafter(res, spec, ckpt):
    model = Eagle3DraftModel(ckpt.config, ckpt.state_dict, res.model, res.dtype, res.device)
    return Eagle3Drafter(model, *_pool_args(res), num_target_layers=res.num_target_layers,
                         backend_cls=type(res.backend))


def _multi_layer_drafter(res, spec, ckpt):
    model = MultiLayerDraftModel(ckpt.config, ckpt.state_dict, res.model, res.dtype, res.device)
    return MultiLayerEagleDraftWorker(model, spec, *_pool_args(res))


@dataclass(frozen=True)
class Family:
    load: Callable          # (spec, target ModelConfig, seed) -> DraftCheckpoint
    drafter: Callable       # (RunnerResources, spec, DraftCheckpoint) -> Drafter
    runner: type            # (RunnerResources, drafter, spec, chain_steps) -> runner


FAMILIES = {"eagle": Family(_load_eagle, _eagle_drafter, EagleWorker),
            "eagle3": Family(_load_eagle3, _eagle3_drafter, EagleWorker),
            "multi_layer_eagle": Family(_load_multi_layer, _multi_layer_drafter,
                                        MultiLayerEagleWorker)}


# ---- what the engine calls ----------------------------------------------------------------------
def load_draft(spec: SpecConfig, target: ModelConfig, seed: int) -> DraftCheckpoint:
    """The configured draft's config and weights, checked against the target (and against
    the algorithm: a checkpoint of another draft family is refused with what it is)."""
    return FAMILIES[spec.algorithm].load(spec, target, seed)


def build_runner(res: RunnerResources, spec: SpecConfig, ckpt: DraftCheckpoint | None,
                 drafter=None, decode_steps: int = 1):
    """The family's runner over `res`; `drafter` overrides the checkpoint's (tests).
    `decode_steps` (EngineConfig.num_scheduler_steps): adaptive's all-plain steps decode
    chains of up to that many tokens, as the plain runner does; a fixed shape's greedy
    whole-step replays chain `spec_chain_steps` steps, about as many tokens."""
    family = FAMILIES[spec.algorithm]
    if drafter is None:
        drafter = family.drafter(res, spec, ckpt)
    if spec.adaptive:   # plain or one of the candidate shapes, chosen each step
        from eaglekv.speculative.adaptive_worker import AdaptiveWorker
        return AdaptiveWorker(res, drafter, spec, decode_steps=decode_steps)
    return family.runner(res, drafter, spec, spec_chain_steps(decode_steps, spec.num_steps))



def draft_bytes_per_slot(ckpt: DraftCheckpoint | None, dtype: torch.dtype) -> int:
    if ckpt is None:
        return 0
    return ckpt.num_pools * KVPool.bytes_per_slot(*ckpt.config.kv_shape, dtype)


def feature_bytes_per_slot(spec: SpecConfig, target: ModelConfig, dtype: torch.dtype) -> int:
    """Adaptive speculation keeps the target's feature of every plainly decoded token, by
    slot, until the draft catches up (speculative/adaptive_worker.py): H per slot, 3H for
    EAGLE-3's three captured layers."""
    if not spec.adaptive:
        return 0
    width = target.hidden_size * (3 if spec.algorithm == "eagle3" else 1)
    return width * torch.empty((), dtype=dtype).element_size()
