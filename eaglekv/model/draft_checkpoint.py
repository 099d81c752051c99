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

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eaglekv.errors import ModelLoadError
from eaglekv.model.config import ModelConfig

LAYER = "layers.0."
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
        return ModelConfig(
            model_type="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False, attention_bias=self.attention_bias, qk_norm=False,
            hf_config=self.rope)

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
        if d.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"draft hidden_act={d['hidden_act']!r} unsupported; only 'silu'")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            if key not in d:
                raise ModelLoadError(f"draft config.json lacks {key!r}")
        H, heads = d["hidden_size"], d["num_attention_heads"]
        # fc bias: the config decides when it says so ("bias": reference, "eagle_fc_bias": vLLM);
        # otherwise the state dict does (the reference's default True would leave a missing
        # bias randomly initialised under its strict=False load)
        fc_bias = d.get("bias", d.get("eagle_fc_bias"))
        from transformers import LlamaConfig
        rope_keys = {k: v for k, v in d.items() if k not in ("model_type", "architectures")}
        return cls(
            hidden_size=H, num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or H // heads, intermediate_size=d["intermediate_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), vocab_size=d["vocab_size"],
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            fc_bias=bool("fc.bias" in sd if fc_bias is None else fc_bias),
            attention_bias=bool(d.get("qkv_bias", d.get("attention_bias", False))),
            has_input_norm=LAYER + "input_layernorm.weight" in sd,
            has_embed="embed_tokens.weight" in sd, hf_dict=dict(d),
            rope=LlamaConfig(**rope_keys))


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


def check_against_target(cfg: EagleDraftConfig, target: ModelConfig) -> None:
    """The draft reads the target's hidden states and shares its embedding and LM head."""
    if cfg.hidden_size != target.hidden_size:
        raise ModelLoadError(f"draft hidden_size={cfg.hidden_size} differs from the target's "
                             f"hidden_size={target.hidden_size}: this head was trained for "
                             f"another model")
    if cfg.vocab_size != target.vocab_size:
        raise ModelLoadError(f"draft vocab_size={cfg.vocab_size} differs from the target's "
                             f"vocab_size={target.vocab_size}: this head was trained for "
                             f"another tokenizer")


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
    want = expected_tensors(cfg)
    for name, shape in want.items():
        if name not in sd:
            raise ModelLoadError(f"EAGLE draft: missing tensor {name} (expected shape {shape})")
        if tuple(sd[name].shape) != shape:
            raise ModelLoadError(f"EAGLE draft: tensor {name} has shape {tuple(sd[name].shape)}, "
                                 f"config expects {shape}")
    extra = [n for n in sd if n not in want and not n.endswith(IGNORED_SUFFIXES)]
    if extra:
        raise ModelLoadError(f"EAGLE draft: {len(extra)} unexpected tensors, e.g. {extra[:4]} "
                             f"(an EAGLE-1/2 head is fc + one decoder layer; it shares the "
                             f"target's LM head)")


