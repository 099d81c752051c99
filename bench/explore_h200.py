"""Issue 13's device-side questions, measured on the GPU before choosing what to build:

  matmul:    a decode matmul with the weight stored (in, out) row-major (`x @ w_t`, the
             engine's layout, cuBLAS "NN") against the same weight stored (out, in) and used
             transposed (`x @ w.t()`, nn.Linear's layout, cuBLAS "TN"): SmolLM2's and
             Llama-3.1-8B's shapes at M = 1, 4, 16, 64, each replayed in one CUDA graph over
             enough copies of the weight to stream from HBM, not L2.
  attention: the Triton decode attention at batch 1 (SmolLM2's heads) for kv lengths 64-4096
             and split-K 1-16 (a split count > 1 adds a merge kernel).
  chain:     plain decoding at batch 1 on a random SmolLM2-shaped model, chains of 8, 16, 32,
             64 greedy steps per engine step (num_scheduler_steps).
  gemv2:     a bare Triton matrix-vector kernel over its tilings against cuBLAS at M = 1.
  gemvdot:   the gemv kernel's tensor-core tile (5-16 rows) over its tilings against cuBLAS
             and cuBLAS with the glue kernels, SmolLM2's matmuls at M = 6, 8, 16.
  gemvgroups: the same at M = 6, 8 in row groups of the 4-row register tile
             (fused.GEMV_GROUP_MAX_ROWS, 2026-12-07: a verify layer in four launches).

    PYTHONPATH=. python3 bench/explore_h200.py OUT_DIR [--parts matmul,attention,chain]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch

SHAPES = {  # name: (K, N) of the weight, i.e. x (M, K) @ w (K, N)
    "smollm2.qkv": (576, 960), "smollm2.o": (576, 576), "smollm2.gate_up": (576, 3072),
    "smollm2.down": (1536, 576), "smollm2.lm_head": (576, 49152),
    "8b.qkv": (4096, 6144), "8b.o": (4096, 4096), "8b.gate_up": (4096, 28672),
    "8b.down": (14336, 4096),
}


def graph_time(fn, reps: int = 20) -> float:
    """Mean ms of one replay of `fn` captured in a CUDA graph."""
    from eaglekv.bench.gpu import graph_us
    return graph_us(fn, reps) / 1e3


def part_matmul() -> list[dict]:
    rows = []
    for name, (K, N) in SHAPES.items():
        nbytes = K * N * 2
        copies = max(2, min(64, -(-400_000_000 // nbytes)))     # >= 400 MB streamed per replay
        for layout in ("in_out", "out_in_t"):
            if layout == "in_out":
                ws = [torch.randn(K, N, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            else:
                ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
                      for _ in range(copies)]
            for M in (1, 4, 16, 64):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)

                def fn():
                    for w in ws:
                        x @ w
                ms = graph_time(fn) / copies
                rows.append({"shape": name, "K": K, "N": N, "layout": layout, "M": M,
                             "us": round(1e3 * ms, 2),
                             "TBps": round(nbytes / (ms * 1e-3) / 1e12, 3)})
            del ws
            torch.cuda.empty_cache()
        print(json.dumps([r for r in rows if r["shape"] == name and r["M"] == 1]), flush=True)
    return rows


def part_attention() -> list[dict]:
    from eaglekv.kernels.attention import decode_attention
    from eaglekv.kernels.guard import kv_guard
    H, Hkv, D, layers = 9, 3, 64, 30
    rows = []
    for L in (64, 256, 512, 1024, 2048, 4096):
        slots = L + 64
        kb = [torch.randn(slots, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        vb = [torch.randn(slots, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        table = torch.arange(1, L + 1, device="cuda", dtype=torch.int32)
        q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16)
        start = torch.zeros(1, dtype=torch.int64, device="cuda")
        klen = torch.full((1,), L, dtype=torch.int64, device="cuda")
        for splits in (1, 2, 4, 8, 16):
            def fn():
                for i in range(layers):
                    decode_attention(q, kb[i], vb[i], table, start, klen, D ** -0.5,
                                     size_limit=slots, num_splits=splits)
            with kv_guard(torch.device("cuda")).step():
                ms = graph_time(fn) / layers
            rows.append({"kv_len": L, "splits": splits, "us": round(1e3 * ms, 2)})
        print(json.dumps([r for r in rows if r["kv_len"] == L]), flush=True)
    return rows


def part_chain() -> list[dict]:
    sys.path.insert(0, os.path.dirname(__file__))
    from profile_step import make_model

    from eaglekv import Engine, EngineConfig, SamplingParams
    rows = []
    with tempfile.TemporaryDirectory() as d:
        make_model(d)
        for k in (8, 16, 32, 64):
            e = Engine(EngineConfig(model=d, dtype="bfloat16", device="cuda",
                                    max_running_requests=4, max_total_tokens=8192,
                                    num_scheduler_steps=k))
            p = SamplingParams(max_new_tokens=256, ignore_eos=True)
            e.generate([[1, 2, 3, 4, 5, 6, 7, 8]], p)                 # warm
            best = 0.0
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = e.generate([[1, 2, 3, 4, 5, 6, 7, 8]], p)
                torch.cuda.synchronize()
                best = max(best, len(out[0].token_ids) / (time.perf_counter() - t))
            rows.append({"num_scheduler_steps": k, "tok_s": round(best, 1)})
            print(json.dumps(rows[-1]), flush=True)
            del e
            torch.cuda.empty_cache()
    return rows


def part_gemv() -> list[dict]:
    """The fused gemv kernel (add + RMSNorm prologue on every matmul here, SiLU*mul epilogue on
    gate_up) over its tilings against what it replaces: cuBLAS alone and cuBLAS with the
    separate Triton glue kernels (add_rms_norm before, silu_and_mul after), on SmolLM2's and
    the 8B's decode matmuls (column-major weights, M = 1 and 4), each over enough weight
    copies to stream from HBM, in one CUDA graph."""
    return _gemv_sweep(lambda name: () if "lm_head" in name else
                       (1, 4) if name.startswith("smollm2") else (1,), (2, 4, 8), (256, 1024),
                       (2, 4))


def part_gemvdot() -> list[dict]:
    """The same for the kernel's tensor-core tile (5-16 rows: S5's 6-token verify window, a
    tree's 8 or 16, decode batches of 8 and 16) on SmolLM2's matmuls, over its tilings."""
    return _gemv_sweep(lambda name: (6, 16) if name.startswith("smollm2") else (),
                       (16, 32), (64, 128, 256), (2, 4))


def part_gemvgroups() -> list[dict]:
    """The register tile in row groups for 6 and 8 rows (S5's and S7's verify windows at
    batch 1) on SmolLM2's matmuls, over its column blocks, against cuBLAS (+ glue)."""
    from eaglekv.kernels import fused
    was = fused.GEMV_GROUP_MAX_ROWS
    fused.GEMV_GROUP_MAX_ROWS = 8
    try:
        return _gemv_sweep(lambda name: (6, 8) if name.startswith("smollm2")
                           and "lm_head" not in name else (), (2, 4, 8), (1024, 2048), (4, 8))
    finally:
        fused.GEMV_GROUP_MAX_ROWS = was


