"""OpenBLAS's thread timeout, set before numpy loads it (model/cpu_blas.py runs 2-16-row
matmuls through oneDNN on every core, one row through OpenBLAS).

OpenBLAS keeps its threads spinning for 2**28 cycles (~0.1 s) after every call, and on a small
machine they starve the OpenMP threads oneDNN runs on: an S3 step ran 2.2x slower. 2**4 cycles
puts them to sleep at once. OpenBLAS reads `OPENBLAS_THREAD_TIMEOUT` once, when numpy loads it,
so `import eaglekv` sets it (unless the user chose a value) while numpy is not loaded yet;
where numpy came first (`import torch` loads it) without the variable, cpu_blas keeps oneDNN
on one thread.
"""

import os
import sys

# whether the variable, whatever its value, was in the environment when OpenBLAS was loaded
# (or will be: numpy is not loaded yet)
TIMEOUT_APPLIES = "numpy" not in sys.modules or "OPENBLAS_THREAD_TIMEOUT" in os.environ
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


def timeout_is_short() -> bool:
    """OpenBLAS's threads sleep as soon as a call ends (a timeout of at most 2**10 cycles that
    OpenBLAS read when it was loaded)."""
    value = os.environ.get("OPENBLAS_THREAD_TIMEOUT", "")
    return TIMEOUT_APPLIES and value.isdigit() and int(value) <= 10
