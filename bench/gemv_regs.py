"""Registers and spills of the gemv kernel compiled for sm_90, offline (no GPU): Triton's
compiler for the PTX, then its bundled ptxas -v. The (BLOCK_M, BLOCK_N, BLOCK_K) product tile
lives in registers, and the registers a thread holds bound how many programs an SM keeps
resident (65536 a SM / (128 threads x registers)): what a memory-bound kernel hides latency
with. Run: .venv/bin/python bench/gemv_regs.py [--out bench/results/gemv_regs_sm90.json]"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from eaglekv.kernels import fused_triton as ft

CONFIGS = [(1, 4, 1024), (2, 4, 1024), (4, 4, 1024), (8, 4, 1024), (16, 4, 1024),
           (2, 4, 512), (4, 4, 256), (8, 4, 128), (8, 4, 256), (16, 4, 128)]


def ptxas() -> str:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):       # the one that reads Triton's PTX version
        path = os.path.join(bin_dir, name)
        if os.path.exists(path):
            return path
    raise SystemExit(f"no ptxas under {bin_dir}")


def resources(block_m: int, block_n: int, block_k: int, silu: bool, num_warps: int = 4,
              rope: bool = False) -> dict:
    """`rope`: the qkv form with the RoPE + K/V store epilogue (`_gemv_rope_kernel`, SmolLM2's
    heads) instead of `_gemv_kernel`."""
    fn = ft._gemv_rope_kernel if rope else ft._gemv_kernel
    cx = dict(HAS_RESIDUAL=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
              BY_HAND=False, USE_GDC=True)
    cx.update(dict(H=9, HKV=3, D=64, CHECK=True, ASSERT=False) if rope
              else dict(NORM=True, SILU=silu))
    fp32 = ("cos_ptr", "sin_ptr")
    sig = {n: ("*fp32" if n in fp32 else "*i64" if n in ("pos_ptr", "loc_ptr", "err_ptr")
               else "*bf16") if n.endswith("_ptr") else "fp32" if n == "eps" else "i32"
           for n in fn.arg_names}
    sig.update({k: "constexpr" for k in cx})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": 2})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(k.asm["ptx"])
        log = subprocess.run([ptxas(), "-arch=sm_90a", "-v", path, "-o", path + ".o"],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    st, ld = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                log).groups())
    threads = 32 * num_warps
    return {"kernel": fn.__name__, "block_m": block_m, "block_n": block_n,
            "block_k": block_k, "silu": silu, "registers": regs, "spill_stores": st, "spill_loads": ld,
            "programs_per_sm": min(65536 // (threads * regs), 2048 // threads)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for bm, bn, bk in CONFIGS:
        for silu, rope in ((False, False), (True, False), (False, True)):
            r = resources(bm, bn, bk, silu, rope=rope)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "device": "none (compiled for sm_90a, ptxas -v)",
                       "triton": triton.__version__,
                       "command": "bench/gemv_regs.py --out " + args.out, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
