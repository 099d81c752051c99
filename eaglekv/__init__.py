"""eaglekv: EAGLE-family speculative decoding on a guarded paged KV cache.

The names below load on first use (PEP 562): `import eaglekv` costs milliseconds, while torch
alone takes over a second to import on a small CPU machine.
"""

from importlib import import_module

from eaglekv.version import __version__

# before numpy loads: OpenBLAS's threads sleep after a call (blas_env, model/cpu_blas.py)
from eaglekv import blas_env  # noqa: E402,F401

_EXPORTS = {"EngineConfig": "eaglekv.config", "SamplingParams": "eaglekv.config",
            "SpecConfig": "eaglekv.config", "Output": "eaglekv.core",
            "SpecStats": "eaglekv.core", "StreamDelta": "eaglekv.core",
            "TokenLogprob": "eaglekv.core", "Engine": "eaglekv.engine",
            "ConfigError": "eaglekv.errors", "KVIndexError": "eaglekv.errors",
            "ModelLoadError": "eaglekv.errors", "RequestError": "eaglekv.errors"}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'eaglekv' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
