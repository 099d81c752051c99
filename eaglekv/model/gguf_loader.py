"""GGUF weights, dequantized with the `gguf` package, renamed to Hugging Face names.

The file is read by `read_gguf`, a small reader over a memory map: the metadata values, the
tensor table and a view of each tensor's bytes. It walks the vocabulary strings without
decoding them (gguf.GGUFReader builds ~150k field objects for them: 5 s on this machine).

Llama-architecture GGUF files store attn_q / attn_k rows permuted for llama.cpp's RoPE
layout; `unpermute` undoes it per head: `w.reshape(n_head, D/2, 2, in).transpose(1, 2)`.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any, NamedTuple

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

# GGUF metadata value types: fixed-size scalars (struct format), 8 = string, 9 = array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
KEEP_STRINGS = ("tokenizer.ggml.tokens",)   # other string arrays are skipped, kept as a count


class GGUFTensor(NamedTuple):
    """One tensor as the file stores it (what `dequantize` reads, like gguf's ReaderTensor)."""
    name: str
    tensor_type: Any            # gguf.GGMLQuantizationType
    shape: tuple[int, ...]      # GGUF order: innermost first
    data: np.ndarray            # uint8 (rows, bytes per row), a view of the memory map


class GGUFFile(NamedTuple):
    fields: dict[str, Any]      # metadata; a skipped string array is its length (an int)
    tensors: list[GGUFTensor]


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
    """A GGUFTensor (or gguf's ReaderTensor) -> float32 (out, in), writable and owned."""
    from gguf.quants import dequantize as gguf_dequantize
    qtype = tensor.tensor_type.name
    if qtype not in SUPPORTED_TYPES:
        raise ModelLoadError(f"GGUF tensor {tensor.name} has type {qtype}, unsupported "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
    shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists dims innermost first
    arr = _dequantize_blocks(np.asarray(tensor.data), qtype)
    if arr is None:
        arr = gguf_dequantize(tensor.data, tensor.tensor_type)
        arr = np.array(arr, dtype=np.float32, copy=True)       # writable, owned
    return torch.from_numpy(arr.reshape(shape))


_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _dequantize_blocks(data: np.ndarray, qtype: str) -> np.ndarray | None:
    """Q8_0 / Q4_0 / Q4_1 in a few in-place passes (gguf.quants' row-grouped version takes ~4x
    as long on the default model), bit for bit the same float32 ops: 32 weights a block,
    Q8_0 [d f16][q int8 x32] -> d*q; Q4_0 [d][16 bytes] -> d*(q-8); Q4_1 [d][m][16 bytes] ->
    d*q + m, where byte j holds weight j in its low nibble and weight j+16 in its high one."""
    if qtype not in _BLOCK_BYTES or data.dtype != np.uint8:
        return None
    b = data.reshape(-1, _BLOCK_BYTES[qtype])                           # (blocks, bytes)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)             # (blocks, 1)
    if qtype == "Q8_0":
        out = b[:, 2:].copy().view(np.int8).astype(np.float32)          # (blocks, 32)
        out *= d
        return out
    qs = b[:, -16:]                                                     # (blocks, 16)
    q = np.empty((len(b), 32), np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :16])
    np.right_shift(qs, 4, out=q[:, 16:])
    out = q.astype(np.float32)                                          # (blocks, 32)
    if qtype == "Q4_0":
        out -= 8
        out *= d
    else:
        out *= d
        out += b[:, 2:4].copy().view(np.float16).astype(np.float32)     # + m
    return out


# ---- the reader ----------------------------------------------------------------------------------
class _Cursor:
    def __init__(self, buf: np.ndarray):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return out if len(out) > 1 else out[0]

    def string(self, decode: bool = True):
        n = self.unpack("<Q")
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.buf):
            raise ValueError(f"string of {n} bytes at offset {start} runs past the end")
        return bytes(self.buf[start:self.pos]).decode("utf-8") if decode else None

    def value(self, vtype: int, keep_strings: bool):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == 8:
            return self.string()
        if vtype != 9:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, count = self.unpack("<IQ")
        if etype in _SCALAR:
            fmt = _SCALAR[etype]
            out = struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos)
            self.pos += count * struct.calcsize(fmt)
            return list(out)
        if etype != 8:
            raise ValueError(f"metadata array of type {etype} unsupported")
        if keep_strings:
            return [self.string() for _ in range(count)]
        for _ in range(count):   # walk the lengths only
            self.string(decode=False)
        return count


