"""Host time of one engine step with the device work taken out: the captured forwards
(DecodeGraphs, SpecStepGraphs) are replaced by stubs that return fixed outputs, so what is
timed is the scheduler, the allocator, the packing of the graph inputs and the commit, i.e. the
part of a GPU step that no CUDA graph hides. Also counts the torch ops the host dispatches per
step outside the stubbed forward (each costs ~20-30 us of launch on the H200's host).

    python bench/host_step.py [--batches 1,4,16,64] [--steps 200] [--chain 8] [--context N]
                              [--modes "plain,eagle S5K1N6,eagle S5K1N6 chained"] [--out F.json]
    --context N: the requests first decode (untimed, the device stubbed) until each holds N
    tokens, so the timed steps are those of long contexts (a per-step cost that grows with
    the context shows there; the model's positions are widened to fit)
    modes: plain, "eagle S5K1N6[ chained]", "adaptive S5K1N6[ chained]" (adaptive over S5 and
    S3 with costs that always choose S5: the policy's host work on top of the fixed S5's)

A tiny random Llama on the CPU; the figures are this CPU's, for comparing commits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import eaglekv  # noqa: F401  (before numpy loads: OpenBLAS's threads sleep, eaglekv/__init__)
import torch  # noqa: E402

from eaglekv import SamplingParams  # noqa: E402
from eaglekv.cuda_graph import DecodeGraphs  # noqa: E402
from eaglekv.speculative.drafter import DraftOut  # noqa: E402
from eaglekv.speculative.graphs import SpecStepGraphs  # noqa: E402
from helpers import make_tiny, spec, tiny_engine  # noqa: E402
from host_step_ab import warm  # noqa: E402


def stub_decode(graphs: DecodeGraphs, vocab: int) -> None:
    logits = torch.zeros(graphs.buckets[-1], vocab)
    greedy = torch.tensor([[7, 1]] * graphs.buckets[-1])
    graphs._forward = lambda b: (logits[:b], greedy[:b])


def stub_spec(g: SpecStepGraphs, vocab: int, hidden: int) -> None:
    w, n = g.worker, g.buckets[-1]
    host = torch.tensor([[1, w.S] + [7] * (w.S + 1)] * n)
    out = DraftOut(torch.zeros(n, vocab), torch.zeros(n, hidden))
    g._forward = lambda b: (host[:b], DraftOut(out.logits[:b], out.hidden[:b]))


def count_ops(fn) -> Counter:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return Counter({e.key: e.count for e in prof.key_averages()
                    if e.key.startswith("aten::") and not e.key.startswith("aten::_")})


def context_limit(context: int, steps: int, chain: int) -> int:
    """The tiny model's positions for `--context`: the contexts, the timed steps, a margin."""
    return context + 8 * steps * chain + 512


def run(tiny: Path, mode: str, batch: int, steps: int, chain: int = 8, context: int = 0) -> dict:
    kw = dict(max_running_requests=max(batch, 2), attention_backend="triton",
              max_total_tokens=batch * (max(steps * 8, 512) + 64) + 256)
    if context:      # every request may run to the (widened) context limit
        kw["max_total_tokens"] = max(batch, 2) * (context_limit(context, steps, chain) + 64)
    if mode.startswith("adaptive"):     # S5 always the choice: the policy's own host work
        kw["speculative"] = dict(algorithm="eagle", draft_model="random", adaptive=True,
                                 shapes=((5, 1, 6), (3, 1, 4)))
    elif mode != "plain":
        kw["speculative"] = spec("eagle", 5, 1, 6)
    else:
        kw["num_scheduler_steps"] = chain
    e = tiny_engine(tiny, **kw)
    cfg = e.model_config
    if mode == "plain":
        e.runner.graphs = DecodeGraphs(e.model, e.backend, batch, e.max_context_len,
                                       progress=False, capture=False)
        stub_decode(e.runner.graphs, cfg.vocab_size)
    else:
        workers = (list(e.runner.workers.values()) if mode.startswith("adaptive")
                   else [e.runner])
        for w in workers:
            w.slots.hold_both = True
            w.step_graphs = SpecStepGraphs(w, batch, progress=False, capture=False)
            stub_spec(w.step_graphs, cfg.vocab_size, cfg.hidden_size)
            # "... chained": chains of up to `chain` whole-step replays, one sync (run_chain)
            w.chain_steps = chain if mode.endswith(" chained") else 1
        if mode.startswith("adaptive"):
            from eaglekv.speculative.adaptive import PLAIN, CostTable
            p = e.runner.policy
            p.costs = CostTable.fixed({PLAIN: 1.0, "S5K1N6": 1.1, "S3K1N4": 1.5})
            p.hold_spec = (chain if mode.endswith(" chained") else 1) - 1
            for name, value in p.CHAINED.items():
                setattr(p, name, value)
    hidden = [0.0]     # adaptive: the policy's work done while the device runs a replay
    if mode.startswith("adaptive"):
        w, inner = e.runner, e.runner._while_device

        def timed(*args):
            t0 = time.perf_counter()
            inner(*args)
            hidden[0] += time.perf_counter() - t0
        w._while_device = timed
    reqs = warm(e, batch, SamplingParams(max_new_tokens=e.max_context_len - 8, ignore_eos=True))
    while context and min(r.kv_len for r in reqs) < context:      # untimed: grow the contexts
        e.step()
    ops = count_ops(e.step)
    t = time.perf_counter()
    hidden[0] = 0.0
    n0 = sum(len(r.output_ids) for r in reqs)
    done = 0
    # a step makes at most this many tokens a request: stop before a request could finish
    # (the stubbed graphs write no req_to_token entries, so a finished request's release
    # would free slot 0)
    most = chain if mode == "plain" else 6 * (chain if mode.endswith(" chained") else 1)
    for _ in range(steps):
        if any(r.finished or r.params.max_new_tokens - len(r.output_ids) <= most for r in reqs):
            break
        e.step()
        done += 1
    dt = time.perf_counter() - t
    toks = sum(len(r.output_ids) for r in reqs) - n0
    return {"mode": mode, "batch": batch, "steps": done, "context": min(r.kv_len for r in reqs),
            "host_ms_per_step": 1e3 * dt / done, "host_us_per_token": 1e6 * dt / toks,
            # the part of it a GPU hides behind the replay (AdaptiveWorker._while_device)
            "hidden_ms_per_step": 1e3 * hidden[0] / done,
            "tokens_per_step": toks / done, "torch_ops_per_step": sum(ops.values()),
            "top_ops": dict(ops.most_common(12))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--chain", type=int, default=8,
                    help="plain: num_scheduler_steps; '... chained': speculative steps a chain")
    ap.add_argument("--modes", default="plain,eagle S5K1N6,eagle S5K1N6 chained")
    ap.add_argument("--context", type=int, default=0,
                    help="decode (untimed) until every request holds this many tokens first")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        make_tiny(Path(d), **({"max_position_embeddings": context_limit(
            a.context, a.steps, a.chain)} if a.context else {}))
        for b in [int(x) for x in a.batches.split(",")]:
            for mode in a.modes.split(","):
                r = run(Path(d), mode, b, a.steps, a.chain, a.context)
                rows.append(r)
                print(f"{mode:14s} b{b:<3d} {r['host_ms_per_step']:.3f} ms/step "
                      f"({r['hidden_ms_per_step']:.3f} hidden) "
                      f"{r['host_us_per_token']:.1f} us/token  {r['torch_ops_per_step']} ops/step")
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": f"host only, {platform.processor() or platform.machine()}",
           "command": "python " + " ".join(sys.argv), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
