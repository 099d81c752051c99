"""Where a Triton kernel test runs: on the GPU when there is one, else under the Triton
interpreter. Import it before triton and the kernel modules (it sets TRITON_INTERPRET=1 on
a machine without CUDA, which Triton reads at import); a module that imports it is skipped
where Triton is not installed."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
DEV = "cuda" if ON_GPU else "cpu"
GPU_MARK = pytest.mark.gpu if ON_GPU else []
