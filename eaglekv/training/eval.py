"""Held-out evaluation of a draft head: the training objective on held-out sequences
(`evaluate`) and the accept length of a greedy chain of drafts (`chain_accept`), which estimates
what `--num-steps S --topk 1` accepts when served.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from eaglekv.training.data import batches
from eaglekv.training.loss import step_loss


@torch.no_grad()
def evaluate(head, embed, lm_head, data, which, max_tokens, amp, feat_std) -> dict:
    head.eval()
    tot, n = {}, 0
    for b in batches(data, which, max_tokens, random.Random(0), shuffle=False):
        ids, feats, valid = data.batch(b)
        _, st = step_loss(head, embed, lm_head, ids, feats, valid, amp=amp, feat_std=feat_std)
        for k, v in st.items():
            if k != "n":
                tot[k] = tot.get(k, 0.0) + v * st["n"]
        n += st["n"]
    head.train()
    return {k: v / max(n, 1) for k, v in tot.items()} | {"tokens": n}


@torch.no_grad()
def chain_accept(head, embed, lm_head, data, which, steps: int = 3, amp: bool = False,
                 response_only: bool = False) -> dict:
    """Greedy chain of `steps` drafts from every position of the held-out sequences: the prefix
    is teacher-forced (target features, as after each verify), draft step s >= 2 feeds its own
    token and feature at position p + s - 1 and attends to the prefix, its earlier drafts and
    itself. A draft counts when it equals the data token (greedy responses: the target's argmax).
    `response_only`: only chains whose root token (p + 1) is a response token, as in serving
    (otherwise the shared chat-template prefix, which the head learns by heart, counts too).
    Returns the per-step conditional accept rates and 1 + expected accepted drafts."""
    head.eval()
    hits = torch.zeros(steps)
    count = 0
    for b in batches(data, which, 16384, random.Random(0), shuffle=False):
        ids, feats, valid = data.batch(b)
        B, T = ids.shape
        n = T - 1
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=amp):
            pos = torch.arange(n, device=ids.device)
            x = head.fc(torch.cat([embed[ids[:, 1:]], feats[:, :-1]], -1))
            q, k, v = head.qkv(x, pos)
            g = head.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
            ks, vs = [k], [v]
            ok = torch.ones(B, n, dtype=torch.bool, device=ids.device)
            causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
            eye = torch.eye(n, dtype=torch.bool, device=ids.device)
            acc = []
            for s in range(steps):
                pred = (g @ lm_head.t()).argmax(-1)                         # (B, n): tok p+2+s
                want = F.pad(ids[:, 2 + s:], (0, s + 1), value=-1)[:, :n]
                ok = ok & (pred == want)
                acc.append(ok)
                if s + 1 == steps:
                    break
                x = head.fc(torch.cat([embed[pred], g], -1))
                q, k, v = head.qkv(x, pos + s + 1)
                ks.append(k)
                vs.append(v)
                mask = torch.cat([causal] + [eye] * (s + 1), -1)            # (n, (s+2) n)
                a = F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2),
                                                   attn_mask=mask)
                g = head.finish(x, a)
        lens = valid.sum(1)
        full = pos[None, :] + 1 + steps < lens[:, None]      # tokens p+2 .. p+1+steps exist
        if response_only:
            starts = torch.tensor([data.seqs[i]["n_prompt"] for i in b], device=ids.device)
            full &= pos[None, :] + 1 >= starts[:, None]
        for s in range(steps):
            hits[s] += float(acc[s][full].sum())
        count += int(full.sum())
    head.train()
    rates = (hits / max(count, 1)).tolist()
    cond = [rates[0]] + [rates[s] / rates[s - 1] if rates[s - 1] > 0 else 0.0
                         for s in range(1, steps)]
    return {"positions": count, "p_first_s_accepted": rates, "conditional_accept": cond,
            "accept_length": 1.0 + sum(rates)}
