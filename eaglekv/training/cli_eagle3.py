"""`eaglekv train-draft train --algorithm eagle3 ...`: data -> features of the three captured
layers -> draft vocabulary by frequency -> TTT training -> the published EAGLE-3 checkpoint and
a JSON log (data, vocabulary coverage, recipe, held-out figures, device time)."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch


def split_ids(seqs: list[dict], eval_every: int) -> tuple[list[int], list[int]]:
    """(train, held-out) sequence indices: a sequence flagged `held_out` (selfgen's held-out
    topics) is never trained on; otherwise every `eval_every`-th is held out."""
    flagged = any("held_out" in s for s in seqs)
    held = [i for i, s in enumerate(seqs)
            if (s.get("held_out") if flagged else i % eval_every == 0)]
    hs = set(held)
    return [i for i in range(len(seqs)) if i not in hs], held


def response_tokens(seqs: list[dict], which: list[int]) -> torch.Tensor:
    """The response tokens of sequences `which` (what the draft is asked to predict)."""
    return torch.tensor([t for i in which for t in seqs[i]["ids"][seqs[i]["n_prompt"]:]],
                        dtype=torch.int64)


def read_init_head(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, state dict) of a published EAGLE-3 head (`--init-from`), e.g. the
    shipped one."""
    from eaglekv.model.draft_io import read_draft_dir
    cfg_dict, sd = read_draft_dir(path, "--init-from EAGLE-3 head")
    missing = [k for k in ("d2t", "t2d", "lm_head.weight") if k not in sd]
    if missing:
        raise SystemExit(f"--init-from {path}: not an EAGLE-3 head (no {', '.join(missing)})")
    return cfg_dict, sd


def head_shape(args, cfg, init_cfg: dict | None) -> tuple[tuple[int, ...] | None, int]:
    """(captured target layers, MLP width) of the head to train: as asked (`--aux-layers`,
    `--intermediate-size`), else the --init-from head's, else EAGLE-3's default layers and
    the target's width. None for the layers: the default (not written to the config)."""
    from eaglekv.errors import ModelLoadError
    from eaglekv.model.eagle3 import Eagle3DraftModel
    from eaglekv.model.eagle3_checkpoint import configured_aux_layers
    aux = getattr(args, "aux_layers", None)
    if aux is not None:
        try:
            aux = tuple(int(x) for x in str(aux).split(","))
        except ValueError:
            raise SystemExit(f"--aux-layers {args.aux_layers!r}: expected three layer ids, "
                             f"e.g. 1,14,28") from None
    elif init_cfg is not None:
        aux = configured_aux_layers(init_cfg)
    L = cfg.num_layers
    try:
        ids = Eagle3DraftModel.aux_layers(L, aux)
    except ModelLoadError as e:     # three distinct ids in range
        raise SystemExit(f"--aux-layers: {e}") from None
    if max(ids) >= L - 1:
        raise SystemExit(f"--aux-layers {list(ids)}: layer {L - 1} is the target's last; its "
                         f"output is only seen after the final norm (at most {L - 2})")
    width = getattr(args, "intermediate_size", None)
    if width is None:
        width = int(init_cfg["intermediate_size"]) if init_cfg else cfg.intermediate_size
    if width < 1:
        raise SystemExit(f"--intermediate-size {width}: must be >= 1")
    default = Eagle3DraftModel.aux_layers(L)
    return (None if ids == default else ids), width


def load_published(head, sd: dict[str, torch.Tensor], path) -> None:
    """Copy a published head's tensors into `head` (same target shapes); a missing, extra or
    differently shaped tensor is an error naming it."""
    own = head.state_dict()
    extra, missing = sorted(set(sd) - set(own)), sorted(set(own) - set(sd))
    bad = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if extra or missing or bad:
        raise SystemExit(f"--init-from {path} does not fit this target's head: extra "
                         f"{extra}, missing {missing}, shapes differ {bad}")
    head.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()})


