"""eaglekv: EAGLE-family speculative decoding on a guarded paged KV cache.

The names below load on first use (PEP 562): `import eaglekv` costs milliseconds, while torch
alone takes over a second to import on a small CPU machine.
"""

import os
import sys
from importlib import import_module

from eaglekv.version import __version__

# OpenBLAS (numpy's BLAS; the CPU engine's one-row matmuls) keeps its threads spinning for
# 2**28 cycles (~0.1 s) after every call, and on a small machine they starve the OpenMP
# threads that oneDNN runs a verify's matmuls on (model/cpu_blas.py). 2**4 cycles puts them
# to sleep at once. OpenBLAS reads this when numpy loads it, so it is set here, before that,
# unless the user chose a value; with numpy loaded first, cpu_blas keeps oneDNN on one thread.
OPENBLAS_TIMEOUT_APPLIES = "numpy" not in sys.modules or "OPENBLAS_THREAD_TIMEOUT" in os.environ
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

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
