"""GGUF weights, dequantized with the `gguf` package, renamed to Hugging Face names.

Llama-architecture GGUF files store attn_q / attn_k rows permuted for llama.cpp's RoPE
layout; `unpermute` undoes it per head: `w.reshape(n_head, D/2, 2, in).transpose(1, 2)`.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import torch

from eaglekv.errors import ModelLoadError
from eaglekv.model.config import ModelConfig

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q4_K", "Q5_K", "Q6_K")
PERMUTED_ARCHS = ("llama",)   # convert_hf_to_gguf permutes q/k for these

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_IGNORED = ("rope_freqs.weight",)  # RoPE scaling comes from the config
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _IGNORED:
        return None
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLK.match(gguf_name)
    if not m or m.group(2) not in _LAYER:
        raise ModelLoadError(f"GGUF tensor {gguf_name} has no Hugging Face counterpart")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: (out, in) -> (out, in), per head."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def dequantize(tensor) -> torch.Tensor:
    from gguf.quants import dequantize as gguf_dequantize
    qtype = tensor.tensor_type.name
    if qtype not in SUPPORTED_TYPES:
        raise ModelLoadError(f"GGUF tensor {tensor.name} has type {qtype}, unsupported "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
    arr = gguf_dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists dims innermost first
    arr = np.array(arr, dtype=np.float32, copy=True).reshape(shape)  # writable, owned
    return torch.from_numpy(arr)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    val = f.contents() if hasattr(f, "contents") else f.parts[f.data[0]]
    return val.tolist() if hasattr(val, "tolist") else val


def gguf_hf_config(reader, path: Path):
    """A transformers config from the GGUF metadata (what transformers' own GGUF loader reads,
    without its slow pass over the tokenizer arrays)."""
    from transformers import AutoConfig
    arch = _field(reader, "general.architecture", "?")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} "
                             f"(supported: llama, qwen2, qwen3)")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope = {"rope_type": "default", "rope_theta": float(g("rope.freq_base", 10000.0))}
    if g("rope.scaling.type") == "linear":
        rope.update(rope_type="linear", factor=float(g("rope.scaling.factor")))
    elif g("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"{path}: unsupported GGUF rope scaling {g('rope.scaling.type')!r}")
    names = {t.name for t in reader.tensors}
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"), num_attention_heads=heads,
        num_key_value_heads=g("attention.head_count_kv", heads),
        head_dim=g("attention.key_length", hidden // heads),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=g("context_length", 4096), rope_parameters=rope,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"))
    return AutoConfig.for_model(arch, **kwargs)


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, struct.error) as e:  # truncated or not GGUF
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
    arch = _field(reader, "general.architecture", "?")
    cfg = ModelConfig.from_hf(gguf_hf_config(reader, path))
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t)
        if arch in PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            w = unpermute(w, heads)
        sd[name] = w
    return cfg, sd
