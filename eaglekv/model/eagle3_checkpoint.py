"""Read, check, write and make EAGLE-3 draft heads in the published checkpoint layout.

Published layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B and the SpecForge-trained heads; the module
is SafeAILab/EAGLE `eagle/model/cnets.py: Model`, SGLang loads it as `LlamaForCausalLMEagle3`
from `models/llama_eagle3.py`, vLLM as `Eagle3LlamaForCausalLM`):

- `config.json`: a LlamaConfig with `architectures: ["LlamaForCausalLMEagle3"]`,
  `num_hidden_layers: 1`, `vocab_size` (the *target's* vocabulary, length of `t2d`) and
  `draft_vocab_size` (rows of `lm_head`, e.g. 32000 of 128256). Optional: `"bias"` (fc bias;
  SGLang `getattr(config, "bias", False)`, cnets always False), `attention_bias`,
  `norm_before_residual` (vLLM/speculators; residual taken after hidden_norm),
  `target_hidden_size` (SGLang/vLLM: fc input is 3 * target_hidden_size), and the layers whose
  outputs feed the head: `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang/SpecForge:
  layer *output* ids; SGLang adds 1 to get the layer whose input it captures) or a top-level
  `eagle_aux_hidden_state_layer_ids` (vLLM: ids of the layers whose *input* it captures).
  RoPE comes from the draft's own config (the 8B head has no rope_theta: 10000).
- weights, names without a `model.` prefix: `fc.weight (H, 3H)`, `midlayer.input_layernorm.weight`
  (norm of the token embedding), `midlayer.hidden_norm.weight` (norm of the hidden),
  `midlayer.self_attn.{q,k,v}_proj.weight (*, 2H)`, `midlayer.self_attn.o_proj.weight`,
  `midlayer.post_attention_layernorm.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
  `norm.weight (H,)`, `lm_head.weight (Vd, H)`, `d2t (Vd,) int64` with
  `target_id = draft_id + d2t[draft_id]`, `t2d (V,) bool` marking the target ids the draft
  vocabulary covers; optionally `embed_tokens.weight (V, H)` (SpecForge saves its frozen copy of
  the target's embedding; the 8B head has none).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from eaglekv.errors import ModelLoadError
from eaglekv.model.config import ModelConfig
from eaglekv.model.draft_io import (check_against_target, check_tensors, llama_fields,
                                    random_llama_dict, random_tensors, read_draft_dir,
                                    save_draft_dir)

MID = "midlayer."
WHAT = "EAGLE-3 draft"


@dataclass(frozen=True)
class Eagle3DraftConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int          # the target's vocabulary (length of t2d)
    draft_vocab_size: int    # rows of lm_head (length of d2t)
    max_position_embeddings: int
    fc_bias: bool            # fc.bias present
    attention_bias: bool     # q/k/v biases present
    norm_before_residual: bool  # residual = hidden_norm(h) instead of h (vLLM option)
    has_embed: bool          # the checkpoint carries its own embed_tokens.weight
    aux_layer_ids: tuple[int, ...] | None  # target layer *outputs* to capture; None: default
    hf_dict: dict = field(repr=False)                          # config.json as read
    rope: Any = field(default=None, repr=False, compare=False)  # LlamaConfig for RotaryEmbedding

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, kv_heads, head_dim) of the draft's own KV pool."""
        return 1, self.num_kv_heads, self.head_dim

    @classmethod
    def from_dict(cls, d: dict, sd: dict[str, torch.Tensor]) -> "Eagle3DraftConfig":
        """config.json plus the (normalised) tensor names, which say what is present."""
        eagle12_refusal(d, sd)
        if "speculators_config" in d or "transformer_layer_config" in d:
            raise ModelLoadError("this EAGLE-3 head is in vLLM speculators format "
                                 "(transformer_layer_config/speculators_config); eaglekv reads "
                                 "the original layout (midlayer.*, flat LlamaConfig)")
        n_layers = d.get("num_hidden_layers", 1)
        if n_layers != 1:
            raise ModelLoadError(f"config.json has num_hidden_layers={n_layers}; eaglekv runs "
                                 f"EAGLE-3 heads with exactly 1 decoder layer (midlayer)")
        fields = llama_fields(d, WHAT)
        if d.get("draft_vocab_size") is None:
            rows = sd["lm_head.weight"].shape[0] if "lm_head.weight" in sd else "?"
            raise ModelLoadError(f"EAGLE-3 draft config.json lacks 'draft_vocab_size' (lm_head "
                                 f"has {rows} rows); add \"draft_vocab_size\": {rows}")
        if (eagle := d.get("eagle_config")) and eagle.get("use_aux_hidden_state") is False:
            raise ModelLoadError("eagle_config.use_aux_hidden_state=false (no fc over 3 target "
                                 "layers) is unsupported")
        H = fields["hidden_size"]
        if d.get("target_hidden_size", H) != H:
            raise ModelLoadError(f"draft target_hidden_size={d['target_hidden_size']} differs "
                                 f"from its hidden_size={H}: heads narrower than their target "
                                 f"are unsupported")
        fc_bias = d.get("bias")
        return cls(
            **fields, draft_vocab_size=d["draft_vocab_size"],
            fc_bias=bool("fc.bias" in sd if fc_bias is None else fc_bias),
            attention_bias=bool(d.get("attention_bias", d.get("qkv_bias", False))),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            has_embed="embed_tokens.weight" in sd, aux_layer_ids=configured_aux_layers(d))


