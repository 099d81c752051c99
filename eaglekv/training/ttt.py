"""Training-time test (EAGLE-3): the draft unrolled over its own features for several steps.

At serving time draft step s >= 1 reads the head's own output g of the step before, not the
target's feature; a head trained only on target features (step 0) drifts from step 2 on. So the
loss unrolls `steps` draft steps over every position at once. Index p in [0, n), n = T - 1:

    step 0:  input (token p+1, fc(aux_p)),   RoPE position p,     predicts token p+2
    step s:  input (token p+1+s, g_{s-1,p}), RoPE position p+s,   predicts token p+2+s

The tokens are the data's (teacher forcing: on an accepted chain the draft's own tokens equal
them). Attention of step s at index p, as a served chain at depth s sees its KV cache:

    keys = step-0 keys at indices <= p (the verified prefix)  +  (1,p), (2,p), ..., (s,p)
           [ k0_0 k0_1 ... k0_p ]                                [ own chain, one key each ]

so scores = causal(q @ k0^T)  ++  the diagonals (q * k_j).sum(-1) of the chain keys.

Loss (EAGLE-3, SpecForge): at step s, cross entropy between the draft's distribution and the
target's at position j = p+1+s restricted to the draft vocabulary and renormalised,
softmax(lm_head_target(f_j)[draft ids]); steps weighted 0.8^s; only positions j in the response
(j >= n_prompt - 1) and inside the sequence count. Top-1 at step s: the draft's argmax (as a
target id) == the target's argmax over the full vocabulary at j, which is what a greedy verify
accepts. kl_s = loss_s minus the target's entropy (the loss's floor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaglekv.training.eagle3_head import Eagle3Head


def chain_attention(q, k0, v0, ks, vs, causal):
    """q (B, h, n, D); k0, v0 (B, h, n, D) step-0 keys; ks, vs: the chain's keys (B, h, n, D)
    each (this step's included); causal (n, n) bool. Returns (B, h, n, D)."""
    n, scale = q.shape[-2], q.shape[-1] ** -0.5
    s0 = (q @ k0.transpose(-1, -2)) * scale                                  # (B, h, n, n)
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in ks]             # (B, h, n, 1) each
    w = torch.cat([s0] + diag, -1).float().softmax(-1).to(v0.dtype)         # (B, h, n, n+s)
    out = w[..., :n] @ v0
    for j, vj in enumerate(vs):
        out = out + w[..., n + j:n + j + 1] * vj
    return out


def ttt_unroll(head: Eagle3Head, embed: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor,
               steps: int):
    """Yield (s, g_s) for s = 0 .. steps-1; ids (B, T) target ids, aux (B, T, 3H) the target's
    captured hiddens; g_s (B, n, H) with n = T - 1 (index p as in the module docstring)."""
    B, T = ids.shape
    n = T - 1
    pos = torch.arange(n, device=ids.device)
    ids_pad = F.pad(ids, (0, steps))                                         # (B, T + steps)
    causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    hidden = aux[:, :n]                                                      # (B, n, 3H)
    k0 = v0 = None
    ks, vs = [], []
    for s in range(steps):
        tok = ids_pad[:, 1 + s:1 + s + n]                                    # (B, n) token p+1+s
        x, h = head.inputs(embed[tok], hidden)                               # (B, n, 2H), (B, n, H)
        q, k, v = head.qkv(x, pos + s)
        if s == 0:
            k0, v0 = k, v
        else:
            ks.append(k)
            vs.append(v)
        g = head.finish(h, chain_attention(q, k0, v0, ks, vs, causal))      # (B, n, H)
        yield s, g
        hidden = g


def shift(x: torch.Tensor, s: int, n: int, fill=0):
    """x (B, T, ...) -> x[:, 1+s : 1+s+n] padded with `fill` past T: the value at j = p+1+s."""
    pad = [0, 0] * (x.dim() - 2) + [0, s + 1]
    return F.pad(x, pad, value=fill)[:, 1 + s:1 + s + n]


def ttt_loss(head: Eagle3Head, embed, ids, aux, tgt_logits, tgt_argmax, mask, *, steps: int,
             decay: float = 0.8, amp: bool = False, topk: int = 0, topk_weight: float = 0.0):
    """One batch. tgt_logits (B, T, Vd): the target's logits over the draft vocabulary at each
    position; tgt_argmax (B, T): its argmax over the full vocabulary; mask (B, T): positions whose
    prediction is trained (in the sequence, in the response). Returns (loss, stats, chain_ok)
    with chain_ok (steps, B, n) bool: step s's draft and all before it match the target argmax
    (what a greedy chain of s+1 drafts accepts at index p).

    Each step's loss is the cross entropy to the target's distribution p over the draft
    vocabulary; `topk_weight` w > 0 adds w * -sum_{x in top-`topk` of p} p(x) log q(x), the
    top-K distillation term of HASS (Zhang et al. 2024), which weighs the tokens a verify can
    accept above the tail. `loss{s}` in the stats stays the cross entropy alone."""
    if topk_weight < 0 or (topk_weight > 0 and topk < 1):
        raise ValueError(f"top-k loss: weight {topk_weight} must be >= 0, and k {topk} >= 1 "
                         f"when the weight is > 0")
    n = ids.shape[1] - 1
    draft_ids = head.target_ids                                              # (Vd,) target ids
    total, weights, stats, chain_ok = 0.0, 0.0, {}, []
    ok = torch.ones(ids.shape[0], n, dtype=torch.bool, device=ids.device)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=amp):
        for s, g in ttt_unroll(head, embed, ids, aux, steps):
            m = shift(mask, s, n, False)                                     # (B, n)
            logits = head.logits(g[m]).float()                               # (M, Vd)
            with torch.no_grad():
                p = shift(tgt_logits, s, n)[m].float().softmax(-1)           # (M, Vd)
            logq = logits.log_softmax(-1)
            loss_s = -(p * logq).sum(-1).mean() if m.any() else logits.sum() * 0
            extra = loss_s * 0
            if topk_weight > 0 and m.any():
                pk, ik = p.topk(min(topk, p.shape[-1]), -1)                  # (M, k)
                extra = -topk_weight * (pk * logq.gather(-1, ik)).sum(-1).mean()
            total = total + decay ** s * (loss_s + extra)
            weights += decay ** s
            with torch.no_grad():
                hit = torch.zeros_like(ok)
                hit[m] = draft_ids[logits.argmax(-1)] == shift(tgt_argmax, s, n, -1)[m]
                ok = ok & hit
                chain_ok.append(ok)
                ent = -(p * p.clamp_min(1e-30).log()).sum(-1).mean() if m.any() else loss_s * 0
                stats[f"loss{s}"] = float(loss_s.detach())
                stats[f"kl{s}"] = float(loss_s.detach() - ent)     # loss above its floor
                stats[f"top1_{s}"] = float(hit[m].float().mean()) if m.any() else 0.0
    loss = total / weights
    stats["loss"] = float(loss.detach())
    stats["n"] = int(mask[:, 1:].sum())
    return loss, stats, torch.stack(chain_ok)
