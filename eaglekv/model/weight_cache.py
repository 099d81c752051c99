"""The converted-weights cache: a model's tensors as the engine lays them out (fused, permuted,
in the load dtype), written once as safetensors and memory-mapped by every later load.

    $EAGLEKV_CACHE (default $XDG_CACHE_HOME/eaglekv, else ~/.cache/eaglekv; empty or "off":
    no cache, as for the adaptive cost table)
      weights/<source stem>-<dtype>-<key>/model.safetensors    fused tensors + metadata
      tokenizer/<source stem>-<key>/tokenizer.json, tokenizer_config.json

key = sha256 of the layout version, the dtype and, per source file, its name, size, mtime and
the sha256 of its first MiB (a GGUF's header and most of its metadata). A changed source gets a
new key; stale entries are left for the user to delete.

The safetensors metadata holds the model config and a checksum per tensor (the wrapping sum
of its bytes as uint64 words: ~25 ms over 540 MB). A load checks the header, the file size,
the key and every checksum; any mismatch is `CacheCorrupt`, and the caller rebuilds the entry.
It catches truncation and overwritten bytes, not deliberate tampering.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

CACHE_ENV = "EAGLEKV_CACHE"
HEAD_BYTES = 1 << 20
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_NAMES = {v: k for k, v in _DTYPES.items()}


class CacheCorrupt(Exception):
    pass


def cache_root() -> Path | None:
    """Where cached weights and tokenizers live; None when EAGLEKV_CACHE is empty or "off"."""
    env = os.environ.get(CACHE_ENV)
    if env is not None and env.strip() in ("", "off"):
        return None
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eaglekv"


def source_key(sources: list[Path], *extra: str) -> str:
    h = hashlib.sha256("\0".join(extra).encode())
    for p in sources:
        st = p.stat()
        h.update(f"\0{p.name}:{st.st_size}:{st.st_mtime_ns}:".encode())
        with open(p, "rb") as f:
            h.update(hashlib.sha256(f.read(HEAD_BYTES)).digest())
    return h.hexdigest()[:20]


def entry_dir(kind: str, sources: list[Path], *extra: str) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    key = source_key(sources, kind, *extra)
    return root / kind / "-".join([sources[0].stem, *extra, key])


def warn_unwritable(where: Path, err: OSError) -> None:
    warnings.warn(f"eaglekv: cannot write the cache at {where} ({err}); loading without it "
                  f"(set {CACHE_ENV} to a writable directory, or empty for no cache)", stacklevel=3)


def warn_corrupt(where: Path, err: Exception) -> None:
    warnings.warn(f"eaglekv: the cache entry {where} is damaged ({err}); rebuilding it",
                  stacklevel=3)


def replace_dir(tmp: Path, entry: Path) -> None:
    """Move a finished temporary directory into place (a damaged old entry goes first; if
    another process got there in between, its entry stays and ours is dropped)."""
    shutil.rmtree(entry, ignore_errors=True)
    try:
        os.replace(tmp, entry)
    except OSError:
        if not entry.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _checksum(buf) -> str:
    """Wrapping uint64 sum of the bytes (the tail that is not a whole word: byte by byte)."""
    a = np.frombuffer(buf, dtype=np.uint8)
    n = len(a) // 8 * 8
    s = int(np.add.reduce(a[:n].view(np.uint64), dtype=np.uint64)) if n else 0
    return f"{s:016x}:{int(a[n:].sum())}"


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write `tensors` as one safetensors file (data 64-byte aligned), via a temporary file
    renamed into place, so a reader never sees half a file."""
    header, sums, off = {}, {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + n]}
        off += n
    for name, t in tensors.items():
        sums[name] = _checksum(_bytes(t))
    header["__metadata__"] = {"eaglekv": json.dumps({**meta, "checksums": sums})}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 64)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for t in tensors.values():
                f.write(_bytes(t).data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path, meta_check: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Memory-map a file `save` wrote -> (tensors sharing the file's pages, metadata).
    Raises OSError when absent or unreadable, CacheCorrupt when anything does not add up."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= size - 8:
                raise ValueError(f"header length {n} in a file of {size} bytes")
            header = json.loads(f.read(n))
            meta = json.loads(header.pop("__metadata__")["eaglekv"])
            ends = [v["data_offsets"][1] for v in header.values()]
        except (ValueError, KeyError, TypeError) as e:
            raise CacheCorrupt(f"{path}: unreadable header ({e})") from None
        if 8 + n + max(ends, default=0) != size:
            raise CacheCorrupt(f"{path}: {size} bytes, the header describes "
                               f"{8 + n + max(ends, default=0)}")
        for k, v in meta_check.items():
            if meta.get(k) != v:
                raise CacheCorrupt(f"{path}: metadata {k}={meta.get(k)!r}, expected {v!r}")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)   # private: writes stay ours
    tensors = {}
    for name, v in header.items():
        b, e = v["data_offsets"]
        if _checksum(memoryview(mm)[8 + n + b:8 + n + e]) != meta["checksums"].get(name):
            raise CacheCorrupt(f"{path}: tensor {name} fails its checksum")
        dtype = _DTYPES[v["dtype"]]
        count = (e - b) // dtype.itemsize
        t = (torch.frombuffer(mm, dtype=dtype, count=count, offset=8 + n + b) if count
             else torch.empty(0, dtype=dtype))
        tensors[name] = t.view(v["shape"])
    return tensors, meta