def configured_aux_layers(d: dict) -> tuple[int, ...] | None:
    """Target layer output ids named by the config, in eaglekv's convention (the ids
    `LlamaForCausalLM.forward(capture_layers=...)` takes), or None.

    SGLang/SpecForge `eagle_config.eagle_aux_hidden_state_layer_ids` are output ids already;
    vLLM's top-level `eagle_aux_hidden_state_layer_ids` name the layer whose input is captured,
    so output id = vLLM id - 1.
    """
    nested = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = d.get("eagle_aux_hidden_state_layer_ids")
    from_top = None if top is None else tuple(int(i) - 1 for i in top)
    from_nested = None if nested is None else tuple(int(i) for i in nested)
    if from_top is not None and from_nested is not None and from_top != from_nested:
        raise ModelLoadError(f"config names two different aux layer sets: "
                             f"eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} "
                             f"(layer outputs) and eagle_aux_hidden_state_layer_ids={list(top)} "
                             f"(layer inputs, vLLM)")
    return from_nested if from_nested is not None else from_top


# ---- checks --------------------------------------------------------------------------------------
def eagle12_refusal(d: dict, sd: dict[str, torch.Tensor]) -> None:
    """An EAGLE-1/2 head (layers.0.*, no midlayer.*, no vocabulary map) run as EAGLE-3."""
    has_mid = any(n.startswith(MID) for n in sd)
    has_layer0 = any(n.startswith("layers.0.") for n in sd)
    if not has_mid and has_layer0 and "d2t" not in sd and "draft_vocab_size" not in d:
        fc = sd.get("fc.weight")
        why = f", fc.weight {tuple(fc.shape)}" if fc is not None else ""
        raise ModelLoadError(f"this is an EAGLE-1/2 draft; use algorithm='eagle' (tensors "
                             f"layers.0.*, no midlayer.*, no d2t/draft_vocab_size{why})")


def expected_tensors(cfg: Eagle3DraftConfig) -> dict[str, tuple[int, ...]]:
    """Normalised tensor names and shapes this config needs (the published layout)."""
    H, I, V, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.draft_vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    p = MID
    shapes = {"fc.weight": (H, 3 * H),
              p + "input_layernorm.weight": (H,), p + "hidden_norm.weight": (H,),
              p + "self_attn.q_proj.weight": (q, 2 * H), p + "self_attn.k_proj.weight": (kv, 2 * H),
              p + "self_attn.v_proj.weight": (kv, 2 * H), p + "self_attn.o_proj.weight": (H, q),
              p + "post_attention_layernorm.weight": (H,),
              p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
              p + "mlp.down_proj.weight": (H, I),
              "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,)}
    if cfg.fc_bias:
        shapes["fc.bias"] = (H,)
    if cfg.attention_bias:
        shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)})
    if cfg.has_embed:
        shapes["embed_tokens.weight"] = (V, H)
    return shapes


def check_eagle3_state_dict(cfg: Eagle3DraftConfig, sd: dict[str, torch.Tensor]) -> None:
    if "lm_head.weight" in sd and sd["lm_head.weight"].shape[0] != cfg.draft_vocab_size:
        raise ModelLoadError(f"EAGLE-3 draft: draft_vocab_size={cfg.draft_vocab_size} but "
                             f"lm_head.weight has {sd['lm_head.weight'].shape[0]} rows")
    check_tensors(expected_tensors(cfg), sd, WHAT, "an EAGLE-3 head is fc + midlayer + norm + "
                  "lm_head + d2t/t2d")
    check_vocab_map(cfg, sd["d2t"], sd["t2d"])


