"""Data made by the target (issue 14): the target writes the prompts, then answers them.

1. Prompts (prompt_writer.py): the target writes questions and instructions from varied seed
   topics, kinds chat, explanation, lists, code, math, multi_turn and raw; the held-out set is
   split by topic (never seen in training, not even as a near-duplicate).
2. Responses (`generate_responses`): `eaglekv.engine.Engine` with plain decoding (CUDA graphs
   and multi-step decode chains on CUDA), many requests at once (feeder.py), greedy and
   sampled (T=0.7, top-p 0.95), to EOS or max_new. Greedy and sampled requests are queued in
   blocks so a batch is mostly all-greedy, which lets the engine run its decode chains. A
   multi_turn prompt, once answered, gets a follow-up written by the target and a second
   answer on the 2-turn conversation (the chat template's).
3. A time budget: no new request starts once the ones running could not finish in time; at
   the deadline what still runs is aborted and dropped; what finished is a valid dataset.
4. Stored compactly (seqstore.py: uint16 ids in safetensors shards under 15 MiB, a manifest)
   with the held-out prompts as JSON for the eval tools.

`python -m eaglekv.training.selfgen --device cpu --n-prompts 8 --budget 20 --max-new 16 --out
/tmp/sg` rehearses on the CPU; `eaglekv train-draft gen-data ...` takes the same options
(`add_gen_data_arguments`, `run_gen_data`).
"""

from __future__ import annotations

import argparse
import datetime
import math
import random
import sys
import time
from collections import deque
from pathlib import Path

import torch

from eaglekv.config import SamplingParams
from eaglekv.training.feeder import Feeder, Job, default_capacity, progress_bar, sampled
from eaglekv.training.prompt_writer import (KIND_MIX, clean_prompt, held_out_topics, norm_key,
                                            user_message, write_prompts)
from eaglekv.training.seqstore import (KINDS, MAX_FILE_BYTES, load_gen_data, save_gen_data,
                                       write_heldout_prompts)

__all__ = ["KINDS", "KIND_MIX", "write_prompts", "generate_responses", "save_gen_data",
           "load_gen_data", "write_heldout_prompts", "add_gen_data_arguments", "run_gen_data",
           "main"]

FOLLOW_UP = ("Conversation:\nUser: What is the capital of Australia?\nAssistant: The capital of "
             "Australia is Canberra, not Sydney as many people think.\nUser's follow-up: Why was "
             "Canberra chosen instead of Sydney?\n\nConversation:\nUser: How do I make my tomato "
             "plants grow faster?\nAssistant: Give them full sun, water deeply twice a week and "
             "feed them a balanced fertilizer.\nUser's follow-up: How much fertilizer should I "
             "use for each plant?\n\nConversation:\nUser: {q}\nAssistant: {a}\nUser's follow-up:")


# ---- the target answers the prompts -------------------------------------------------------------
def _blocks(a: list, b: list, size: int) -> list:
    """a and b interleaved in blocks of `size`: [a0..] [b0..] [a1..] ..."""
    out = []
    for i in range(0, max(len(a), len(b)), size):
        out += a[i:i + size] + b[i:i + size]
    return out


