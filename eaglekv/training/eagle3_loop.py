"""The EAGLE-3 optimisation loop: AdamW, linear warmup then cosine decay, the TTT loss, a tqdm
bar with the loss and top-1 per draft position, held-out evaluation, resumable checkpoints.

Deterministic for a seed: the batch order of epoch e comes from Random(seed * 1000003 + e), and a
checkpoint records (epoch, batch index, step, elapsed seconds), so a resumed run takes the same
batches as an uninterrupted one. The schedule runs over max_steps, or over the time budget where
that ends first (then it depends on the machine's speed).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch

from eaglekv.training.data import batches
from eaglekv.training.ttt import ttt_loss


class Targets:
    """The target's side of the loss: logits over the draft vocabulary from the stored final
    hidden states (lm_head rows of the draft ids, (Vd, H), frozen)."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor, target_ids: torch.Tensor):
        self.embed = embed                                                   # (V, H)
        self.lm_head_d = lm_head[target_ids.to(lm_head.device)]              # (Vd, H)

    def batch(self, data, which):
        ids, aux, final, argmax, mask = data.batch3(which)
        tl = final.to(self.lm_head_d.dtype) @ self.lm_head_d.t()             # (B, T, Vd)
        return ids, aux.to(self.embed.dtype), tl, argmax, mask


@torch.no_grad()
def evaluate_eagle3(head, tg: Targets, data, which, *, steps: int, max_tokens: int, amp: bool,
                    greedy_only: bool = True) -> dict:
    """Held-out: loss and top-1 per step, and the greedy chain's accept length for 1..steps
    drafts (1 + sum of P(first s drafts all right)) over chains whose positions all exist.
    `greedy_only`: the chain figures count greedy sequences only (sampled data tokens are not
    the target's argmax)."""
    head.eval()
    tot, n = {}, 0
    hits, count = torch.zeros(steps), 0
    walk_S = [S for S in WALK_DRAFTS if S <= steps]
    walked = {S: [] for S in walk_S}
    for b in batches(data, which, max_tokens, random.Random(0), shuffle=False):
        ids, aux, tl, argmax, mask = tg.batch(data, b)
        _, st, ok = ttt_loss(head, tg.embed, ids, aux, tl, argmax, mask, steps=steps, amp=amp)
        for k, v in st.items():
            if k != "n":
                tot[k] = tot.get(k, 0.0) + v * st["n"]
        n += st["n"]
        full = mask[:, 1:].clone()                                           # (B, n) j = p+1 trained
        for s in range(1, steps):                                            # j = p+1+s exists too
            full &= torch.nn.functional.pad(mask[:, 1 + s:], (0, s), value=False)
        if greedy_only:
            full &= torch.tensor([data.seqs[i]["greedy"] for i in b], device=full.device)[:, None]
        hits += ok[:, full].float().sum(-1).cpu()
        count += int(full.sum())
        okh = ok.cpu().numpy()
        for j, i in enumerate(b):
            seq = data.seqs[i]
            if greedy_only and not seq["greedy"]:
                continue
            for S in walk_S:
                walked[S] += served_walk(okh[:, j], seq["n_prompt"] - 1, len(seq["ids"]), S)
    head.train()
    rates = (hits / max(count, 1)).tolist()
    return ({k: v / max(n, 1) for k, v in tot.items()}
            | {"tokens": n, "chain_positions": count, "p_first_s_accepted": rates,
               "accept_length": {s: 1.0 + sum(rates[:s]) for s in range(1, steps + 1)},
               # as a served engine walks the text (what eval-draft measures)
               "accept_length_walked": {S: sum(w) / max(len(w), 1) for S, w in walked.items()}})


# the chain lengths whose served walk `evaluate_eagle3` reports
WALK_DRAFTS = (3, 5, 7)


def served_walk(ok, start: int, length: int, S: int, budget: int | None = None) -> list[int]:
    """The accept lengths of the greedy chains of S drafts a served engine runs over a text
    of `length` tokens whose prompt ends at index `start` (n_prompt - 1). ok (steps, n): one
    sequence's chain_ok from `ttt_loss` (ok[k, p]: drafts 0..k of a chain at index p are all
    the target's argmax). A chain at index p (its first draft reads token p+1 and the feature
    of p, as after a verify whose bonus token is p+1) accepts 1 + its leading right drafts;
    the next chain starts past them. Offline accept lengths average every position; served
    chains start where the last one ended, after a miss more often than not. Chains whose
    drafts would pass the text's end are left out; `budget`: stop once the output (its first
    token from the prefill included) has that many tokens, as max_new_tokens does."""
    p, out, got = start, 1, []
    while p + 1 + S < length and (budget is None or out < budget):
        k = 0
        while k < S and ok[k, p]:
            k += 1
        got.append(1 + k)
        p += 1 + k
        out += 1 + k
    return got


def save_state(path, head, opt, state: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), **state}, tmp)
    tmp.replace(path)


