"""Draft checkpoint directories, for every draft family: read, check, write, make at random.

A draft checkpoint is a directory with `config.json` (a LlamaConfig-style dict) and its weights,
`*.safetensors` or `pytorch_model.bin`, each sharded or not (`*.index.json` names the shards).
Tensor names come back without a `model.` prefix (SGLang/vLLM conversions add one). Each family
describes its layout as {name: shape} and checks a state dict against it with `check_tensors`:
`draft_checkpoint` (EAGLE-1/2), `eagle3_checkpoint` (EAGLE-3), `multi_layer_eagle` (S layers).
Every error is a `ModelLoadError` that names the file or the tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from eaglekv.errors import ModelLoadError
from eaglekv.model.config import ModelConfig
from eaglekv.model.rope import rope_parameters

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # buffers some exports carry; never weights


# ---- reading -------------------------------------------------------------------------------------
def check_draft_dir(path: str | os.PathLike, what: str, weights: bool = True) -> Path:
    """The checks of `read_draft_dir` that need no weights read: the directory, its
    config.json and its weight files exist (ModelLoadError naming what is missing) -> the
    path. For a tool that loads several drafts one after another (eval-draft --also-draft), so
    that a bad last one fails before the first one's runs, not after."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{what} path {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"{what} path {path} is not a directory "
                             f"(expected config.json + pytorch_model.bin or *.safetensors)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{what} directory {path} holds no config.json")
    if weights:
        weight_files(path)
    return path


def read_draft_dir(path: str | os.PathLike, what: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """A draft checkpoint directory: (config.json as a dict, the state dict with normalised
    names); a missing or unreadable path, config or weight file raises ModelLoadError."""
    path = check_draft_dir(path, what, weights=False)     # the config read first, then these
    cfg_file = path / "config.json"
    try:
        d = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {cfg_file}: {e}") from e
    return d, normalize_names(read_weights(path), what)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """*.safetensors (sharded or not), else pytorch_model.bin (sharded or not)."""
    sd: dict[str, torch.Tensor] = {}
    files, load = weight_files(path)
    for f in files:
        sd.update(load(f))
    return sd


def weight_files(path: Path) -> tuple[list[Path], Callable[[Path], dict[str, torch.Tensor]]]:
    """(the weight files of the directory, the function that reads one of them)."""
    st_index = path / "model.safetensors.index.json"
    bin_index = path / "pytorch_model.bin.index.json"
    if st_index.is_file():
        return listed_shards(st_index), _load_safetensors
    if safetensors := sorted(path.glob("*.safetensors")):
        return safetensors, _load_safetensors
    if bin_index.is_file():
        return listed_shards(bin_index), _load_bin
    if (path / "pytorch_model.bin").is_file():
        return [path / "pytorch_model.bin"], _load_bin
    raise ModelLoadError(f"no weights in {path}: expected pytorch_model.bin or *.safetensors")


def listed_shards(index: Path) -> list[Path]:
    """The shard files an `*.index.json` names (its weight_map values), each checked present."""
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"cannot read the shard index {index}: {e}") from e
    files = [index.parent / n for n in names]
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"shard {f} listed in {index.name} is missing")
    return files


def _load_safetensors(f: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(f))
    except Exception as e:  # truncated or corrupt file (SafetensorError is no OSError)
        raise ModelLoadError(f"cannot read safetensors weights from {f}: {e}") from e


def _load_bin(f: Path) -> dict[str, torch.Tensor]:
    try:  # weights_only: a checkpoint is data, never code
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot read {f} as a tensor-only checkpoint: {e}") from e