def generate_responses(engine, prompts: list[dict], *, max_new: int = 256,
                       greedy_frac: float = 0.3, temperature: float = 0.7, top_p: float = 0.95,
                       seed: int = 0, deadline: float = math.inf,
                       write_temperature: float = 0.9, capacity: int | None = None,
                       progress: bool = True) -> tuple[list[dict], dict]:
    """The target's responses to `prompts` ({"ids", "kind", "chat", "held_out"}; multi_turn
    ones also "text"), a `greedy_frac` share greedy, the rest sampled at `temperature`/`top_p`,
    each to EOS (kept) or `max_new`. A multi_turn prompt gives two sequences: its answer, then
    the answer to the 2-turn conversation [user, assistant, the user's follow-up written by
    the target]. Returns (sequences {"ids", "n_prompt", "greedy", "chat", "kind",
    "held_out", "text" or "conversation"}, stats)."""
    rng = random.Random(seed + 1)
    cap = default_capacity(engine, capacity)
    feeder = Feeder(engine, cap, deadline, max_new,
                    progress_bar(len(prompts), "responses", progress))
    seqs, later, notes = [], deque(), {"follow_ups_written": 0, "follow_ups_rejected": 0}

    def params(greedy):
        return (SamplingParams(max_new_tokens=max_new) if greedy else
                sampled(temperature, rng, top_p=top_p, max_new_tokens=max_new))

    def answered(p, greedy, req):
        key = "conversation" if "conversation" in p else "text"
        seqs.append({"ids": list(req.prompt_ids) + list(req.output_ids),
                     "n_prompt": len(req.prompt_ids), "greedy": greedy, "chat": p["chat"],
                     "kind": p["kind"], "held_out": p["held_out"], key: p[key]})
        feeder.bar.update(1)
        if p["kind"] == "multi_turn" and "conversation" not in p:
            answer = req.refresh_text().strip()
            short = " ".join(answer.split())[:300]
            ids = engine.encode(FOLLOW_UP.format(q=p["text"], a=short))
            later.append(Job(ids, sampled(write_temperature, rng, max_new_tokens=48,
                                          stop=("\n",)),
                             lambda r: follow_up(p, greedy, answer, r)))

    def follow_up(p, greedy, answer, req):
        text = clean_prompt(req.refresh_text(), "chat")
        if text is None or norm_key(text) == norm_key(p["text"]):
            notes["follow_ups_rejected"] += 1
            return
        notes["follow_ups_written"] += 1
        conv = [*user_message(p["text"]), {"role": "assistant", "content": answer},
                *user_message(text)]
        p2 = {**p, "conversation": conv}
        feeder.bar.total += 1
        later.append(Job(engine.apply_chat_template(conv), params(greedy),
                         lambda r: answered(p2, greedy, r)))

    def job(p, greedy):
        return Job(list(p["ids"]), params(greedy), lambda r: answered(p, greedy, r))

    # kinds shuffled together, so a budget cut keeps the mix (on the H200 the multi_turn
    # prompts, queued first, took 70% of a cut run); greedy and sampled in separate blocks
    flags = [rng.random() < greedy_frac for _ in prompts]
    rest = list(zip(prompts, flags))
    rng.shuffle(rest)
    for j in _blocks([job(p, g) for p, g in rest if g],
                     [job(p, g) for p, g in rest if not g], 2 * cap):
        feeder.push(j)

    def refill():    # the follow-ups and second turns go in whole batches, or at the end
        if len(later) >= engine.config.max_running_requests or (not feeder.queue and later):
            feeder.queue.extendleft(reversed(later))
            later.clear()

    feeder.run(refill)
    feeder.bar.close()
    return seqs, {**feeder.stats(), **notes,
                  "response_tokens": sum(len(s["ids"]) - s["n_prompt"] for s in seqs)}


# ---- the stage: options, run, rehearsal ---------------------------------------------------------
def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--out", required=True, help="directory for the shards, manifest.json and "
                   "heldout_prompts.json")
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--n-prompts", type=int, default=4000, help="prompts to write (held-out "
                   "included; a multi_turn one gives two sequences)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole stage, "
                   "model load included; the data is saved after it")
    p.add_argument("--max-new", type=int, default=256, help="response tokens at most")
    p.add_argument("--greedy-frac", type=float, default=0.3)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--write-temperature", type=float, default=0.9)
    p.add_argument("--write-max-new", type=int, default=100)
    p.add_argument("--write-frac", type=float, default=0.5,
                   help="share of the budget left after loading that writing may take")
    p.add_argument("--heldout-frac", type=float, default=0.1, help="share of topics held out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="default: 256 on cuda, 16 on cpu")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV slots (default: "
                   "the engine's share of free memory on cuda, running x (max-new + 768) on cpu)")
    p.add_argument("--max-file-mib", type=float, default=MAX_FILE_BYTES / 2 ** 20)
    p.add_argument("--no-progress", dest="progress", action="store_false")


