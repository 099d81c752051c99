"""An EAGLE-3 head's accept length two ways on the same greedy text: served (the engine's
chains, as `eaglekv eval-draft` measures them) and offline (the trainer's teacher-forced
chains, `evaluate_eagle3`, at every response position of the target's own greedy outputs).

A gap between the two is a train/serve mismatch (what the draft sees in the engine is not
what it was trained on) or a sampling effect (served chains start only where the previous
chain ended, offline ones at every position). Per prompt kind (chat, code).

    python bench/offline_vs_served.py --draft eaglekv/drafts/smollm2-135m-instruct-eagle3 \
        --prompts bench/data/heldout_prompts_smollm2.json --max-prompts 24 \
        --out bench/results/offline_vs_served_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from types import SimpleNamespace

import torch

from eaglekv import Engine, EngineConfig, SamplingParams, SpecConfig


def served(model: str, draft: str, ids: list[list[int]], n: int, shape) -> tuple[list, dict]:
    """Plain greedy outputs, and the speculative run's accept length per prompt."""
    plain = Engine(EngineConfig(model=model, device="cpu", dtype="float32"))
    params = SamplingParams(max_new_tokens=n, temperature=0.0)
    # the text a few tokens past the budget: the last served chain's drafts are checked
    # against the tokens after it (the walk needs them too)
    outs = [o.token_ids for o in plain.generate(ids, SamplingParams(max_new_tokens=n + 8,
                                                                     temperature=0.0))]
    del plain
    S, K, N = shape
    spec = Engine(EngineConfig(model=model, device="cpu", dtype="float32",
                               speculative=SpecConfig("eagle3", draft, S, K, N, adaptive=False)))
    per, steps = [], []
    for i, o in enumerate(spec.generate(ids, params)):
        if o.token_ids != outs[i][:n]:
            raise SystemExit(f"prompt {i}: speculative greedy differs from plain")
        per.append(o.spec.accept_length_mean)
        steps.append(o.spec.verify_steps)
    return outs, {"accept_length_per_prompt": per, "verify_steps_per_prompt": steps,
                  "accept_length_pooled": sum(a * n for a, n in zip(per, steps)) / sum(steps)}


def offline(model: str, draft: str, seqs: list[dict], steps: int, budget: int) -> list[dict]:
    """evaluate_eagle3 over each sequence alone (fp32 target features, the head in fp32)."""
    from eaglekv.model.eagle3 import Eagle3DraftModel
    from eaglekv.training.cli_eagle3 import head_shape, load_published, read_init_head
    from eaglekv.training.data import load_target
    from eaglekv.training.eagle3_data import extract_eagle3_features
    from eaglekv.training.eagle3_head import eagle3_head_for_target
    from eaglekv.training.eagle3_loop import Targets, evaluate_eagle3, served_walk
    from eaglekv.training.ttt import ttt_loss
    from eaglekv.training.vocab import DraftVocab
    target, cfg = load_target(model, torch.device("cpu"), torch.float32)
    init_cfg, sd = read_init_head(draft)
    aux, width = head_shape(SimpleNamespace(aux_layers=None, intermediate_size=None), cfg,
                            init_cfg)
    layers = Eagle3DraftModel.aux_layers(cfg.num_layers, aux)
    data = extract_eagle3_features(target, seqs, layers, dtype=torch.float32)
    vocab = DraftVocab.from_maps(sd["d2t"], sd["t2d"])
    head, _ = eagle3_head_for_target(cfg, vocab, aux_layer_ids=aux, intermediate_size=width)
    load_published(head, {k: v.float() if v.is_floating_point() else v for k, v in sd.items()},
                   draft)
    tg = Targets(target.get_input_embeddings().weight.detach(),
                 target.get_output_embeddings().weight.detach(), vocab.target_ids)
    head.eval()
    out = []
    for i, s in enumerate(seqs):
        r = evaluate_eagle3(head, tg, data, [i], steps=steps, max_tokens=1 << 16, amp=False)
        with torch.no_grad():
            ids, a, tl, argmax, mask = tg.batch(data, [i])
            _, _, ok = ttt_loss(head, tg.embed, ids, a, tl, argmax, mask, steps=steps)
        r["walked"] = {S: served_walk(ok[:, 0].numpy(), s["n_prompt"] - 1, len(s["ids"]), S,
                                  budget=budget)
                       for S in (3, 5)}
        out.append(r)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from eaglekv.training.eval_draft import load_prompts, prompt_ids
    prompts = load_prompts(args.prompts, args.max_prompts)
    tok = Engine(EngineConfig(model=args.model, device="cpu", dtype="float32"))
    ids = prompt_ids(tok, prompts)
    del tok
    t = time.time()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": "cpu", "command": " ".join(["python"] + sys.argv),
              "draft": args.draft, "prompts": args.prompts, "n": len(ids), "shapes": {}}
    outs = None
    for S in (3, 5):
        outs, res = served(args.model, args.draft, ids, args.max_new_tokens, (S, 1, S + 1))
        result["shapes"][f"S{S}K1N{S + 1}"] = {"served": res}
    seqs = [{"ids": p + o, "n_prompt": len(p), "greedy": True} for p, o in zip(ids, outs)]
    off = offline(args.model, args.draft, seqs, steps=7, budget=args.max_new_tokens)
    kinds = [p["kind"] for p in prompts]
    for S in (3, 5):
        row = result["shapes"][f"S{S}K1N{S + 1}"]
        row["offline"] = {"accept_length_per_prompt": [o["accept_length"][S] for o in off],
                          "walked_per_prompt": [sum(o["walked"][S]) / max(len(o["walked"][S]), 1)
                                                for o in off]}
        for k in sorted(set(kinds)) + ["all"]:
            sel = [i for i, x in enumerate(kinds) if k in ("all", x)]
            pos = [off[i]["chain_positions"] for i in sel]
            # offline: every chain position counts once (pooled); served: steps pooled
            row.setdefault("by_kind", {})[k] = {
                "prompts": len(sel),
                "served_mean_of_prompts": sum(row["served"]["accept_length_per_prompt"][i]
                                              for i in sel) / len(sel),
                "offline_mean_of_prompts": sum(off[i]["accept_length"][S] for i in sel)
                / len(sel),
                "offline_walked_mean_of_prompts": sum(row["offline"]["walked_per_prompt"][i]
                                                      for i in sel) / len(sel),
                "offline_pooled": sum(off[i]["accept_length"][S] * off[i]["chain_positions"]
                                      for i in sel) / max(sum(pos), 1)}
    result["seconds"] = round(time.time() - t, 1)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for sh, row in result["shapes"].items():
        for k, v in row["by_kind"].items():
            print(f"{sh} {k:5s} n={v['prompts']:2d} served {v['served_mean_of_prompts']:.2f} "
                  f"offline {v['offline_mean_of_prompts']:.2f} (pooled {v['offline_pooled']:.2f}, "
                  f"walked as served {v['offline_walked_mean_of_prompts']:.2f})")
    return result


if __name__ == "__main__":
    main()
