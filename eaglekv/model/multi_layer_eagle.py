"""Multi-layer EAGLE drafts: S EAGLE-1 heads, draft step k runs head k (a chain, N == S + 1).

Checkpoint layout: the eaglekv layout of S EAGLE layers. There is no published layout for
"S separate EAGLE layers", so eaglekv defines one that stacks S EAGLE-1 heads (SafeAILab/EAGLE
`cnets1.py`, see draft_checkpoint.py) under per-layer prefixes:

- `config.json`: a LlamaConfig-style dict with `architectures: ["EagleKVMultiLayerDraft"]`,
  `num_hidden_layers: S` (the number of draft layers, >= 1), hidden_size, intermediate_size,
  num_attention_heads, num_key_value_heads, [head_dim], rms_norm_eps, rope_theta,
  rope_scaling, vocab_size, max_position_embeddings, and `bias` (whether every fc has a bias;
  absent: the state dict decides).
- `pytorch_model.bin` or `*.safetensors` (sharded or not; a `model.` prefix is stripped), for
  every layer k in [0, S):
  `layers.{k}.fc.weight (H, 2H)`, `layers.{k}.fc.bias (H,)` when bias,
  `layers.{k}.self_attn.{q,k,v,o}_proj.weight`, `layers.{k}.mlp.{gate,up,down}_proj.weight`,
  `layers.{k}.post_attention_layernorm.weight` and no input_layernorm (like EAGLE layer 0),
  plus an optional `embed_tokens.weight (V, H)` (checked for shape, then unused). No final
  norm, no lm_head: every head shares the target's embedding and LM head.

Head k, for a token at position p with paired feature f (T, H):

    x = fc_k(cat([embed(token), f]))            # (T, 2H) -> (T, H); embedding first
    g = x + attn_k(x); g += mlp_k(post_norm_k(g))  # one decoder layer, no input norm
    logits = g @ lm_head                        # the target's head, no final norm

Each head has its own one-layer KV pool (`KVPool(size, ps, *kv_shape())`, layer id 0 inside
it); all pools share the target's ReqToTokenPool and allocator, so one slot id addresses every
head's K/V of the same token.

Refused with their own messages: DeepSeek-style MTP checkpoints (`num_nextn_predict_layers`,
`eh_proj`/`enorm`/`hnorm`/`shared_head` tensors: a different module, not supported), EAGLE-1/2
heads (one unprefixed `fc`: use algorithm='eagle') and EAGLE-3 heads (use algorithm='eagle3').
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from eaglekv.errors import ModelLoadError
from eaglekv.model.config import ModelConfig
from eaglekv.model.llama import LlamaForCausalLM, ModelOutput
from eaglekv.model.draft_checkpoint import (LAYER, EagleDraftConfig, eagle3_refusal,
                                            random_eagle_draft)
from eaglekv.model.draft_checkpoint import expected_tensors as eagle_expected_tensors
from eaglekv.model.draft_io import (check_against_target, check_tensors, llama_fields,
                                    read_draft_dir, save_draft_dir)
from eaglekv.model.eagle import EagleDraftModel

ARCHITECTURE = "EagleKVMultiLayerDraft"
WHAT = "multi-layer draft"
MTP_PARTS = ("eh_proj", "enorm", "hnorm", "shared_head")   # DeepSeek MTP module names
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class MultiLayerDraftConfig:
    num_layers: int          # S draft layers; step k uses layer k
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    fc_bias: bool            # layers.{k}.fc.bias present (all layers alike)
    has_embed: bool          # the checkpoint carries its own embed_tokens.weight (unused)
    hf_dict: dict = field(repr=False)                          # config.json as read
    rope: Any = field(default=None, repr=False, compare=False)  # LlamaConfig for RotaryEmbedding

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(1, kv_heads, head_dim): the shape of EACH layer's own KV pool."""
        return 1, self.num_kv_heads, self.head_dim

    def head_config(self) -> EagleDraftConfig:
        """The EAGLE-1 config of one layer (all S layers have the same shapes)."""
        return EagleDraftConfig(
            hidden_size=self.hidden_size, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size, max_position_embeddings=self.max_position_embeddings,
            fc_bias=self.fc_bias, attention_bias=False, has_input_norm=False, has_embed=False,
            hf_dict={**self.hf_dict, "num_hidden_layers": 1}, rope=self.rope)

    @classmethod
    def from_dict(cls, d: dict, sd: dict[str, torch.Tensor]) -> "MultiLayerDraftConfig":
        """config.json plus the (normalised) tensor names; refuses the other draft kinds."""
        refuse_other_kinds(d, sd)
        arch = d.get("architectures")
        if arch != [ARCHITECTURE]:
            raise ModelLoadError(f"config.json has architectures={arch}; a multi-layer EAGLE "
                                 f"draft says [{ARCHITECTURE!r}] (is this the target model?)")
        S = d.get("num_hidden_layers")
        if not isinstance(S, int) or isinstance(S, bool) or S < 1:
            raise ModelLoadError(f"config.json has num_hidden_layers={S!r}; a multi-layer draft "
                                 f"needs an int >= 1 (its number of draft layers)")
        present = sorted({int(m.group(1)) for n in sd if (m := _LAYER_RE.match(n))})
        if sd and present != list(range(S)):
            raise ModelLoadError(f"config.json has num_hidden_layers={S} but the checkpoint "
                                 f"holds layers {present} ({len(present)} layers); they must "
                                 f"be exactly 0 .. {S - 1}")
        if d.get("qkv_bias") or d.get("attention_bias"):
            raise ModelLoadError("qkv_bias/attention_bias=true is unsupported in the multi-layer "
                                 "draft layout (its q/k/v projections have no bias)")
        fc_bias = d.get("bias")  # None: the state dict decides (layer 0 is representative)
        return cls(
            num_layers=S, **llama_fields(d, WHAT),
            fc_bias=bool("layers.0.fc.bias" in sd if fc_bias is None else fc_bias),
            has_embed="embed_tokens.weight" in sd)