def normalize_names(sd: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """`model.fc.weight` (SGLang/vLLM conversions) and `fc.weight` (published) -> `fc.weight`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        short = name[len("model."):] if name.startswith("model.") else name
        if short in out:
            raise ModelLoadError(f"{what}: tensor {short} appears twice (with and without "
                                 f"the 'model.' prefix)")
        out[short] = tensor
    return out


def llama_fields(d: dict, what: str) -> dict:
    """The LlamaConfig fields every draft config has, read from config.json `d` as keyword
    arguments of the family's config dataclass (hf_dict: `d` itself; rope: a LlamaConfig)."""
    if d.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"draft hidden_act={d['hidden_act']!r} unsupported; only 'silu'")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in d:
            raise ModelLoadError(f"{what} config.json lacks {key!r}")
    H, heads = d["hidden_size"], d["num_attention_heads"]
    return dict(hidden_size=H, num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or H // heads, intermediate_size=d["intermediate_size"],
                rms_norm_eps=d.get("rms_norm_eps", 1e-6), vocab_size=d["vocab_size"],
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                hf_dict=dict(d), rope=draft_rope_config(d))


def draft_rope_config(d: dict):
    """What RotaryEmbedding reads of a draft's config.json `d`: the plain RoPE of a theta
    as a namespace, anything scaled as a transformers LlamaConfig (whose rope functions
    compute it). transformers takes 1.5 s to import: the shipped heads, plain RoPE, load
    without it."""
    params = d.get("rope_parameters") or d.get("rope_scaling")
    if not params or params.get("rope_type", params.get("type", "default")) == "default":
        theta = (params or {}).get("rope_theta", d.get("rope_theta", 10000.0))
        return SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": theta})
    from transformers import LlamaConfig   # on first use
    return LlamaConfig(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})


def decoder_layer_config(c) -> ModelConfig:
    """The ModelConfig of a draft's one decoder layer (what `DecoderLayer` reads); `c` is an
    `EagleDraftConfig` or `Eagle3DraftConfig`."""
    return ModelConfig(
        model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=1, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False,
        attention_bias=c.attention_bias, qk_norm=False, hf_config=c.rope)


# ---- checks --------------------------------------------------------------------------------------
def check_against_target(cfg, target: ModelConfig) -> None:
    """The draft reads the target's hidden states and shares its embedding (and LM head)."""
    if cfg.hidden_size != target.hidden_size:
        raise ModelLoadError(f"draft hidden_size={cfg.hidden_size} differs from the target's "
                             f"hidden_size={target.hidden_size}: this head was trained for "
                             f"another model")
    if cfg.vocab_size != target.vocab_size:
        raise ModelLoadError(f"draft vocab_size={cfg.vocab_size} differs from the target's "
                             f"vocab_size={target.vocab_size}: this head was trained for "
                             f"another tokenizer")


def check_tensors(want: dict[str, tuple[int, ...]], sd: dict[str, torch.Tensor], what: str,
                  layout: str) -> None:
    """Every tensor of `want` ({name: shape}) is in `sd` with that shape, and `sd` holds no
    other (but IGNORED_SUFFIXES); otherwise one ModelLoadError naming the missing, mis-shaped
    and unexpected tensors (up to 4 of each, with the counts). `layout`, what the family's
    checkpoint holds, follows the unexpected ones."""
    missing = [f"missing tensor {n} (expected shape {s})" for n, s in want.items() if n not in sd]
    wrong = [f"tensor {n} has shape {tuple(sd[n].shape)}, config expects {s}"
             for n, s in want.items() if n in sd and tuple(sd[n].shape) != s]
    extra = [n for n in sd if n not in want and not n.endswith(IGNORED_SUFFIXES)]
    problems = _first(missing, "missing tensors") + _first(wrong, "mis-shaped tensors")
    if extra:
        problems.append(f"{len(extra)} unexpected tensors, e.g. {extra[:4]} ({layout})")
    if problems:
        raise ModelLoadError(f"{what}: " + "; ".join(problems))


def _first(items: list[str], kind: str, n: int = 4) -> list[str]:
    return items[:n] + ([f"{len(items) - n} more {kind}"] if len(items) > n else [])


