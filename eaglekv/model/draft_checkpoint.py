"""Read, check, write and make EAGLE-1/2 draft heads in the published checkpoint layout.

Published layout (yuhuili/EAGLE-Vicuna-7B-v1.3, EAGLE-LLaMA3-Instruct-8B, ...; the module is
SafeAILab/EAGLE `eagle/model/cnets1.py: Model`, SGLang loads it as `LlamaForCausalLMEagle`):

- `config.json`: a LlamaConfig with `num_hidden_layers: 1` (hidden_size, intermediate_size,
  num_attention_heads, num_key_value_heads, rms_norm_eps, rope_theta, rope_scaling, vocab_size,
  max_position_embeddings); optional `"bias"` = whether `fc` has a bias (the reference reads it,
  default true; EAGLE-LLaMA3 sets false), optional `"qkv_bias"` (Qwen2 drafts).
- `pytorch_model.bin` (or `model.safetensors`), names without a `model.` prefix:
  `fc.weight (H, 2H)`, `fc.bias (H,)` when the fc has a bias, `embed_tokens.weight (V, H)` (a
  frozen copy of the target's embedding), and layer 0 of a Llama decoder:
  `layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
  `layers.0.post_attention_layernorm.weight`, and *no* `layers.0.input_layernorm.weight`
  (cnets1 builds that norm only for layers with index != 0). No final norm, no lm_head.

An EAGLE-3 head (`midlayer.*`, `d2t`/`t2d`, a `draft_vocab_size`) is refused with its own
message: run as EAGLE-1 it would silently accept nothing (SGLang PR #21272).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from eaglekv.errors import ModelLoadError
from eaglekv.model.config import ModelConfig
from eaglekv.model.draft_io import (check_against_target, check_tensors, decoder_layer_config,
                                    llama_fields, random_llama_dict, random_tensors,
                                    read_draft_dir, save_draft_dir)

LAYER = "layers.0."
WHAT = "EAGLE draft"


@dataclass(frozen=True)
class EagleDraftConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    fc_bias: bool            # fc.bias present
    attention_bias: bool     # q/k/v biases present (config "qkv_bias", Qwen2 drafts)
    has_input_norm: bool     # layers.0.input_layernorm.weight present (published heads: no)
    has_embed: bool          # the checkpoint carries its own embed_tokens.weight
    hf_dict: dict = field(repr=False)                          # config.json as read
    rope: Any = field(default=None, repr=False, compare=False)  # LlamaConfig for RotaryEmbedding

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, kv_heads, head_dim) of the draft's own KV pool."""
        return 1, self.num_kv_heads, self.head_dim

    def layer_config(self) -> ModelConfig:
        """The ModelConfig of the one decoder layer (what `DecoderLayer` reads)."""
        return decoder_layer_config(self)

    @classmethod
    def from_dict(cls, d: dict, sd: dict[str, torch.Tensor]) -> "EagleDraftConfig":
        """config.json plus the (normalised) tensor names, which say what is present."""
        eagle3_refusal(d, sd)
        n_layers = d.get("num_hidden_layers", 1)
        if "EagleKVMultiLayerDraft" in (d.get("architectures") or []):
            raise ModelLoadError(f"this is a multi-layer EAGLE draft ({n_layers} layers); use "
                                 f"algorithm='multi_layer_eagle'")
        if n_layers != 1:
            raise ModelLoadError(f"config.json has num_hidden_layers={n_layers}; an EAGLE-1/2 "
                                 f"draft head has exactly 1 decoder layer (is this the target "
                                 f"model?)")
        # fc bias: the config decides when it says so ("bias": reference, "eagle_fc_bias": vLLM);
        # otherwise the state dict does (the reference's default True would leave a missing
        # bias randomly initialised under its strict=False load)
        fc_bias = d.get("bias", d.get("eagle_fc_bias"))
        return cls(
            **llama_fields(d, WHAT),
            fc_bias=bool("fc.bias" in sd if fc_bias is None else fc_bias),
            attention_bias=bool(d.get("qkv_bias", d.get("attention_bias", False))),
            has_input_norm=LAYER + "input_layernorm.weight" in sd,
            has_embed="embed_tokens.weight" in sd)


