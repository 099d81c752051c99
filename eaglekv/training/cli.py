"""Command-line glue of the draft trainer: `prompts` (CPU), then `train` (generate, extract
features, train, save, measure the chain accept). Run as `eaglekv train-draft ...` or
`python -m eaglekv.training.train_draft ...`; both take the options `add_arguments` defines.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import random
import sys
import time
from pathlib import Path

import torch

from eaglekv.training.cli_eagle3 import split_ids
from eaglekv.training.data import extract_features, generate, load_seqs, load_target, save_seqs
from eaglekv.training.eval import chain_accept
from eaglekv.training.head import head_for_target
from eaglekv.training.loop import train
from eaglekv.training.loss import target_embed_head
from eaglekv.training.prompts import build_prompts, tokenize_prompts

DESCRIPTION = ("Train a draft head for a target model: `gen-data` (the target writes prompts and "
               "answers them), then `train --algorithm eagle3` (EAGLE-3 with training-time test) or "
               "`--algorithm eagle` (EAGLE-1/2 by self-distillation).")
MODULE_COMMAND = "python -m eaglekv.training.train_draft"


def cmd_prompts(args) -> None:
    from eaglekv.model.loader import load_checkpoint
    tok = load_checkpoint(args.model, load_tokenizer=True).tokenizer
    prompts = tokenize_prompts(tok, build_prompts(args.n, args.seed, args.raw_frac))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(prompts))
    lens = [len(p["ids"]) for p in prompts]
    print(f"{len(prompts)} prompts, {sum(p['chat'] for p in prompts)} chat, "
          f"{min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.1f}) -> {args.out}")


def stored_seqs(args) -> list[dict]:
    """Sequences made earlier: `--data` (save_seqs) or `--data-dir` (gen-data; every store
    given, in order: their held-out sequences stay held out, since gen-data holds out the same
    topics whatever its seed)."""
    if args.data:
        return load_seqs(args.data)
    if args.data_dir:
        from eaglekv.training.seqstore import load_gen_data
        return [s for d in args.data_dir for s in load_gen_data(d, "all")]
    raise SystemExit("train --algorithm eagle3 needs --data or --data-dir (sequences made by "
                     "`eaglekv train-draft gen-data`)")


def cmd_train(args, command_line: str | None = None) -> None:
    """`command_line` is recorded in the log (default: this process's `python -m` form)."""
    from eaglekv.model.draft_checkpoint import save_eagle_draft
    T0 = time.time()
    if command_line is None:
        command_line = MODULE_COMMAND + " " + " ".join(sys.argv[1:])
    if args.algorithm == "eagle3":
        from eaglekv.training.cli_eagle3 import cmd_train_eagle3
        cmd_train_eagle3(args, stored_seqs(args), command_line,
                         lambda msg: print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True))
        return
    only3 = [flag for flag, given in (("--intermediate-size", args.intermediate_size is not None),
                                      ("--aux-layers", args.aux_layers is not None),
                                      ("--topk-weight", args.topk_weight != 0.0)) if given]
    if only3:
        raise SystemExit(f"{', '.join(only3)}: EAGLE-3 training only (--algorithm eagle3); the "
                         f"EAGLE-1/2 trainer would ignore them")
    if not (args.prompts or args.data or args.data_dir):
        raise SystemExit("train --algorithm eagle needs --prompts (to generate from), --data or "
                         "--data-dir")
    log = {"command": command_line,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}

    def out(msg):
        print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)

    dev = torch.device(args.device if args.device != "auto" else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
    log["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    log["torch"] = torch.__version__
    torch.backends.cuda.matmul.allow_tf32 = False
    model, cfg = load_target(args.model, dev, torch.float32)
    out(f"target loaded on {log['device']}")
    eos = sorted(set(cfg.eos_token_ids) | set(args.extra_eos))
    # 1. data
    if args.data or args.data_dir:
        seqs = stored_seqs(args)
        source = args.data or ", ".join(args.data_dir)
        out(f"reusing {len(seqs)} sequences from {source}")
        log["data_source"] = source
        prompts = []
    else:
        prompts = json.loads(Path(args.prompts).read_text())[:args.max_prompts]
        rng = random.Random(args.seed)
        rng.shuffle(prompts)
        n_greedy = int(len(prompts) * args.greedy_frac)
        gen_model = copy.deepcopy(model).to(torch.bfloat16) if args.gen_bf16 else model
        t = time.time()
        deadline = t + args.gen_budget
        seqs = generate(gen_model, prompts[:n_greedy], batch=args.gen_batch,
                        max_new=args.max_new, greedy=True, temperature=1.0, top_p=1.0, eos=eos,
                        pad=args.pad_id, deadline=t + args.gen_budget * args.greedy_frac)
        out(f"generated {len(seqs)} greedy")
        seqs += generate(gen_model, prompts[n_greedy:], batch=args.gen_batch,
                         max_new=args.max_new, greedy=False, temperature=args.temperature,
                         top_p=args.top_p, eos=eos, pad=args.pad_id, deadline=deadline)
        del gen_model
        log["generate_seconds"] = round(time.time() - t, 1)
        out(f"generated {len(seqs)} sequences in {log['generate_seconds']}s")
        if args.save_data:
            save_seqs(args.save_data, seqs)
    t = time.time()
    data = extract_features(model, seqs)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    log["feature_seconds"] = round(time.time() - t, 1)
    resp = [len(s["ids"]) - s["n_prompt"] for s in seqs]
    log["data"] = {"sequences": len(seqs), "tokens": data.num_tokens,
                   "response_tokens": sum(resp), "greedy": sum(s["greedy"] for s in seqs),
                   "chat": sum(s["chat"] for s in seqs), "prompts_offered": len(prompts),
                   "max_new_tokens": args.max_new, "temperature": args.temperature,
                   "top_p": args.top_p, "ended_with_eos": sum(s["ids"][-1] in eos for s in seqs),
                   "generate_dtype": "bfloat16" if args.gen_bf16 else "float32",
                   "feature_dtype": "float32"}
    out(f"features: {log['data']}")
    # 2. split: held-out prompts (every `eval_every`-th sequence), greedy ones for the chain
    train_ids, eval_ids = split_ids(seqs, args.eval_every)   # gen-data's held-out flags, if any
    chain_ids = [i for i in eval_ids if seqs[i]["greedy"]]
    embed, lm_head = target_embed_head(model)
    head, cfg_dict = head_for_target(cfg, seed=args.seed)
    head.to(dev)
    log["head_params"] = sum(p.numel() for p in head.parameters())
    log["recipe"] = {"lr": args.lr, "warmup": args.warmup, "schedule": "cosine over time budget",
                     "min_lr_frac": 0.1, "optimizer": "AdamW(0.9, 0.95), wd 0, clip 0.5",
                     "max_tokens_per_batch": args.max_tokens, "noise": args.noise,
                     "loss": "SmoothL1(g, f_next) + 0.1 * CE(softmax(head(f_next)), head(g))",
                     "amp_bf16": args.amp, "train_sequences": len(train_ids),
                     "eval_sequences": len(eval_ids), "chain_sequences": len(chain_ids)}
    budget = args.train_budget if args.deadline <= 0 else \
        min(args.train_budget, args.deadline - (time.time() - T0))
    res = train(head, embed, lm_head, data, train_ids, eval_ids, lr=args.lr,
                time_budget=budget, max_steps=args.max_steps, max_tokens=args.max_tokens,
                warmup=args.warmup, noise=args.noise, amp=args.amp, seed=args.seed,
                log_every=args.log_every, eval_every_s=args.eval_every_s, out=out)
    log.update(res)
    # 3. save (bf16, no embed_tokens), then the chain accept on the saved (bf16) weights
    sd = head.published_state_dict(torch.bfloat16)
    save_eagle_draft(args.out, cfg_dict, sd, fmt="safetensors")
    out(f"saved {args.out}")
    head.load_state_dict({k: v.float() for k, v in sd.items()})
    if chain_ids:
        for key, resp in (("chain_accept_greedy_heldout", False),
                          ("chain_accept_greedy_heldout_response_only", True)):
            log[key] = chain_accept(head, embed, lm_head, data, chain_ids, steps=args.chain_steps,
                                    amp=args.amp, response_only=resp)
            out(f"{key}: {log[key]}")
    log["total_seconds"] = round(time.time() - T0, 1)
    if args.log:
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
        Path(args.log).write_text(json.dumps(log, indent=1))
    out("done")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The trainer's stages and options, onto `p` (this module's parser and `eaglekv
    train-draft` alike). The stage goes to `args.stage`: `eaglekv` keeps `args.cmd` for its own."""
    sub = p.add_subparsers(dest="stage", required=True)
    a = sub.add_parser("prompts", help="build and tokenise the prompts (CPU)")
    a.add_argument("--model", default="default")
    a.add_argument("--n", type=int, default=4000)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--raw-frac", type=float, default=0.15)
    a.add_argument("--out", required=True)
    from eaglekv.training.selfgen import add_gen_data_arguments
    add_gen_data_arguments(sub)
    b = sub.add_parser("train", help="generate, extract features, train, save")
    b.add_argument("--algorithm", choices=("eagle", "eagle3"), default="eagle")
    b.add_argument("--model", default="default")
    b.add_argument("--prompts", default=None, help="eagle: prompts to generate from")
    b.add_argument("--out", required=True, help="directory for config.json + model.safetensors")
    b.add_argument("--log", default=None)
    b.add_argument("--device", default="auto")
    b.add_argument("--data", default=None, help="reuse sequences saved with --save-data")
    b.add_argument("--save-data", default=None)
    b.add_argument("--max-prompts", type=int, default=None)
    b.add_argument("--greedy-frac", type=float, default=0.25)
    b.add_argument("--gen-batch", type=int, default=512)
    b.add_argument("--gen-bf16", action=argparse.BooleanOptionalAction, default=True)
    b.add_argument("--gen-budget", type=float, default=120.0)
    b.add_argument("--max-new", type=int, default=256)
    b.add_argument("--temperature", type=float, default=0.7)
    b.add_argument("--top-p", type=float, default=0.95)
    b.add_argument("--pad-id", type=int, default=2)
    b.add_argument("--extra-eos", type=int, nargs="*", default=[])
    b.add_argument("--eval-every", type=int, default=25, help="every n-th sequence held out")
    b.add_argument("--lr", type=float, default=5e-4)
    b.add_argument("--warmup", type=int, default=200)
    b.add_argument("--max-steps", type=int, default=10 ** 9)
    b.add_argument("--train-budget", type=float, default=240.0, help="seconds of training")
    b.add_argument("--deadline", type=float, default=0.0,
                   help="end training this many seconds after start (0: no deadline)")
    b.add_argument("--max-tokens", type=int, default=12288, help="padded tokens per batch")
    b.add_argument("--noise", type=float, default=0.1, help="U(-a, a) * feature std")
    b.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None)
    b.add_argument("--log-every", type=int, default=100)
    b.add_argument("--eval-every-s", type=float, default=60.0)
    b.add_argument("--chain-steps", type=int, default=3)
    b.add_argument("--seed", type=int, default=0)
    e = b.add_argument_group("eagle3")
    e.add_argument("--data-dir", action="append", default=None,
                   help="sequences written by `gen-data` (repeat it to train on several "
                        "stores, e.g. two gen-data runs with different seeds)")
    e.add_argument("--draft-vocab", type=int, default=16384, help="draft vocabulary size")
    e.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll")
    e.add_argument("--intermediate-size", type=int, default=None,
                   help="the head's MLP width (default: the --init-from head's, else the "
                        "target's); a narrower --init-from head is widened without changing "
                        "what it computes (new units start with zero output)")
    e.add_argument("--topk-loss", type=int, default=10,
                   help="k of the top-k distillation term (HASS), with --topk-weight > 0")
    e.add_argument("--topk-weight", type=float, default=0.0,
                   help="weight of the cross entropy over the target's top-k draft tokens, "
                        "added to each TTT step's full cross entropy (0: off, as the shipped "
                        "heads were trained)")
    e.add_argument("--aux-layers", default=None,
                   help="the three target layer outputs the head reads, e.g. 1,14,28 "
                        "(default: the --init-from head's, else EAGLE-3's (1, L/2-1, L-4)); "
                        "written to config.json as eagle_config.eagle_aux_hidden_state_layer_ids")
    e.add_argument("--ckpt", default=None, help="trainer state, saved every 2 min and at the end")
    e.add_argument("--resume", action="store_true", help="continue from --ckpt")
    e.add_argument("--init-from", default=None, help="start from a published EAGLE-3 head "
                   "(e.g. the shipped one: weights and draft vocabulary; a fresh optimizer)")
    e.add_argument("--features-on", choices=("auto", "device", "cpu"), default="auto",
                   help="where the target's features live: on the training device, in host "
                        "memory (each batch gathered there and copied), or auto: the "
                        "device while they take at most 60%% of its free memory (bf16, 4H a "
                        "token: 9.4M SmolLM2 tokens are 43 GB)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=MODULE_COMMAND, description=DESCRIPTION)
    add_arguments(p)
    return p


def run(args, command_line: str | None = None) -> int:
    """Run the parsed stage; --amp not given: on where CUDA is used."""
    if args.stage == "prompts":
        cmd_prompts(args)
    elif args.stage == "gen-data":
        from eaglekv.training.selfgen import run_gen_data
        return run_gen_data(args, command_line)
    else:
        if args.amp is None:
            args.amp = torch.cuda.is_available() and args.device != "cpu"
        cmd_train(args, command_line)
    return 0


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))