def normalize_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model.fc.weight` (SGLang/vLLM conversions) and `fc.weight` (published) -> `fc.weight`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        short = name[len("model."):] if name.startswith("model.") else name
        if short in out:
            raise ModelLoadError(f"EAGLE draft: tensor {short} appears twice (with and without "
                                 f"the 'model.' prefix)")
        out[short] = tensor
    return out


# ---- files ---------------------------------------------------------------------------------------
def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """*.safetensors (sharded or not), else pytorch_model.bin (sharded or not)."""
    if (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors")):
        from eaglekv.model.loader import load_safetensors_dir
        try:
            return load_safetensors_dir(path)
        except ModelLoadError:
            raise
        except Exception as e:  # truncated or corrupt file (SafetensorError is no OSError)
            raise ModelLoadError(f"cannot read safetensors weights in {path}: {e}") from e
    index = path / "pytorch_model.bin.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    elif (path / "pytorch_model.bin").is_file():
        files = [path / "pytorch_model.bin"]
    else:
        raise ModelLoadError(f"no weights in {path}: expected pytorch_model.bin or *.safetensors")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"shard {f} listed in {index.name} is missing")
        try:  # weights_only: a checkpoint is data, never code
            sd.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:
            raise ModelLoadError(f"cannot read {f} as a tensor-only checkpoint: {e}") from e
    return sd


def read_draft_dir(path: str | os.PathLike, what: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """A draft checkpoint directory: (config.json as a dict, the state dict with normalised
    names); a missing or unreadable path, config or weight file raises ModelLoadError."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{what} path {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"{what} path {path} is not a directory "
                             f"(expected config.json + pytorch_model.bin or *.safetensors)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{what} directory {path} holds no config.json")
    try:
        d = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {cfg_file}: {e}") from e
    return d, normalize_names(read_weights(path))


def load_eagle_draft(path: str | os.PathLike, target: ModelConfig
                     ) -> tuple[EagleDraftConfig, dict[str, torch.Tensor]]:
    """Read an EAGLE-1/2 head directory; the state dict comes back with normalised names."""
    d, sd = read_draft_dir(path, "EAGLE draft")
    cfg = EagleDraftConfig.from_dict(d, sd)
    check_against_target(cfg, target)
    check_eagle_state_dict(cfg, sd)
    return cfg, sd


def save_eagle_draft(path: str | os.PathLike, cfg_dict: dict, state_dict: dict[str, torch.Tensor],
                     fmt: str = "bin", num_shards: int = 1) -> None:
    """Write config.json and the weights ("bin": pytorch_model.bin, "safetensors":
    model.safetensors), split into `num_shards` files with an index when > 1."""
    if fmt not in ("bin", "safetensors"):
        raise ValueError(f"fmt={fmt!r}: must be 'bin' or 'safetensors'")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    names = list(state_dict)
    stem, ext = ("pytorch_model", "bin") if fmt == "bin" else ("model", "safetensors")
    weight_map = {}
    for i in range(num_shards):
        part = {n: state_dict[n].detach().contiguous().clone() for n in names[i::num_shards]}
        fname = f"{stem}.{ext}" if num_shards == 1 else \
            f"{stem}-{i + 1:05d}-of-{num_shards:05d}.{ext}"
        if fmt == "bin":
            torch.save(part, path / fname)
        else:
            from safetensors.torch import save_file
            save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    if num_shards > 1:
        (path / f"{stem}.{ext}.index.json").write_text(json.dumps({"weight_map": weight_map}))


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
    from eaglekv.model.rope import rope_parameters
    g = torch.Generator().manual_seed(seed)
    H, V = target.hidden_size, target.vocab_size
    heads = num_heads or target.num_heads
    kv_heads = num_kv_heads or (target.num_kv_heads if num_heads is None else heads)
    D = target.head_dim if num_heads is None else H // heads
    I = intermediate_size or target.intermediate_size
    rope = rope_parameters(target.hf_config) if target.hf_config is not None else {}
    theta = rope.pop("rope_theta", 10000.0)
    scaling = None if rope.get("rope_type", "default") == "default" else rope
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": H, "intermediate_size": I, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "num_hidden_layers": 1,
           "max_position_embeddings": target.max_position_embeddings,
           "rms_norm_eps": target.rms_norm_eps, "rope_theta": theta, "rope_scaling": scaling,
           "vocab_size": V, "tie_word_embeddings": False, "bias": fc_bias, "qkv_bias": qkv_bias,
           "torch_dtype": "float32"}
    if D != H // heads:
        cfg["head_dim"] = D
    draft = EagleDraftConfig.from_dict(cfg, {})
    want = expected_tensors(draft)
    if input_norm:
        want[LAYER + "input_layernorm.weight"] = (H,)
    if with_embed:
        want["embed_tokens.weight"] = (V, H)
    sd = {}
    for name, shape in want.items():
        if name.endswith("norm.weight"):
            sd[name] = torch.rand(shape, generator=g) * 0.4 + 0.8
        else:
            sd[name] = torch.randn(shape, generator=g) * std
    if with_embed and embed is not None:
        sd["embed_tokens.weight"] = embed.detach().float().clone()
    return cfg, sd
