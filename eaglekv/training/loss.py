"""The self-distillation objective (EAGLE-1): for every position p the head maps
(tok_{p+1}, f_p) -> g_p with g_p ~ f_{p+1}:
    loss = SmoothL1(g_p, f_{p+1}) + 0.1 * CE(softmax(head(f_{p+1})), head(g_p))
Top-1 accuracy = argmax head(g_p) == argmax head(f_{p+1}) (what a greedy verify accepts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaglekv.training.head import EagleHead


def target_embed_head(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's (frozen) embedding (V, H) and LM head (V, H) weights."""
    return (model.get_input_embeddings().weight.detach(),
            model.get_output_embeddings().weight.detach())


def step_loss(head: EagleHead, embed, lm_head, ids, feats, valid, *, noise: float = 0.0,
              p_weight: float = 0.1, feat_std: float = 1.0, amp: bool = False):
    """One batch: returns (loss, stats dict of floats). ids (B, T), feats (B, T, H)."""
    inp_tok, inp_f, tgt_f = ids[:, 1:], feats[:, :-1], feats[:, 1:]
    m = valid[:, 1:]                                        # target feature f_{p+1} exists
    if noise > 0:
        inp_f = inp_f + (torch.rand_like(inp_f) - 0.5) * (2 * noise * feat_std)
    tok2 = F.pad(ids[:, 2:], (0, 1))
    v2 = F.pad(valid[:, 2:], (0, 1))                        # the data token tok_{p+2} exists
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=amp):
        g = head(embed[inp_tok], inp_f)                     # (B, T-1, H)
        gm, tm = g[m], tgt_f[m]                              # (M, H)
        logits = gm @ lm_head.t()                            # (M, V)
        with torch.no_grad():
            tlogits = tm @ lm_head.t()
    vloss = F.smooth_l1_loss(gm.float(), tm.float(), reduction="none").mean(-1).mean()
    tp = tlogits.float().softmax(-1)
    logp = logits.float().log_softmax(-1)
    ploss = -(tp * logp).sum(-1).mean()
    loss = vloss + p_weight * ploss
    with torch.no_grad():
        pred = logits.argmax(-1)
        top1 = (pred == tlogits.argmax(-1)).float().mean()
        sel = v2[m]
        tok_acc = (pred[sel] == tok2[m][sel]).float().mean() if sel.any() else top1 * 0
    return loss, {"loss": float(loss.detach()), "vloss": float(vloss.detach()),
                  "ploss": float(ploss.detach()),
                  "top1": float(top1), "tok_acc": float(tok_acc), "n": int(m.sum())}
