"""The CPU matmuls of one SmolLM2-135M forward (30 layers of qkv, o, gate_up, down, and the
LM head; fp32, numpy's OpenBLAS as the engine uses it) for M = 1 .. 256 rows, with the weight
stored two ways: (in, out) row-major as the engine stores it (`x @ W`), and (out, in)
row-major (`W_rows @ x.T`, transposed back). A verify of N tokens is M = N.

    OPENBLAS_NUM_THREADS=2 .venv/bin/python bench/gemm_layout_cpu.py [--out F.json]

Random weights of the model's shapes; per M, `--rounds` rounds each timing both layouts in
turn, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone

import numpy as np

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}


def pass_ms(M: int, matmul, x) -> float:
    t = time.perf_counter()
    for _ in range(30):
        for k in ("qkv", "o", "gate_up", "down"):
            matmul(x[k], k)
    matmul(x["lm_head"], "lm_head")
    return 1e3 * (time.perf_counter() - t)


def compare(M: int, ways: dict, rng, rounds: int) -> dict:
    """Medians over `rounds` rounds, each timing every way once in turn (this machine is
    shared: its speed drifts, so the ways alternate)."""
    x = {k: rng.standard_normal((M, s[0]), dtype=np.float32) for k, s in SHAPES.items()}
    for f in ways.values():
        pass_ms(M, f, x)                                                          # warm-up
    runs = {name: [] for name in ways}
    for _ in range(rounds):
        for name, f in ways.items():
            runs[name].append(pass_ms(M, f, x))
    return {name: round(sorted(r)[len(r) // 2], 2) for name, r in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rows", default="1,2,4,6,8,16,64,256")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    w = {k: rng.standard_normal(s, dtype=np.float32) for k, s in SHAPES.items()}
    rows = {k: np.ascontiguousarray(v.T) for k, v in w.items()}                  # (out, in)
    ways = {"x @ W (in, out)": lambda x, k: np.matmul(x, w[k]),
            "W_rows @ x.T (out, in)": lambda x, k: np.ascontiguousarray(np.matmul(rows[k],
                                                                                  x.T).T)}
    res = {name: {} for name in ways}
    for M in map(int, a.rows.split(",")):
        for name, ms in compare(M, ways, rng, a.rounds).items():
            res[name][M] = ms
    for name, r in res.items():
        print(f"{name:24s}", "  ".join(f"M={M}: {ms} ms" for M, ms in r.items()))
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                     f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'default')}",
           "command": "python " + " ".join(sys.argv), "ms_per_forward_matmuls": res}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