# ---- writing and random drafts -------------------------------------------------------------------
def save_draft_dir(path: str | os.PathLike, cfg_dict: dict, state_dict: dict[str, torch.Tensor],
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
            save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    if num_shards > 1:
        (path / f"{stem}.{ext}.index.json").write_text(json.dumps({"weight_map": weight_map}))


def random_llama_dict(target: ModelConfig, architecture: str, *, num_heads: int | None = None,
                      num_kv_heads: int | None = None, intermediate_size: int | None = None
                      ) -> dict:
    """config.json of a random one-layer draft for `target`: the target's shapes (heads, kv
    heads, intermediate size overridable; other heads than the target's get head_dim H/heads)
    and RoPE settings, fp32, untied."""
    H = target.hidden_size
    heads = num_heads or target.num_heads
    kv_heads = num_kv_heads or (target.num_kv_heads if num_heads is None else heads)
    D = target.head_dim if num_heads is None else H // heads
    rope = rope_parameters(target.hf_config) if target.hf_config is not None else {}
    theta = rope.pop("rope_theta", 10000.0)
    scaling = None if rope.get("rope_type", "default") == "default" else rope
    cfg = {"architectures": [architecture], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": H, "intermediate_size": intermediate_size or target.intermediate_size,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": 1,
           "max_position_embeddings": target.max_position_embeddings,
           "rms_norm_eps": target.rms_norm_eps, "rope_theta": theta, "rope_scaling": scaling,
           "vocab_size": target.vocab_size, "tie_word_embeddings": False,
           "torch_dtype": "float32"}
    if D != H // heads:
        cfg["head_dim"] = D
    return cfg


def random_tensors(shapes: dict[str, tuple[int, ...]], generator: torch.Generator, std: float
                   ) -> dict[str, torch.Tensor]:
    """Norm weights ~ U(0.8, 1.2), every other tensor ~ N(0, std), drawn in `shapes` order."""
    return {name: torch.rand(shape, generator=generator) * 0.4 + 0.8
            if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * std
            for name, shape in shapes.items()}


# ---- a reduced draft vocabulary for an EAGLE-1/2 head --------------------------------------------
DRAFT_VOCAB_FILE = "draft_vocab.json"   # {"target_ids": [...]}: sorted, distinct (not a
#                                         *.safetensors, which loaders read as weights)


def read_draft_vocab(path: str | os.PathLike, vocab_size: int) -> torch.Tensor | None:
    """The target ids an EAGLE-1/2 head may propose, from `draft_vocab.json` in its
    directory (eaglekv's own file beside the published layout; None when absent: the whole
    vocabulary). Its LM head is then the target's columns of these ids: on the CPU the draft
    step's GEMV over SmolLM2's 49152 x 576 head took 3.9 ms of ~4.5, over 16384 ids 1.2."""
    f = Path(path).expanduser() / DRAFT_VOCAB_FILE
    if not f.exists():
        return None
    try:
        ids = json.loads(f.read_text())["target_ids"]
        if not all(type(i) is int for i in ids):
            raise ValueError("target_ids holds a value that is not an integer")
        ids = torch.tensor(ids, dtype=torch.int64)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot read {f}: {e}") from e
    if (ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0
            or int(ids.max()) >= vocab_size or not bool((ids[1:] > ids[:-1]).all())):
        raise ModelLoadError(f"{f}: target_ids must be a non-empty sorted list of distinct "
                             f"token ids in [0, {vocab_size}) (got {ids.numel()} ids)")
    return ids


def spread_logits(draft_logits: torch.Tensor, target_ids: torch.Tensor,
                  vocab_size: int) -> torch.Tensor:
    """(n, Vd) over a reduced vocabulary -> (n, V): column target_ids[i] = draft column i,
    -inf elsewhere (a target token outside the draft vocabulary has draft probability 0 and
    is never proposed; acceptance stays exact)."""
    out = draft_logits.new_full((draft_logits.shape[0], vocab_size), float("-inf"))
    return out.index_copy_(1, target_ids, draft_logits)                     # (n, V)
