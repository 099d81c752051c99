"""ModelConfig: the numbers the Llama-family model needs, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eaglekv.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hf_config: Any = field(default=None, repr=False, compare=False)  # for RoPE init

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: Any) -> "ModelConfig":
        mt = getattr(cfg, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            arch = getattr(cfg, "architectures", None)
            raise ModelLoadError(f"unsupported architecture model_type={mt!r} (architectures={arch}); "
                                 f"eaglekv serves {', '.join(SUPPORTED_MODEL_TYPES)}")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act={cfg.hidden_act!r} unsupported; only 'silu' (SwiGLU)")
        if getattr(cfg, "mlp_bias", False):
            raise ModelLoadError("mlp_bias=True is unsupported")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        eos = getattr(cfg, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        bias = getattr(cfg, "attention_bias", mt == "qwen2")
        if mt == "qwen2":
            bias = True  # Qwen2 always has q/k/v biases
        return cls(
            model_type=mt, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim, rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=bool(bias), qk_norm=(mt == "qwen3"), eos_token_ids=eos_ids,
            bos_token_id=getattr(cfg, "bos_token_id", None), hf_config=cfg)
