"""The optimisation loop: AdamW with linear warmup then cosine decay over a time budget,
uniform noise on the input features, periodic held-out evaluation."""

from __future__ import annotations

import math
import random
import time

import torch

from eaglekv.training.data import batches
from eaglekv.training.eval import evaluate
from eaglekv.training.loss import step_loss


def train(head, embed, lm_head, data, train_ids, eval_ids, *, lr: float, time_budget: float,
          max_steps: int, max_tokens: int, warmup: int, noise: float, amp: bool, seed: int,
          log_every: int = 100, eval_every_s: float = 60.0, min_lr_frac: float = 0.1,
          weight_decay: float = 0.0, grad_clip: float = 0.5, out=print) -> dict:
    """AdamW, linear warmup then cosine over the time budget (or max_steps, whichever ends
    first). Returns the log (history of train and held-out stats)."""
    dev = embed.device
    rng = random.Random(seed)
    torch.manual_seed(seed)
    feat_std = float(data.feats[:data.num_tokens].std())
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95),
                            weight_decay=weight_decay, fused=dev.type == "cuda")
    hist, evals = [], []
    t0 = time.time()
    last_eval = t0
    step, epoch, acc = 0, 0, {}
    done = False
    while not done:
        for b in batches(data, train_ids, max_tokens, rng):
            frac = max((time.time() - t0) / time_budget, step / max_steps)
            if frac >= 1.0:
                done = True
                break
            scale = min(1.0, (step + 1) / warmup) * (
                min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
            for gr in opt.param_groups:
                gr["lr"] = lr * scale
            ids, feats, valid = data.batch(b)
            loss, st = step_loss(head, embed, lm_head, ids, feats, valid, noise=noise, amp=amp,
                                 feat_std=feat_std)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = float(torch.nn.utils.clip_grad_norm_(head.parameters(), grad_clip))
            opt.step()
            step += 1
            for k, v in st.items():
                acc[k] = acc.get(k, 0.0) + v
            acc["gnorm"] = acc.get("gnorm", 0.0) + gn
            acc["k"] = acc.get("k", 0) + 1
            if step % log_every == 0:
                rec = {k: v / acc["k"] for k, v in acc.items() if k not in ("k", "n")}
                rec.update(step=step, epoch=epoch, t=round(time.time() - t0, 1),
                           lr=lr * scale, tokens_per_step=acc["n"] / acc["k"])
                hist.append(rec)
                acc = {}
                out(f"[train] step {step} ep {epoch} t {rec['t']}s loss {rec['loss']:.4f} "
                    f"v {rec['vloss']:.4f} p {rec['ploss']:.3f} top1 {rec['top1']:.3f} "
                    f"tok {rec['tok_acc']:.3f} lr {rec['lr']:.2e}")
            if eval_ids and time.time() - last_eval > eval_every_s:
                last_eval = time.time()
                ev = evaluate(head, embed, lm_head, data, eval_ids, max_tokens, amp, feat_std)
                ev.update(step=step, t=round(time.time() - t0, 1))
                evals.append(ev)
                out(f"[eval] step {step} loss {ev['loss']:.4f} top1 {ev['top1']:.3f} "
                    f"tok {ev['tok_acc']:.3f}")
        epoch += 1
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ev = evaluate(head, embed, lm_head, data, eval_ids, max_tokens, amp, feat_std) \
        if eval_ids else {}
    ev.update(step=step, t=round(time.time() - t0, 1))
    evals.append(ev)
    out(f"[eval] final step {step} {ev}")
    return {"steps": step, "epochs": epoch, "train_seconds": round(time.time() - t0, 1),
            "feature_std": feat_std, "history": hist, "held_out": evals}
