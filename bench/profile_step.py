"""The step profile to optimise against (issue 13's "before"): for plain decoding and EAGLE,
per engine step at batch sizes B, the number of device kernels (and per target layer), the
device time they take, and the host wall time of the step; for EAGLE also the runner's
per-phase host time (draft, verify, accept, extend). The model has SmolLM2-135M's shape with
random weights (nothing to load), the draft is a random EAGLE head (its accept length is not
the point: the cost of a step is).

    PYTHONPATH=. python3 bench/profile_step.py OUT_DIR [--dtype bfloat16] [--batches 1,16]

Writes profile_step_<device>.json to OUT_DIR.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import eaglekv  # noqa: F401  (before numpy loads: OpenBLAS's threads sleep, eaglekv/__init__)
import torch
from torch.profiler import ProfilerActivity, profile

from eaglekv import Engine, EngineConfig, SamplingParams
from eaglekv.config import SpecConfig

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0)


def make_model(path: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", **SMOLLM2)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def profile_mode(model: str, dtype: str, device: str, B: int, spec: SpecConfig | None,
                 steps: int = 20) -> dict:
    engine = Engine(EngineConfig(model=model, dtype=dtype, device=device,
                                 max_running_requests=max(B, 1),
                                 max_total_tokens=max(16384, B * 1600),
                                 speculative=spec or SpecConfig()))
    dev = engine.device
    # never reached here: 4 + 25 engine steps of the longest decode chain (32 tokens)
    params = SamplingParams(max_new_tokens=1500, ignore_eos=True)
    reqs = [engine.add_request([1 + i, 2, 3, 4, 5, 6, 7, 8], params) for i in range(B)]
    while any(len(r.output_ids) < 4 for r in reqs):   # prefill done, decoding (warm)
        engine.step()
    worker = engine.worker
    if worker is not None:
        worker.reset_stats()
    walls = []
    for _ in range(steps):                          # host wall per step, device synced
        sync(dev)
        t = time.perf_counter()
        engine.step()
        sync(dev)
        walls.append(time.perf_counter() - t)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    n_prof = 5
    sync(dev)
    with profile(activities=acts) as prof:
        for _ in range(n_prof):
            engine.step()
        sync(dev)
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    out = {"batch": B, "mode": "plain" if spec is None else
           f"eagle S{spec.num_steps}/K{spec.topk}/N{spec.num_draft_tokens} (random head)",
           "host_wall_ms_per_step": {"median": 1e3 * statistics.median(walls),
                                     "min": 1e3 * min(walls)},
           "kernels_per_step": len(kernels) / n_prof,
           "kernels_per_target_layer": len(kernels) / n_prof / engine.model_config.num_layers,
           "device_ms_per_step": sum(getattr(k, "device_time_total", 0) or k.cuda_time_total
                                             for k in kernels) / 1e3 / n_prof}
    if worker is not None:
        st = worker.stats
        v = max(st.verify_steps, 1)
        out["host_ms_per_verify_step_by_phase"] = {k: 1e3 * x / v for k, x in
                                                   worker.timings.items()}
        out["accept_length_mean"] = st.accept_length_mean
    top, us = {}, {}
    for k in kernels:
        top[k.name] = top.get(k.name, 0) + 1
        us[k.name] = us.get(k.name, 0.0) + (getattr(k, "device_time_total", 0)
                                            or k.cuda_time_total)
    out["kernel_names_per_step"] = {n: c / n_prof for n, c in
                                    sorted(top.items(), key=lambda x: -x[1])[:15]}
    out["kernel_us_per_step"] = {n[:90]: round(t / n_prof, 2) for n, t in
                                 sorted(us.items(), key=lambda x: -x[1])[:20]}
    for r in reqs:
        engine.abort(r)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default="1,16")
    args = p.parse_args()
    if args.device == "cpu" and args.dtype == "bfloat16":
        args.dtype = "float32"
    rows = []
    with tempfile.TemporaryDirectory() as d:
        make_model(d)
        for B in [int(x) for x in args.batches.split(",")]:
            for spec in (None, SpecConfig(algorithm="eagle", draft_model="random", num_steps=3,
                                          topk=1, num_draft_tokens=4)):
                rows.append(profile_mode(d, args.dtype, args.device, B, spec))
                print(json.dumps({k: v for k, v in rows[-1].items()
                                  if k != "kernel_names_per_step"}), flush=True)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": dev, "torch": torch.__version__, "dtype": args.dtype,
              "model": "SmolLM2-135M shape, random weights",
              "command": "PYTHONPATH=. python3 bench/profile_step.py " + " ".join(sys.argv[1:]),
              "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    name = "h200" if "H200" in dev else args.device
    with open(os.path.join(args.out, f"profile_step_{name}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