def check_vocab_map(cfg: Eagle3DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """target_id = draft_id + d2t[draft_id] must be Vd distinct ids in [0, V), exactly the ones
    t2d marks. Reads the tensors on the host: load time only."""
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ModelLoadError(f"EAGLE-3 draft: d2t has dtype {d2t.dtype}; expected int64 offsets")
    ids = torch.arange(Vd, dtype=torch.int64) + d2t.cpu().to(torch.int64)      # (Vd,) target ids
    bad = ((ids < 0) | (ids >= V)).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        raise ModelLoadError(f"EAGLE-3 draft: d2t maps draft id {i} to target id {int(ids[i])}, "
                             f"outside [0, {V}) ({len(bad)} of {Vd} draft ids out of range)")
    uniq = torch.unique(ids)
    if len(uniq) != Vd:
        counts = torch.bincount(ids, minlength=V)
        dup = int((counts > 1).nonzero()[0])
        raise ModelLoadError(f"EAGLE-3 draft: d2t maps {int(counts[dup])} draft ids to target id "
                             f"{dup} ({Vd - len(uniq)} duplicates among {Vd} draft ids)")
    mark = t2d.cpu() != 0                                                      # (V,) bool
    if int(mark.sum()) != Vd:
        raise ModelLoadError(f"EAGLE-3 draft: t2d marks {int(mark.sum())} target ids, "
                             f"draft_vocab_size is {Vd}")
    missing = (~mark[ids]).nonzero().flatten()
    if len(missing):
        i = int(missing[0])
        raise ModelLoadError(f"EAGLE-3 draft: t2d disagrees with d2t: draft id {i} maps to target "
                             f"id {int(ids[i])}, which t2d does not mark ({len(missing)} such)")


# ---- files ---------------------------------------------------------------------------------------
def load_eagle3_draft(path: str | os.PathLike, target: ModelConfig
                      ) -> tuple[Eagle3DraftConfig, dict[str, torch.Tensor]]:
    """Read an EAGLE-3 head directory; the state dict comes back with normalised names."""
    d, sd = read_draft_dir(path, WHAT)
    cfg = Eagle3DraftConfig.from_dict(d, sd)
    check_against_target(cfg, target)
    check_eagle3_state_dict(cfg, sd)
    return cfg, sd


save_eagle3_draft = save_draft_dir   # the files are laid out as for EAGLE-1/2


def random_eagle3_draft(target: ModelConfig, draft_vocab_size: int, seed: int = 0, *,
                        std: float = 0.02, fc_bias: bool = False, attention_bias: bool = False,
                        norm_before_residual: bool = False, with_embed: bool = False,
                        embed: torch.Tensor | None = None, num_heads: int | None = None,
                        num_kv_heads: int | None = None, intermediate_size: int | None = None
                        ) -> tuple[dict, dict[str, torch.Tensor]]:
    """A random EAGLE-3 head for `target` in the published layout: (config dict, state dict).

    Matrices and biases ~ N(0, std), norm weights ~ U(0.8, 1.2). The draft vocabulary is
    `draft_vocab_size` distinct random target ids, sorted (as SpecForge orders its frequent
    tokens): d2t = ids - arange(Vd), t2d marks ids. RoPE settings are copied from the target.
    `with_embed` stores embed_tokens.weight (`embed`, or random when None).
    """
    V, Vd = target.vocab_size, draft_vocab_size
    if not 0 < Vd <= V:
        raise ValueError(f"draft_vocab_size={Vd} must be in [1, {V}] (the target's vocabulary)")
    cfg = {**random_llama_dict(target, "LlamaForCausalLMEagle3", num_heads=num_heads,
                               num_kv_heads=num_kv_heads, intermediate_size=intermediate_size),
           "draft_vocab_size": Vd, "bias": fc_bias, "attention_bias": attention_bias}
    if norm_before_residual:
        cfg["norm_before_residual"] = True
    want = expected_tensors(Eagle3DraftConfig.from_dict(cfg, {"embed_tokens.weight": None}
                                                        if with_embed else {}))
    g = torch.Generator().manual_seed(seed)
    sd = random_tensors({n: shape for n, shape in want.items() if n not in ("d2t", "t2d")},
                        g, std)
    ids = torch.randperm(V, generator=g)[:Vd].sort().values                  # (Vd,) target ids
    sd["d2t"] = ids - torch.arange(Vd)                                        # (Vd,) int64
    sd["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)    # (V,) bool
    if with_embed and embed is not None:
        sd["embed_tokens.weight"] = embed.detach().float().clone()
    return cfg, sd