def train_eagle3(head, tg: Targets, data, train_ids, eval_ids, *, steps: int, lr: float,
                 time_budget: float, max_steps: int, max_tokens: int, warmup: int, amp: bool,
                 seed: int, ckpt: str | None = None, ckpt_every_s: float = 120.0,
                 resume: bool = False, eval_every_s: float = 120.0, min_lr_frac: float = 0.1,
                 grad_clip: float = 0.5, stop_at_step: int | None = None,
                 stop_after_s: float | None = None, progress: bool = True, out=print,
                 topk: int = 0, topk_weight: float = 0.0) -> dict:
    """Train `head` in place; returns the log (history, held-out evaluations, timing).
    The schedule spans `max_steps` / `time_budget` (seconds trained, summed over resumes);
    `stop_at_step` / `stop_after_s` (this call's wall time) end this call early without changing
    it, to be continued with `resume` (a GPU command is limited to 10 minutes)."""
    from tqdm import tqdm
    dev = tg.embed.device
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=dev.type == "cuda")
    st = {"step": 0, "epoch": 0, "batch": 0, "elapsed": 0.0, "history": [], "held_out": []}
    if resume and ckpt and Path(ckpt).exists():
        saved = torch.load(ckpt, map_location=dev, weights_only=False)
        head.load_state_dict(saved.pop("head"))
        opt.load_state_dict(saved.pop("opt"))
        st.update(saved)
        out(f"resumed from {ckpt}: step {st['step']}, epoch {st['epoch']}, "
            f"{st['elapsed']:.0f}s trained")
    t0, base = time.time(), st["elapsed"]
    last_ckpt = last_eval = t0
    acc = {}
    bar = tqdm(total=max_steps if max_steps < 10 ** 8 else None, initial=st["step"],
               disable=not progress, unit="step", dynamic_ncols=True)

    def elapsed():
        return base + time.time() - t0

    done = False
    while not done:
        order = batches(data, train_ids, max_tokens, random.Random(seed * 1000003 + st["epoch"]))
        while st["batch"] < len(order):
            frac = max(elapsed() / time_budget, st["step"] / max_steps)
            if frac >= 1.0 or st["step"] == stop_at_step or (
                    stop_after_s is not None and time.time() - t0 > stop_after_s):
                done = True
                break
            scale = min(1.0, (st["step"] + 1) / warmup) * (
                min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
            for gr in opt.param_groups:
                gr["lr"] = lr * scale
            ids, aux, tl, argmax, mask = tg.batch(data, order[st["batch"]])
            loss, stats, _ = ttt_loss(head, tg.embed, ids, aux, tl, argmax, mask, steps=steps,
                                      amp=amp, topk=topk, topk_weight=topk_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), grad_clip)
            opt.step()
            st["step"] += 1
            st["batch"] += 1
            bar.update(1)
            for k, v in stats.items():
                acc[k] = acc.get(k, 0.0) + v
            acc["k"] = acc.get("k", 0) + 1
            if st["step"] % 25 == 0:
                rec = {k: v / acc["k"] for k, v in acc.items() if k not in ("k", "n")}
                rec.update(step=st["step"], epoch=st["epoch"], t=round(elapsed(), 1),
                           lr=lr * scale, tokens_per_step=acc["n"] / acc["k"])
                st["history"].append(rec)
                acc = {}
                bar.set_postfix_str(f"loss {rec['loss']:.3f} top1 " + "/".join(
                    f"{rec[f'top1_{s}']:.2f}" for s in range(steps)))
            now = time.time()
            if eval_ids and now - last_eval > eval_every_s:
                last_eval = now
                ev = evaluate_eagle3(head, tg, data, eval_ids, steps=steps, max_tokens=max_tokens,
                                     amp=amp)
                ev.update(step=st["step"], t=round(elapsed(), 1))
                st["held_out"].append(ev)
                out(f"[eval] step {st['step']} loss {ev['loss']:.3f} accept "
                    + " ".join(f"S{s}:{a:.2f}" for s, a in ev["accept_length"].items())
                    + "; walked as served "
                    + " ".join(f"S{s}:{a:.2f}" for s, a in ev["accept_length_walked"].items()))
            if ckpt and now - last_ckpt > ckpt_every_s:
                last_ckpt = now
                save_state(ckpt, head, opt, {**st, "elapsed": elapsed()})
        else:
            st["epoch"] += 1
            st["batch"] = 0
    bar.close()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    st["elapsed"] = elapsed()
    if ckpt:
        save_state(ckpt, head, opt, st)
    ev = evaluate_eagle3(head, tg, data, eval_ids, steps=steps, max_tokens=max_tokens, amp=amp) \
        if eval_ids else {}
    ev.update(step=st["step"], t=round(st["elapsed"], 1))
    st["held_out"].append(ev)
    out(f"[eval] final step {st['step']}: {ev}")
    return {"steps": st["step"], "epochs": st["epoch"], "train_seconds": round(st["elapsed"], 1),
            "history": st["history"], "held_out": st["held_out"]}