def read_gguf(path: Path) -> GGUFFile:
    """Metadata and tensor views of a GGUF file (v2/v3), over a read-only memory map."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    try:
        buf = np.memmap(path, mode="r", dtype=np.uint8)
        cur = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        version, n_tensors, n_kv = cur.unpack("<4xIQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} unsupported (2 and 3 are)")
        fields = {}
        for _ in range(n_kv):
            key = cur.string()
            fields[key] = cur.value(cur.unpack("<I"), key in KEEP_STRINGS)
        table = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = cur.unpack(f"<{cur.unpack('<I')}Q")
            dims = (dims,) if isinstance(dims, int) else dims
            qtype, offset = cur.unpack("<IQ")
            table.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(qtype), offset))
        align = fields.get("general.alignment", 32)
        start = -(-cur.pos // align) * align
        tensors = []
        for name, dims, qtype, offset in table:
            block, nbytes = GGML_QUANT_SIZES[qtype]
            row_bytes = dims[0] // block * nbytes
            rows = int(np.prod(dims[1:], dtype=np.int64))
            begin = start + offset
            if begin + rows * row_bytes > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            data = buf[begin:begin + rows * row_bytes].reshape(rows, row_bytes)
            tensors.append(GGUFTensor(name, qtype, dims, data))
    except (ValueError, OSError, IndexError, struct.error) as e:  # truncated or not GGUF
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
    return GGUFFile(fields, tensors)


# ---- config and weights --------------------------------------------------------------------------
def gguf_config_dict(gf: GGUFFile, path: Path) -> dict:
    """The transformers config (`model_type` + its kwargs) the GGUF metadata describes: what
    transformers' own GGUF loader reads, without its slow pass over the tokenizer arrays."""
    f = gf.fields
    arch = f.get("general.architecture", "?")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} "
                             f"(supported: llama, qwen2, qwen3)")
    g = lambda k, d=None: f.get(f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    vocab = g("vocab_size") or f.get("tokenizer.ggml.tokens")
    vocab = len(vocab) if isinstance(vocab, list) else vocab
    rope = {"rope_type": "default", "rope_theta": float(g("rope.freq_base", 10000.0))}
    if g("rope.scaling.type") == "linear":
        rope.update(rope_type="linear", factor=float(g("rope.scaling.factor")))
    elif g("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"{path}: unsupported GGUF rope scaling {g('rope.scaling.type')!r}")
    names = {t.name for t in gf.tensors}
    return dict(
        model_type=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=g("feed_forward_length"), num_hidden_layers=g("block_count"),
        num_attention_heads=heads, num_key_value_heads=g("attention.head_count_kv", heads),
        head_dim=g("attention.key_length", hidden // heads),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=g("context_length", 4096), rope_parameters=rope,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id"))


def hf_config_from_dict(d: dict):
    """A transformers config from `model_type` + kwargs (imports transformers: ~1 s)."""
    from transformers import AutoConfig
    d = dict(d)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def gguf_state_dict(gf: GGUFFile, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its Hugging Face name, q/k unpermuted."""
    sd: dict[str, torch.Tensor] = {}
    for t in gf.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t)
        if cfg.model_type in PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute(w, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        sd[name] = w
    return sd


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    gf = read_gguf(path)
    cfg = ModelConfig.from_hf(hf_config_from_dict(gguf_config_dict(gf, path)))
    return cfg, gguf_state_dict(gf, cfg)