def _gemv_sweep(rows_of, block_ns, block_ks, warps) -> list[dict]:
    from eaglekv.kernels import fused
    from eaglekv.kernels.fused_triton import gemv_triton
    rows = []
    for name, (K, N) in SHAPES.items():
        if not rows_of(name):
            continue
        nbytes = K * N * 2
        copies = max(2, min(64, -(-400_000_000 // nbytes)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t() for _ in range(copies)]
        silu = "gate_up" in name
        for M in rows_of(name):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            nw = torch.ones(K, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)

            def cublas():
                for w in ws:
                    x @ w

            def glue():
                for w in ws:
                    h, _ = fused.add_rms_norm(x, r, nw, 1e-5, checked=False)
                    y = h @ w
                    if silu:
                        fused.silu_and_mul(y, checked=False)
            best = {"shape": name, "M": M,
                    "cublas_us": round(1e3 * graph_time(cublas) / copies, 2), "configs": []}
            try:          # add_rms_norm's kernel holds rows up to 8192 wide (not 8b.down's)
                best["cublas_glue_us"] = round(1e3 * graph_time(glue) / copies, 2)
            except ValueError as e:
                best["cublas_glue_us"] = repr(e)[:120]
            for bn in block_ns:
                for bk in block_ks:
                    for nwarps in warps:
                        def fn():
                            for w in ws:
                                gemv_triton(x, r, nw, 1e-5, w, silu, fused._check_gemv,
                                            block_n=bn, block_k=bk, num_warps=nwarps)
                        try:
                            us = 1e3 * graph_time(fn) / copies
                        except Exception as e:  # noqa: BLE001 - a config that cannot compile
                            print(name, bn, bk, nwarps, repr(e)[:200], flush=True)
                            continue
                        best["configs"].append({"block_n": bn, "block_k": bk,
                                                "num_warps": nwarps, "us": round(us, 2)})
            best["configs"].sort(key=lambda c: c["us"])
            best.update(best["configs"][0] if best["configs"] else {})
            rows.append(best)
            print(json.dumps({k: v for k, v in best.items() if k != "configs"}), flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def part_gemv_engine() -> list[dict]:
    sys.path.insert(0, os.path.dirname(__file__))
    from profile_step import make_model

    from eaglekv import Engine, EngineConfig, SamplingParams
    from eaglekv.kernels import fused
    rows = []
    with tempfile.TemporaryDirectory() as d:
        make_model(d)
        engines = {}
        for on in (False, True):
            fused.FUSE_GEMV = on
            engines[on] = Engine(EngineConfig(model=d, dtype="bfloat16", device="cuda",
                                              max_running_requests=4, max_total_tokens=8192,
                                              num_scheduler_steps=32))
        p = SamplingParams(max_new_tokens=256, ignore_eos=True)
        outs = {}
        for rep in range(3):
            for on, e in engines.items():
                fused.FUSE_GEMV = on
                torch.cuda.synchronize()
                t = time.perf_counter()
                o = e.generate([[1, 2, 3, 4, 5, 6, 7, 8]], p)
                torch.cuda.synchronize()
                outs[on] = o[0].token_ids
                if rep:
                    rows.append({"gemv": on, "tok_s": round(256 / (time.perf_counter() - t), 1)})
                    print(json.dumps(rows[-1]), flush=True)
        same = sum(a == b for a, b in zip(outs[False], outs[True]))
        rows.append({"greedy_tokens_equal": f"{same}/{len(outs[True])}"})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _gemv2_kernel():
    """A bare matrix-vector product y (1, N) = x (1, K) @ w (N, K)^T, nn.Linear's layout:
    program j reads BLOCK_N whole weight rows in BLOCK_K chunks (the loop software-pipelined
    `num_stages` deep), or in one K_PAD-wide tile when BLOCK_K >= K. No prologue, no
    epilogue: the question is only whether any Triton tiling beats cuBLAS at M = 1."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        j = tl.program_id(0)
        n = (j * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        nm = n < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            x = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :],
                        other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=nm)
    return kernel


def gemv2(kernel, x, w, y, block_n: int, block_k: int, num_warps: int, num_stages: int):
    N, K = w.shape
    kernel[(-(-N // block_n),)](x, w, y, N, K, BLOCK_N=block_n, BLOCK_K=block_k,
                               num_warps=num_warps, num_stages=num_stages)
    return y


GEMV2_CONFIGS = [(bn, bk, nw, st) for bn in (4, 8, 16, 32) for bk in (256, 1024)
                 for nw in (2, 4) for st in (1, 3)]


def part_gemv2() -> list[dict]:
    """The bare gemv (`_gemv2_kernel`) over its tilings against cuBLAS (`F.linear`, the same
    (N, K) weights) at M = 1 on the decode matmuls, each over enough weight copies to stream
    from HBM, in one CUDA graph; checked against cuBLAS's result first."""
    import torch.nn.functional as F
    kernel = _gemv2_kernel()
    rows = []
    for name, (K, N) in SHAPES.items():
        nbytes = K * N * 2
        copies = max(2, min(64, -(-400_000_000 // nbytes)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        ys = [torch.empty(1, N, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]

        def cublas():
            for w in ws:
                F.linear(x, w)
        row = {"shape": name, "K": K, "N": N, "M": 1,
               "cublas_us": round(1e3 * graph_time(cublas) / copies, 2), "configs": []}
        ref = F.linear(x, ws[0]).float()
        for bn, bk, nw, st in GEMV2_CONFIGS:
            if bk > 2 * triton_next_pow2(K) or bn * bk > 32768:
                continue
            try:
                y = gemv2(kernel, x, ws[0], ys[0], bn, bk, nw, st).float()
                err = float((y - ref).abs().max() / ref.abs().max())

                def fn():
                    for w, yy in zip(ws, ys):
                        gemv2(kernel, x, w, yy, bn, bk, nw, st)
                us = 1e3 * graph_time(fn) / copies
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile
                print(name, bn, bk, nw, st, repr(e)[:160], flush=True)
                continue
            row["configs"].append({"block_n": bn, "block_k": bk, "num_warps": nw,
                                   "num_stages": st, "us": round(us, 2), "rel_err": err})
        row["configs"].sort(key=lambda c: c["us"])
        row["best"] = row["configs"][0] if row["configs"] else None
        row["TBps_cublas"] = round(nbytes / (row["cublas_us"] * 1e-6) / 1e12, 3)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "configs"}), flush=True)
        del ws, ys
        torch.cuda.empty_cache()
    return rows


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--parts", default="matmul,attention,chain")
    a = ap.parse_args()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "PYTHONPATH=. python3 bench/explore_h200.py " + " ".join(sys.argv[1:])}
    for part in a.parts.split(","):
        t = time.time()
        res[part] = globals()[f"part_{part}"]()
        print(f"# {part}: {time.time() - t:.0f} s", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "explore_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