def cmd_train_eagle3(args, seqs: list[dict], command_line: str, out) -> dict:
    from eaglekv.model.draft_io import save_draft_dir
    from eaglekv.model.eagle3 import Eagle3DraftModel
    from eaglekv.training.data import load_target
    from eaglekv.training.eagle3_data import (extract_eagle3_features, feature_bytes,
                                              features_device)
    from eaglekv.model.eagle3_checkpoint import configured_aux_layers
    from eaglekv.training.eagle3_head import eagle3_head_for_target, widen_mlp
    from eaglekv.training.eagle3_loop import Targets, evaluate_eagle3, train_eagle3
    from eaglekv.training.vocab import DraftVocab, choose_draft_vocab
    # the loss first: a bad value fails before the target and its features load
    tk, tk_w = getattr(args, "topk_loss", 10), getattr(args, "topk_weight", 0.0)
    if tk_w < 0 or (tk_w > 0 and tk < 1):
        raise SystemExit(f"--topk-weight {tk_w} must be >= 0 and --topk-loss {tk} >= 1")
    t_start = time.time()
    log = {"command": command_line, "algorithm": "eagle3",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    dev = torch.device(args.device if args.device != "auto" else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
    log["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(args.seed)
    # 1. target and its features
    model, cfg = load_target(args.model, dev, torch.float32)
    init_cfg, init = (read_init_head(args.init_from) if getattr(args, "init_from", None)
                      else (None, None))
    aux_override, width = head_shape(args, cfg, init_cfg)
    aux_layers = Eagle3DraftModel.aux_layers(cfg.num_layers, aux_override)
    train_ids, eval_ids = split_ids(seqs, args.eval_every)
    t = time.time()
    torch.backends.cuda.matmul.allow_tf32 = True     # the fp32 target pass in TF32 on a GPU
    fdt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    store = features_device(getattr(args, "features_on", "auto"), dev,
                            feature_bytes(sum(len(s["ids"]) for s in seqs), cfg.hidden_size, fdt))
    data = extract_eagle3_features(model, seqs, aux_layers, dtype=fdt, store=store)
    torch.backends.cuda.matmul.allow_tf32 = False
    log["feature_seconds"] = round(time.time() - t, 1)
    log["feature_precision"] = ("fp32 target, TF32 matmuls, stored bf16" if dev.type == "cuda"
                                else "fp32")
    log["features_on"] = str(store)
    embed = model.get_input_embeddings().weight.detach()
    lm_head = model.get_output_embeddings().weight.detach()
    final_norm = model.model.norm.weight.detach()
    del model
    log["data"] = {"sequences": len(seqs), "tokens": data.num_tokens,
                   "train_sequences": len(train_ids), "held_out_sequences": len(eval_ids),
                   "train_response_tokens": int(sum(len(seqs[i]["ids"]) - seqs[i]["n_prompt"]
                                                    for i in train_ids)),
                   "greedy": sum(bool(s["greedy"]) for s in seqs), "aux_layers": list(aux_layers)}
    out(f"features of {data.num_tokens} tokens in {log['feature_seconds']}s: {log['data']}")
    # 2. the draft vocabulary: the most frequent response tokens of the training sequences,
    # or, with --init-from, the published head's own (its lm_head rows are in that order)
    if init is not None:
        vocab = DraftVocab.from_maps(init["d2t"], init["t2d"])
    else:
        eos = tuple(sorted(set(cfg.eos_token_ids)))
        vocab = choose_draft_vocab(response_tokens(seqs, train_ids), cfg.vocab_size,
                                   min(args.draft_vocab, cfg.vocab_size), always=eos)
    log["vocab"] = {"draft_vocab_size": vocab.size, "target_vocab_size": cfg.vocab_size,
                    "coverage_train": vocab.coverage(response_tokens(seqs, train_ids)),
                    "coverage_held_out": vocab.coverage(response_tokens(seqs, eval_ids))}
    out(f"draft vocabulary: {log['vocab']}")
    # 3. the head, its output side initialised from the target's
    head, cfg_dict = eagle3_head_for_target(cfg, vocab, aux_layer_ids=aux_override,
                                            intermediate_size=width, seed=args.seed)
    head.init_from_target(lm_head, final_norm)
    log["head_shape"] = {"aux_layers": list(aux_layers), "intermediate_size": width}
    if init is not None:     # every weight from the published head; a fresh optimizer
        try:                 # a narrower published MLP is widened, computing the same function
            init = widen_mlp(init, head.published_state_dict(torch.float32))
        except ValueError as e:
            raise SystemExit(f"--init-from {args.init_from}: {e}") from None
        load_published(head, init, args.init_from)
        log["init_from"] = str(args.init_from)
        init_aux = Eagle3DraftModel.aux_layers(cfg.num_layers, configured_aux_layers(init_cfg))
        if init_aux != aux_layers:
            log["init_from_aux_layers"] = list(init_aux)
            out(f"--init-from {args.init_from} read layers {log['init_from_aux_layers']}; "
                f"this head reads {list(aux_layers)} (its fc learns them from there)")
    head.to(dev)
    tg = Targets(embed, lm_head, vocab.target_ids)
    log["head_params"] = sum(p.numel() for p in head.parameters())
    log["recipe"] = {"lr": args.lr, "warmup": args.warmup, "ttt_steps": args.ttt_steps,
                     "step_weight": "0.8^s", "schedule": "cosine to 0.1 over max_steps or budget",
                     "optimizer": "AdamW(0.9, 0.95), wd 0, clip 0.5", "amp_bf16": args.amp,
                     "max_tokens_per_batch": args.max_tokens, "seed": args.seed,
                     "loss": "CE(softmax(target logits on draft vocab), draft) per TTT step"
                             + (f" + {tk_w} x the same over the target's top {tk} (HASS)"
                                if tk_w > 0 else ""),
                     "init": "lm_head, norm from the target; the rest N(0, 0.02), norms 1"}
    # --train-budget spans the schedule (summed over resumes); --deadline ends this process
    # (a GPU command's limit) and leaves the rest to --resume
    stop = None if args.deadline <= 0 else args.deadline - (time.time() - t_start)
    res = train_eagle3(head, tg, data, train_ids, eval_ids, steps=args.ttt_steps, lr=args.lr,
                       time_budget=args.train_budget, max_steps=args.max_steps,
                       max_tokens=args.max_tokens, warmup=args.warmup, amp=args.amp,
                       seed=args.seed, ckpt=args.ckpt, resume=args.resume,
                       eval_every_s=args.eval_every_s, stop_after_s=stop, out=out,
                       topk=tk, topk_weight=tk_w)
    log.update(res)
    # 4. save (bf16), then the held-out figures of the saved weights
    sd = head.published_state_dict(torch.bfloat16)
    save_draft_dir(args.out, cfg_dict, sd, "safetensors")
    out(f"saved {args.out}")
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()},
                         strict=False)
    if eval_ids:
        log["held_out_saved_bf16"] = evaluate_eagle3(head, tg, data, eval_ids, steps=args.ttt_steps,
                                                     max_tokens=args.max_tokens, amp=args.amp)
        ho = log["held_out_saved_bf16"]
        out(f"held-out (saved weights): {ho['accept_length']}; walked as served "
            f"{ho['accept_length_walked']}")
    log["total_seconds"] = round(time.time() - t_start, 1)
    if args.log:
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
        Path(args.log).write_text(json.dumps(log, indent=1))
    return log
