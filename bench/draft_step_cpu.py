"""One draft step against one target decode step, batch 1, on this machine (issue 14: with the
reduced vocabulary a draft step should cost <= 10% of a target decode step on the CPU).

Times, inside real generations, every target forward of one token (plain decoding) and every
draft decode step (`drafter.decode`: the head's forward plus spreading its logits over the
target vocabulary) of a chain S5/K1/N6 run; prints medians and the ratio, writes JSON.
    python bench/draft_step_cpu.py --draft DIR [--spec eagle3] [--out bench/results/x.json]
"""

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import eaglekv  # noqa: F401  (before numpy loads: OpenBLAS's threads sleep, eaglekv/__init__)
import torch

from eaglekv import Engine, EngineConfig, SamplingParams
from eaglekv.config import SpecConfig


def timed(obj, name, sink, keep=lambda *a, **k: True):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        if keep(*a, **k):
            sink.append(time.perf_counter() - t)
        return out
    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--spec", default="eagle3")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    prompt = "Explain how a refrigerator keeps food cold."
    sp = SamplingParams(max_new_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    plain = Engine(EngineConfig(model=a.model, max_total_tokens=4096))
    target_steps: list[float] = []
    timed(plain.runner.res.model, "forward", target_steps,
          keep=lambda batch, *x, **k: batch.num_tokens == 1)
    ids = plain.apply_chat_template([{"role": "user", "content": prompt}])
    plain.generate([ids], sp)                                  # warm-up
    target_steps.clear()
    plain.generate([ids], sp)
    spec = Engine(EngineConfig(model=a.model, max_total_tokens=4096, speculative=SpecConfig(
        algorithm=a.spec, draft_model=a.draft, num_steps=5, topk=1, num_draft_tokens=6)))
    draft_steps: list[float] = []
    timed(spec.runner.drafter, "decode", draft_steps)
    spec.generate([ids], sp)
    draft_steps.clear()
    spec.generate([ids], sp)
    t, d = statistics.median(target_steps), statistics.median(draft_steps)
    draft = spec.runner.drafter.model
    cfg = draft.cfg
    ids = getattr(draft, "vocab_ids", None)        # EAGLE-1/2 with draft_vocab.json
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
           "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
           "draft": a.draft, "algorithm": a.spec,
           "draft_vocab": (len(ids) if ids is not None
                           else getattr(cfg, "draft_vocab_size", cfg.vocab_size)),
           "target_decode_step_ms": round(t * 1e3, 3), "draft_step_ms": round(d * 1e3, 3),
           "ratio": round(d / t, 4), "target_steps": len(target_steps),
           "draft_steps": len(draft_steps)}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
