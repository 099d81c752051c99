"""Device ops of one speculative step, by phase: what a CUDA graph of the step replays.

On the H200 a captured step's time at batch 1 is its kernel count times ~2-3 us (each kernel's
own time plus the ~0.7 us gap between kernels; `bench/profile_step.py`), and the profile of an
S3/K1/N4 step (bench/results/profile_step_h200_after_stepgraph.json) shows ~330 of its 629
kernels outside the model's layers: top-k selects, fills, aranges, gathers, copies. This counts
the ATen ops that reach a backend kernel (a TorchDispatchMode sees every op after
decomposition, as the CUDA graph would record it) in the draft loop (`DraftLoop.run`), and in
the whole step, on the CPU with a tiny random Llama and a random EAGLE head, so two commits can
be compared without a GPU. A count, not a timing.

    python bench/spec_step_ops.py [--shapes S3K1N4,S5K1N6,S4K2N8] [--batch 1] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import eaglekv  # noqa: F401  (before numpy loads: OpenBLAS's threads sleep, eaglekv/__init__)
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from eaglekv import SamplingParams  # noqa: E402
from eaglekv.speculative import draft_loop  # noqa: E402
from helpers import make_tiny, spec, tiny_engine  # noqa: E402

# views and metadata ops launch no kernel
_NO_KERNEL = {"view", "_unsafe_view", "expand", "reshape", "as_strided", "slice", "select",
              "unsqueeze", "squeeze", "t", "transpose", "permute", "alias", "detach",
              "split", "split_with_sizes", "unbind", "_reshape_alias", "lift_fresh", "empty",
              "empty_like", "empty_strided", "numpy_T", "sym_size", "sym_stride", "is_same_size",
              "to", "resolve_conj", "resolve_neg"}   # `to` to its own dtype returns self


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def measure(tiny: Path, S: int, K: int, N: int, batch: int, steps: int) -> dict:
    e = tiny_engine(tiny, max_running_requests=max(batch, 2),
                    speculative=spec("eagle", S, K, N), max_total_tokens=batch * 600 + 256)
    sp = SamplingParams(max_new_tokens=400, ignore_eos=True)
    reqs = [e.add_request([5, 17, 42, i % 200 + 1], sp) for i in range(batch)]
    while any(not r.output_ids for r in reqs):
        e.step()
    e.step()
    draft, step = Counter(), Counter()
    run = draft_loop.DraftLoop.run

    def counted(self, *a, **k):
        with OpCounter() as c:
            out = run(self, *a, **k)
        draft.update(c.ops)
        return out

    draft_loop.DraftLoop.run = counted
    try:
        for _ in range(steps):
            with OpCounter() as c:
                e.step()
            step.update(c.ops)
    finally:
        draft_loop.DraftLoop.run = run
    return {"shape": f"S{S}K{K}N{N}", "batch": batch, "steps": steps,
            "draft_loop_ops_per_step": sum(draft.values()) / steps,
            "step_ops_per_step": sum(step.values()) / steps,
            "draft_loop_top_ops": {k: v / steps for k, v in draft.most_common(10)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S3K1N4,S5K1N6,S4K2N8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        make_tiny(Path(d))
        for s in args.shapes.split(","):
            S, rest = s[1:].split("K")
            K, N = rest.split("N")
            rows.append(measure(Path(d), int(S), int(K), int(N), args.batch, args.steps))
            r = rows[-1]
            print(f"{r['shape']} b{args.batch}: draft loop {r['draft_loop_ops_per_step']:.0f} "
                  f"ops, whole step {r['step_ops_per_step']:.0f} ops", flush=True)
    write_result("bench/spec_step_ops.py", rows, args.out)


def write_result(script: str, rows: list, out: str | None) -> None:
    """The rows with the date, the commit and the command, as JSON at `out` (if given)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": "cpu",
           "torch": torch.__version__, "commit": commit,
           "command": f"python {script} " + " ".join(sys.argv[1:]), "rows": rows}
    if out:
        Path(out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