# ---- checks --------------------------------------------------------------------------------------
def refuse_other_kinds(d: dict, sd: dict[str, torch.Tensor]) -> None:
    """DeepSeek MTP, EAGLE-3 and EAGLE-1/2 checkpoints each get their own message."""
    mtp = [n for n in sd if any(part in MTP_PARTS for part in n.split("."))]
    if "num_nextn_predict_layers" in d or mtp:
        why = (f"config has num_nextn_predict_layers={d['num_nextn_predict_layers']}"
               if "num_nextn_predict_layers" in d else f"tensor {mtp[0]}")
        raise ModelLoadError(f"this is a DeepSeek-style MTP checkpoint ({why}); eaglekv does "
                             f"not support it: algorithm='multi_layer_eagle' reads the eaglekv "
                             f"layout of S EAGLE layers (layers.{{k}}.fc + one decoder layer each)")
    eagle3_refusal(d, sd)
    if "fc.weight" in sd and not any(_LAYER_RE.match(n) and n.endswith(".fc.weight") for n in sd):
        raise ModelLoadError("this is an EAGLE-1/2 draft; use algorithm='eagle' (tensor "
                             "fc.weight with no per-layer layers.{k}.fc.weight)")


def expected_tensors(cfg: MultiLayerDraftConfig) -> dict[str, tuple[int, ...]]:
    """Normalised tensor names and shapes: layer k holds the EAGLE-1 head's tensors (no input
    norm, no embedding) renamed fc.* -> layers.{k}.fc.*, layers.0.X -> layers.{k}.X."""
    head = eagle_expected_tensors(cfg.head_config())
    shapes = {layer_name(name, k): shape for k in range(cfg.num_layers)
              for name, shape in head.items()}
    if cfg.has_embed:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def layer_name(head_name: str, k: int) -> str:
    """EAGLE-1 name -> layer k's name: fc.weight -> layers.{k}.fc.weight,
    layers.0.mlp.up_proj.weight -> layers.{k}.mlp.up_proj.weight."""
    rest = head_name[len(LAYER):] if head_name.startswith(LAYER) else head_name
    return f"layers.{k}.{rest}"


def check_multi_layer_state_dict(cfg: MultiLayerDraftConfig, sd: dict[str, torch.Tensor]) -> None:
    check_tensors(expected_tensors(cfg), sd, WHAT, "each layer is fc + one decoder layer "
                  "without input norm; the target's LM head is shared")