# ---- checks --------------------------------------------------------------------------------------
def eagle3_refusal(d: dict, sd: dict[str, torch.Tensor]) -> None:
    why = []
    if "draft_vocab_size" in d:
        why.append(f"config has draft_vocab_size={d['draft_vocab_size']}")
    if any("eagle3" in str(a).lower() for a in d.get("architectures") or []):
        why.append(f"architectures={d['architectures']}")
    why += [f"tensor {n}" for n in sd if n.startswith("midlayer.") or n in ("d2t", "t2d")][:2]
    if why:
        raise ModelLoadError(f"this is an EAGLE-3 draft; use algorithm='eagle3' ({', '.join(why)})")


def expected_tensors(cfg: EagleDraftConfig) -> dict[str, tuple[int, ...]]:
    """Normalised tensor names and shapes this config needs (the published layout)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    p = LAYER
    shapes = {"fc.weight": (H, 2 * H),
              p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
              p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
              p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
              p + "mlp.down_proj.weight": (H, I), p + "post_attention_layernorm.weight": (H,)}
    if cfg.fc_bias:
        shapes["fc.bias"] = (H,)
    if cfg.attention_bias:
        shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)})
    if cfg.has_input_norm:
        shapes[p + "input_layernorm.weight"] = (H,)
    if cfg.has_embed:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, H)
    return shapes


def check_eagle_state_dict(cfg: EagleDraftConfig, sd: dict[str, torch.Tensor]) -> None:
    check_tensors(expected_tensors(cfg), sd, WHAT, "an EAGLE-1/2 head is fc + one decoder "
                  "layer; it shares the target's LM head")


# ---- files ---------------------------------------------------------------------------------------
def load_eagle_draft(path: str | os.PathLike, target: ModelConfig
                     ) -> tuple[EagleDraftConfig, dict[str, torch.Tensor]]:
    """Read an EAGLE-1/2 head directory; the state dict comes back with normalised names."""
    d, sd = read_draft_dir(path, WHAT)
    cfg = EagleDraftConfig.from_dict(d, sd)
    check_against_target(cfg, target)
    check_eagle_state_dict(cfg, sd)
    return cfg, sd


save_eagle_draft = save_draft_dir   # config.json + pytorch_model.bin or model.safetensors


def random_eagle_draft(target: ModelConfig, seed: int = 0, *, std: float = 0.02,
                       fc_bias: bool = True, input_norm: bool = False, with_embed: bool = True,
                       embed: torch.Tensor | None = None, num_heads: int | None = None,
                       num_kv_heads: int | None = None, intermediate_size: int | None = None,
                       qkv_bias: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """A random EAGLE-1/2 head for `target` in the published layout: (config dict, state dict).

    Matrices and biases ~ N(0, std), norm weights ~ U(0.8, 1.2). `embed` (the target's
    embedding) is stored as embed_tokens.weight like the published heads; None stores a random
    one. RoPE settings are copied from the target.
    """
    cfg = {**random_llama_dict(target, "LlamaForCausalLM", num_heads=num_heads,
                               num_kv_heads=num_kv_heads, intermediate_size=intermediate_size),
           "bias": fc_bias, "qkv_bias": qkv_bias}
    want = expected_tensors(EagleDraftConfig.from_dict(cfg, {}))
    if input_norm:
        want[LAYER + "input_layernorm.weight"] = (target.hidden_size,)
    if with_embed:
        want["embed_tokens.weight"] = (target.vocab_size, target.hidden_size)
    sd = random_tensors(want, torch.Generator().manual_seed(seed), std)
    if with_embed and embed is not None:
        sd["embed_tokens.weight"] = embed.detach().float().clone()
    return cfg, sd