def add_gen_data_arguments(subparsers) -> argparse.ArgumentParser:
    """The `gen-data` stage on a subparsers object (`eaglekv train-draft gen-data`)."""
    p = subparsers.add_parser("gen-data", help="the target writes prompts and answers them "
                              "with the engine (issue 14's data)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_options(p)
    return p


def _check(args) -> None:
    for name, lo, hi in (("greedy_frac", 0, 1), ("heldout_frac", 0, 0.5), ("write_frac", 0, 1),
                         ("top_p", 1e-9, 1)):
        v = getattr(args, name)
        if not lo <= v <= hi:
            raise SystemExit(f"--{name.replace('_', '-')}={v} must be in [{lo}, {hi}]")
    for name in ("n_prompts", "max_new", "write_max_new"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")


def run_gen_data(args, command_line: str | None = None, engine=None) -> int:
    """Load the target in the engine, write the prompts, answer them, save: shards +
    manifest.json + heldout_prompts.json under args.out. Prints a one-line summary. `engine`:
    one already built (tests), used as it is (args.model, device, dtype are then unused)."""
    from eaglekv.config import EngineConfig
    from eaglekv.engine import Engine
    _check(args)
    t0 = time.monotonic()
    deadline = t0 + args.budget
    dev = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available()
                                                     else "cpu")
    cuda = torch.device(dev).type == "cuda"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32")
    running = args.max_running_requests or (256 if cuda else 16)
    # on the CPU the engine's default KV pool (a share of free memory) takes seconds to zero;
    # a second turn holds ~ max_new + 600 tokens
    kv = args.max_total_tokens or (None if cuda else running * (args.max_new + 768))
    if engine is None:
        engine = Engine(EngineConfig(model=args.model, dtype=dtype, device=dev, seed=args.seed,
                                     max_running_requests=running, max_total_tokens=kv))
    cfg = engine.config
    dev, dtype, running, cuda = cfg.device, cfg.dtype, cfg.max_running_requests, \
        engine.device.type == "cuda"
    load_s = time.monotonic() - t0
    print(f"[{load_s:6.1f}s] engine on {dev} ({dtype}, {running} running, cuda graphs "
          f"{cfg.cuda_graphs})", file=sys.stderr, flush=True)
    write_deadline = time.monotonic() + args.write_frac * max(0.0, deadline - time.monotonic())
    prompts, wstats = write_prompts(engine, args.n_prompts, heldout_frac=args.heldout_frac,
                                    seed=args.seed, deadline=write_deadline,
                                    temperature=args.write_temperature,
                                    max_new=args.write_max_new, progress=args.progress)
    seqs, rstats = generate_responses(engine, prompts, max_new=args.max_new,
                                      greedy_frac=args.greedy_frac,
                                      temperature=args.temperature, top_p=args.top_p,
                                      seed=args.seed, deadline=deadline,
                                      write_temperature=args.write_temperature,
                                      progress=args.progress)
    gen_s = time.monotonic() - t0 - load_s
    out = Path(args.out)
    held = [p for p in prompts if p["held_out"]]
    held += [{**s, "ids": s["ids"][:s["n_prompt"]]} for s in seqs
             if s["held_out"] and "conversation" in s]
    write_heldout_prompts(out / "heldout_prompts.json", held)
    kinds = {k: sum(p["kind"] == k for p in prompts) for k in KINDS}
    manifest = {
        "command": command_line or "python -m eaglekv.training.selfgen " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(torch.device(dev)) if cuda else "cpu",
        "torch": torch.__version__, "model": cfg.model, "dtype": dtype, "seed": args.seed,
        "budget_s": args.budget, "load_s": round(load_s, 2), "generate_s": round(gen_s, 2),
        "prompts": {"asked": args.n_prompts, "written": len(prompts), "by_kind": kinds,
                    "held_out": len(held), "heldout_frac": args.heldout_frac,
                    "held_out_topics": len(held_out_topics(args.heldout_frac))},
        "generation": {"engine": "eaglekv plain decoding", "max_new": args.max_new,
                       "greedy_frac": args.greedy_frac, "temperature": args.temperature,
                       "top_p": args.top_p, "write_temperature": args.write_temperature,
                       "write_max_new": args.write_max_new, "max_running_requests": running,
                       "cuda_graphs": cfg.cuda_graphs, "decode_steps": cfg.decode_steps,
                       "eos_ids": sorted(engine.eos_ids)},
        "write": wstats, "responses": rstats,
        "tok_s": round((wstats["output_tokens"] + rstats["output_tokens"]) / gen_s, 1)
        if gen_s > 0 else 0.0}
    files = save_gen_data(out, seqs, manifest, max_file_bytes=int(args.max_file_mib * 2 ** 20),
                          eos_ids=engine.eos_ids)
    print(f"[{time.monotonic() - t0:6.1f}s] {len(prompts)} prompts ({len(held)} held-out), "
          f"{len(seqs)} sequences, {rstats['response_tokens']} response tokens; writing "
          f"{wstats['tok_s']} tok/s, responses {rstats['tok_s']} tok/s; {len(files)} shards "
          f"-> {out}", flush=True)
    if len(files) + 2 > 8:
        print(f"note: {len(files)} shards + manifest.json + heldout_prompts.json are more than "
              f"the 8 files a GPU command returns; lower --n-prompts or --max-new, or fetch "
              f"them in two commands", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eaglekv.training.selfgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_options(p)
    return run_gen_data(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
