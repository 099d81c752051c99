"""`eaglekv bench`: HF transformers `generate` vs eaglekv on the same model, side by side.

Both run greedy, batch 1, the same prompt and the same number of new tokens (EOS ignored),
alternating run by run so that machine noise hits both alike; the median of the repeats is
reported. Output is JSON (stdout and, with --out, a file).
"""

from __future__ import annotations

import datetime
import os
import json
import platform
import statistics
import time

from contextlib import contextmanager

import torch

from eaglekv.config import EngineConfig, SamplingParams, SpecConfig
from eaglekv.engine import Engine
from eaglekv.model import cpu_blas

DEFAULT_PROMPT = "Write a short story about a robot who learns to paint."


@contextmanager
def gguf_parsed_once():
    """transformers' GGUF model loader parses the file twice (for the config, then for the
    weights: ~7 s each for SmolLM2, whose 49k-token vocabulary is ~300k fields) and builds
    gguf's tensor-name table once a module (~400 times, ~10 s): 29 s of a 31 s load on a
    2-core CPU. While this is open, `gguf.GGUFReader` returns one reader per file and
    `gguf.get_tensor_name_map` one table per (architecture, layers); both are read-only
    there, and the loader imports them from the gguf module at each call."""
    import gguf
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}
    maps: dict = {}

    def one_reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    def one_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map(arch, n_blocks)
        return maps[arch, n_blocks]
    gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, one_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def load_hf(model: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    from eaglekv.model.loader import resolve_model_path
    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        with gguf_parsed_once():
            hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                      dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return hf.to(device).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_hf(hf, ids: list[int], n: int, device: str) -> float:
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        _sync(device)
        t = time.perf_counter()
        out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync(device)
        dt = time.perf_counter() - t
    assert out.shape[1] - len(ids) == n
    return n / dt


def time_eaglekv(engine: Engine, ids: list[int], n: int, device: str) -> tuple[float, list[int]]:
    _sync(device)
    t = time.perf_counter()
    out = engine.generate([ids], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
    _sync(device)
    dt = time.perf_counter() - t
    assert len(out.token_ids) == n
    return n / dt, out.token_ids


def spec_summary(engine: Engine) -> dict:
    """Accept length and the per-verify-step split of the speculative engine's time; its
    shape, or for adaptive speculation (the default with the shipped heads) its candidate
    shapes and the engine steps per choice."""
    st, w = engine.spec_stats(), engine.worker
    steps = max(st.verify_steps, 1)
    policy = getattr(w, "policy", None)
    shape = ({"adaptive": True, "shapes": [s.label for s in policy.shapes],
              "choices": dict(sorted((st.choices or {}).items()))} if policy is not None else
             {"num_steps": w.S, "topk": w.K, "num_draft_tokens": w.N})
    return {"algorithm": engine.config.speculative.algorithm,
            "draft_model": engine.config.speculative.draft_model, **shape,
            "accept_length_mean": st.accept_length_mean,
            "accept_histogram": dict(sorted(st.accept_histogram.items())),
            "ms_per_verify_step": {k: 1e3 * v / steps for k, v in w.timings.items()}}


@contextmanager
def torch_threads(n: int | None):
    """Each engine runs with its own best thread setting (the setting is process-wide)."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_bench(model: str = "default", dtype: str = "float32", device: str = "cpu",
              new_tokens: int = 128, repeats: int = 3, prompt: str = DEFAULT_PROMPT,
              with_hf: bool = True, spec=None) -> dict:
    cfg = EngineConfig(model=model, dtype=dtype, device=device, max_running_requests=1,
                       max_total_tokens=4096)
    hf_threads = torch.get_num_threads()   # HF transformers as users run it: torch's default
    engine = Engine(cfg)
    ek_threads = torch.get_num_threads()   # what the eaglekv engine chose (model/llama.py)
    ids = engine.encode(prompt)
    spec_engine = None
    if spec is not None and spec.enabled:
        spec_engine = Engine(EngineConfig(**{**cfg.__dict__, "speculative": spec}))
    hf = load_hf(model, cfg.torch_dtype, device) if with_hf else None
    with torch_threads(ek_threads):
        time_eaglekv(engine, ids, 8, device)  # warm-up
        if spec_engine is not None:
            time_eaglekv(spec_engine, ids, 8, device)
    if hf is not None:
        with torch_threads(hf_threads):
            time_hf(hf, ids, 8, device)
    rows: dict[str, list[float]] = {"eaglekv": [], "eaglekv_spec": [], "hf_transformers": []}
    identical = True
    for _ in range(repeats):
        if hf is not None:
            with torch_threads(hf_threads):
                rows["hf_transformers"].append(time_hf(hf, ids, new_tokens, device))
        with torch_threads(ek_threads):
            tps, plain_ids = time_eaglekv(engine, ids, new_tokens, device)
        rows["eaglekv"].append(tps)
        if spec_engine is not None:
            if spec_engine.worker.stats.verify_steps:  # count the timed runs only
                spec_engine.worker.reset_stats()
            with torch_threads(ek_threads):
                tps, spec_ids = time_eaglekv(spec_engine, ids, new_tokens, device)
            rows["eaglekv_spec"].append(tps)
            identical &= spec_ids == plain_ids
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} "
                   f"{os.cpu_count()} cpus".strip(),
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "torch_threads": {"hf_transformers": hf_threads,
                                                        "eaglekv": ek_threads},
        "cpu_blas": cpu_blas.describe() if device == "cpu" else None,
        "model": model, "dtype": dtype, "batch": 1,
        "prompt_tokens": len(ids), "new_tokens": new_tokens, "repeats": repeats,
        "tokens_per_s": {k: statistics.median(v) for k, v in rows.items() if v},
        "runs": {k: v for k, v in rows.items() if v},
    }
    tps = result["tokens_per_s"]
    if hf is not None:
        result["speedup_vs_hf"] = tps["eaglekv"] / tps["hf_transformers"]
    if spec_engine is not None:
        result["speculative"] = spec_summary(spec_engine)
        result["speculative"]["greedy_tokens_identical_to_plain"] = identical
        result["speedup_spec_vs_plain"] = tps["eaglekv_spec"] / tps["eaglekv"]
    return result


def main(args, spec: SpecConfig | None = None) -> None:
    """`eaglekv bench`: `args` its parsed flags, `spec` the speculative config the CLI built from
    them (None: plain only), handed down so that this module never imports eaglekv.cli."""
    result = run_bench(args.model, args.dtype, args.device, args.new_tokens, args.repeats,
                       with_hf=not args.no_hf, spec=spec)
    result["command"] = args.command_line
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
