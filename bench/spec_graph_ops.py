"""Device ops of one captured greedy EAGLE step (`SpecStepGraphs._forward`), by phase: what
the CUDA graph of the step replays, counted on the CPU.

The step graph is built with `capture=False` on a tiny random Llama with a random EAGLE head
(Triton backend under the interpreter), so its forward runs eagerly over the same static
buffers a replay reads, and a TorchDispatchMode counts the ATen ops that reach a kernel
(views and metadata ops excluded, as in `bench/spec_step_ops.py`), attributed to the phase
that issued them: the draft tables, the draft loop, the verify tree, the verify table, the
target forward, the greedy pick, acceptance, the path guard, the committed tokens, the KV
moves, the window draft extend, the host block. Triton launches (attention, fused kernels,
the guards) are counted apart, by kernel name. Ops, not time: on an H100 a kernel of the
captured step costs ~1.2-1.5 us (bench/results/gpu_bench_h100_20261205d_default_pdl.json,
S5's step profile). Two commits compare without a GPU.

    python bench/spec_graph_ops.py [--shapes S5K1N6,S3K1N4,S4K2N8] [--batch 1]
        [--algorithm eagle|eagle3] [--out F.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("EAGLEKV_TRITON_ON_CPU", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import eaglekv  # noqa: F401,E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from eaglekv import SamplingParams  # noqa: E402
from eaglekv.speculative import graphs as sg  # noqa: E402
from helpers import make_tiny, spec, tiny_engine  # noqa: E402
from spec_step_ops import _NO_KERNEL, write_result  # noqa: E402


INTERPRETER = "(inside an interpreted Triton launch)"


class PhaseCounter(TorchDispatchMode):
    """ATen ops by the innermost phase open when they run."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, Counter] = {}
        self.stack = ["other"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.ops.setdefault(self.stack[-1], Counter())[name] += 1
        return func(*args, **(kwargs or {}))


def _phase(counter: PhaseCounter, name: str, fn):
    def run(*a, **k):
        counter.stack.append(name)
        try:
            return fn(*a, **k)
        finally:
            counter.stack.pop()
    return run


def measure(tiny: Path, S: int, K: int, N: int, batch: int, steps: int,
            algorithm: str = "eagle") -> dict:
    e = tiny_engine(tiny, max_running_requests=max(batch, 2), attention_backend="triton",
                    max_context_len=128, speculative=spec(algorithm, S, K, N),
                    max_total_tokens=batch * 300 + 256)
    w = e.runner
    w.slots.hold_both = True
    w.step_graphs = graphs = sg.SpecStepGraphs(w, max(batch, 2), progress=False,
                                               capture=False)
    w.chain_steps = 1
    sp = SamplingParams(max_new_tokens=100, ignore_eos=True)
    reqs = [e.add_request([5, 17, 42, i % 200 + 1], sp) for i in range(batch)]
    while any(not r.output_ids for r in reqs):
        e.step()
    e.step()
    counter = PhaseCounter()
    launches = Counter()
    res = w.res
    patches = [(w.slots, "write_draft_tables", "draft tables"), (w.loop, "run", "draft loop"),
               (sg, "verify_tree", "verify tree"), (w.slots, "write_verify_table", "verify table"),
               (res.model, "forward_tokens", "target forward"),
               (sg, "greedy_pick", "greedy pick"), (sg, "greedy_accept", "accept"),
               (sg, "guard_path", "path guard"), (res.kv_pool, "move_kv", "kv moves"),
               (w, "window_forward", "window draft extend")]
    undo = []
    for obj, attr, name in patches:
        was = getattr(obj, attr)
        undo.append((obj, attr, was, attr in vars(obj)))
        setattr(obj, attr, _phase(counter, name, was))
    from eaglekv.core import VerifyResult
    committed = VerifyResult.committed_tokens
    VerifyResult.committed_tokens = _phase(counter, "committed tokens", committed)
    from triton.runtime.interpreter import InterpretedFunction
    run_was = InterpretedFunction.run

    def counted_run(self, *a, **k):        # the interpreter's own tensor moves: not counted
        launches[(counter.stack[-1], self.fn.__name__)] += 1
        counter.stack.append(INTERPRETER)
        try:
            return run_was(self, *a, **k)
        finally:
            counter.stack.pop()
    InterpretedFunction.run = counted_run
    forward = graphs._forward
    done = 0
    try:
        def fwd(b):
            nonlocal done
            done += 1
            with counter:
                return forward(b)
        graphs._forward = fwd
        for _ in range(steps):
            e.step()
    finally:
        graphs._forward = forward
        InterpretedFunction.run = run_was
        VerifyResult.committed_tokens = committed
        for obj, attr, was, own in reversed(undo):
            if own:
                setattr(obj, attr, was)
            else:
                delattr(obj, attr)
    assert done == steps, f"{done} step-graph forwards in {steps} engine steps"
    counter.ops.pop(INTERPRETER, None)
    by_phase = {p: sum(c.values()) / steps for p, c in counter.ops.items()}
    tri = Counter()
    for (p, k), n in launches.items():
        tri[p] += n / steps
    return {"shape": f"S{S}K{K}N{N}", "algorithm": algorithm, "batch": batch, "steps": steps,
            "aten_ops_per_step": sum(by_phase.values()),
            "triton_launches_per_step": sum(tri.values()),
            "aten_ops_by_phase": dict(sorted(by_phase.items(), key=lambda x: -x[1])),
            "triton_launches_by_phase": dict(tri),
            "top_ops_by_phase": {p: {k: v / steps for k, v in c.most_common(8)}
                                 for p, c in counter.ops.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S5K1N6,S3K1N4,S4K2N8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--algorithm", default="eagle", choices=["eagle", "eagle3"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        # EAGLE-3 captures 3 layers: its default ids need a target of at least 7
        make_tiny(Path(d), **({"num_hidden_layers": 8} if args.algorithm == "eagle3" else {}))
        for s in args.shapes.split(","):
            S, rest = s[1:].split("K")
            K, N = rest.split("N")
            r = measure(Path(d), int(S), int(K), int(N), args.batch, args.steps, args.algorithm)
            rows.append(r)
            print(f"{args.algorithm} {r['shape']} b{args.batch}: "
                  f"{r['aten_ops_per_step']:.0f} ATen ops + "
                  f"{r['triton_launches_per_step']:.0f} Triton launches a step; by phase: "
                  + ", ".join(f"{p} {n:.0f}" for p, n in r["aten_ops_by_phase"].items()),
                  flush=True)
    write_result("bench/spec_graph_ops.py", rows, args.out)


if __name__ == "__main__":
    main()