def head_state_dict(sd: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """Layer k's tensors in EAGLE-1 names (the inverse of `layer_name`)."""
    p, out = f"layers.{k}.", {}
    for name, w in sd.items():
        if name.startswith(p):
            rest = name[len(p):]
            out[rest if rest.startswith("fc.") else LAYER + rest] = w
    return out


# ---- files ---------------------------------------------------------------------------------------
def load_multi_layer_draft(path: str | os.PathLike, target: ModelConfig
                           ) -> tuple[MultiLayerDraftConfig, dict[str, torch.Tensor]]:
    """Read a multi-layer draft directory; the state dict comes back with normalised names."""
    d, sd = read_draft_dir(path, WHAT)
    cfg = MultiLayerDraftConfig.from_dict(d, sd)
    check_against_target(cfg, target)
    check_multi_layer_state_dict(cfg, sd)
    return cfg, sd


save_multi_layer_draft = save_draft_dir   # the files are laid out as for EAGLE-1/2


def random_multi_layer_draft(target: ModelConfig, num_layers: int, seed: int = 0, *,
                             std: float = 0.02, fc_bias: bool = True, with_embed: bool = False,
                             embed: torch.Tensor | None = None, num_heads: int | None = None,
                             num_kv_heads: int | None = None,
                             intermediate_size: int | None = None
                             ) -> tuple[dict, dict[str, torch.Tensor]]:
    """S random EAGLE-1 heads for `target` (`random_eagle_draft`, one seed per layer) in the
    eaglekv layout: (config dict, state dict). `with_embed` stores `embed` (None: random)."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r} must be an int >= 1")
    seeds = torch.randint(2 ** 31, (num_layers,), generator=torch.Generator().manual_seed(seed))
    kw = dict(std=std, fc_bias=fc_bias, num_heads=num_heads, num_kv_heads=num_kv_heads,
              intermediate_size=intermediate_size)
    sd: dict[str, torch.Tensor] = {}
    for k in range(num_layers):
        cfg, head = random_eagle_draft(target, int(seeds[k]), with_embed=with_embed and k == 0,
                                       embed=embed, **kw)
        for name, w in head.items():
            if name == "embed_tokens.weight":
                sd[name] = w
            else:
                sd[layer_name(name, k)] = w
    cfg = {**cfg, "architectures": [ARCHITECTURE], "num_hidden_layers": num_layers}
    cfg.pop("qkv_bias", None)
    return cfg, sd


# ---- the model -----------------------------------------------------------------------------------
class MultiLayerDraftModel:
    """S EAGLE-1 heads (`EagleDraftModel` each) sharing the target's embedding and LM head."""

    def __init__(self, cfg: MultiLayerDraftConfig, sd: dict[str, torch.Tensor],
                 target: LlamaForCausalLM, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        # 1. config and tensors, checked against the target and the layout
        check_against_target(cfg, target.cfg)
        check_multi_layer_state_dict(cfg, sd)
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        # 2. one EAGLE-1 head per layer; RoPE table and LM head are shared, not copied S times
        head_cfg = cfg.head_config()
        self.heads: list[EagleDraftModel] = []
        for k in range(cfg.num_layers):
            head = EagleDraftModel(head_cfg, head_state_dict(sd, k), target, dtype, device)
            if self.heads:
                head.rope, head.lm_head_t = self.heads[0].rope, self.heads[0].lm_head_t
            self.heads.append(head)
        # 3. compute_logits=False asks the head for zero logits rows
        self._no_rows = torch.empty(0, dtype=torch.int64, device=device)

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def kv_shape(self) -> tuple[int, int, int]:
        """(1, kv_heads, head_dim): build S pools `KVPool(size, ps, *draft.kv_shape(), ...)`,
        one per layer."""
        return self.cfg.kv_shape

    def forward(self, layer: int, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor, backend, meta, logits_indices: torch.Tensor | None = None,
                compute_logits: bool = True) -> ModelOutput:
        """Run head `layer` only over `backend`, an attention backend over that layer's own
        one-layer pool (layer id 0 inside it); `meta` is `backend.init_forward_metadata(batch)`.

        input_ids, positions: (T,) int64; hidden: (T, H) the feature paired with each token.
        Returns logits (n, V) at `logits_indices` (all T when None; None when
        compute_logits=False) and hidden (T, H), the head's output feature g (no norm).
        """
        if not 0 <= layer < self.cfg.num_layers:
            raise IndexError(f"draft layer={layer} out of range [0, {self.cfg.num_layers})")
        idx = logits_indices if compute_logits else self._no_rows
        out = self.heads[layer].forward(input_ids, positions, hidden, backend, meta, idx)
        return out if compute_logits else ModelOutput(logits=None, hidden=out.hidden)
