"""bench/soak_gpu.py: the CUDA memory gauges it reads exist in the server's /metrics (0 in a
process that never used CUDA), and (slow tier) the script runs end to end on CPU for a few
seconds with poisoned requests, writing its JSON and PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_memory_gauges():
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from eaglekv.server.metrics import Metrics
    text = generate_latest(Metrics("m").registry).decode()
    for name in ("eaglekv:cuda_memory_allocated_bytes", "eaglekv:cuda_memory_reserved_bytes"):
        assert f"\n{name} " in text


@pytest.mark.slow
def test_soak_gpu_script_on_cpu(tmp_path):
    pytest.importorskip("uvicorn")
    # 8 s: each client's second request is poisoned (bench/soak_gpu.py), so every run has some
    r = subprocess.run([sys.executable, "bench/soak_gpu.py", "--device", "cpu", "--seconds",
                        "8", "--concurrency", "4", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = json.loads((tmp_path / "soak_cpu_gpu-path.json").read_text())
    assert out["ok"] and out["normal_failed"] == 0 and sum(out["poisoned"].values()) >= 1
    assert out["samples"] and out["requests"] and out["command"] and out["date"]
    assert (tmp_path / "soak_cpu_gpu-path.png").stat().st_size > 0
