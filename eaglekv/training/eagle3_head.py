"""The trainable EAGLE-3 head: the published module (SafeAILab/EAGLE `cnets.py: Model`, the layout
eaglekv/model/eagle3.py serves) as a plain nn.Module, in the published key layout.

One draft step over positions with inputs (token, hidden), `hidden` being the target's three
captured layer outputs (3H, fc applied) or the head's own previous output g (H):

    h = fc(a) if a is 3H wide else a
    x = cat([input_layernorm(embed(token)), hidden_norm(h)])   # (T, 2H), embedding first
    r = h + o_proj(attn(q/k/v(x)))                               # RoPE at the token positions
    g = r + mlp(post_attention_layernorm(r))                     # (T, H), feeds the next step
    logits = lm_head(norm(g))                                    # (T, Vd), the draft vocabulary

Keys: fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight,
lm_head.weight, d2t, t2d (no embed_tokens: the engine uses the target's). q/k rows in Hugging
Face's rotate-half RoPE layout, as published.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from eaglekv.training.head import MLP, Attention, RMSNorm, init_params, rotate_half
from eaglekv.training.vocab import DraftVocab


class MidLayer(nn.Module):
    def __init__(self, H, heads, kv_heads, D, I, eps):
        super().__init__()
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(H, heads, kv_heads, D, in_features=2 * H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(H, I)


class Eagle3Head(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, rms_norm_eps: float, rope_theta: float,
                 vocab: DraftVocab, init_std: float = 0.02, seed: int = 0):
        super().__init__()
        H = hidden_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = MidLayer(H, num_heads, num_kv_heads, head_dim, intermediate_size,
                                 rms_norm_eps)
        self.norm = RMSNorm(H, rms_norm_eps)
        self.lm_head = nn.Linear(H, vocab.size, bias=False)
        self.register_buffer("d2t", vocab.d2t)
        self.register_buffer("t2d", vocab.t2d)
        self.register_buffer("target_ids", vocab.target_ids, persistent=False)
        inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        init_params(self, init_std, seed)

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    def init_from_target(self, lm_head: torch.Tensor, final_norm: torch.Tensor) -> None:
        """Start the output side where the target's is: lm_head = the target's LM head rows of
        the draft vocabulary (V, H)[target_ids], norm = the target's final norm (H,)."""
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head[self.target_ids.to(lm_head.device)])
            self.norm.weight.copy_(final_norm)

    # ---- pieces of one step (the TTT unroll in training/ttt.py composes them) -----------------
    def inputs(self, tok_emb: torch.Tensor, hidden: torch.Tensor):
        """tok_emb (B, T, H), hidden (B, T, 3H | H) -> x (B, T, 2H), residual h (B, T, H)."""
        h = self.fc(hidden) if hidden.shape[-1] == 3 * self.hidden_size else hidden
        m = self.midlayer
        return torch.cat([m.input_layernorm(tok_emb), m.hidden_norm(h)], -1), h

    def rope(self, positions: torch.Tensor):
        """positions (T,) -> cos, sin (T, D), rotate-half layout."""
        f = positions.float()[:, None] * self.inv_freq                       # (T, D/2)
        emb = torch.cat([f, f], -1)
        return emb.cos(), emb.sin()

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x (B, T, 2H) -> q (B, h, T, D); k, v (B, h, T, D), kv heads repeated; RoPE applied."""
        a = self.midlayer.self_attn
        B, T, _ = x.shape
        q = a.q_proj(x).view(B, T, a.heads, a.D).transpose(1, 2)
        k = a.k_proj(x).view(B, T, a.kv_heads, a.D).transpose(1, 2)
        v = a.v_proj(x).view(B, T, a.kv_heads, a.D).transpose(1, 2)
        cos, sin = (c.to(q.dtype) for c in self.rope(positions))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = a.heads // a.kv_heads
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """residual h (B, T, H), attn (B, h, T, D) -> g (B, T, H)."""
        m = self.midlayer
        B, T, _ = h.shape
        r = h + m.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        return r + m.mlp(m.post_attention_layernorm(r))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """g (..., H) -> draft logits (..., Vd)."""
        return self.lm_head(self.norm(g))

    def published_state_dict(self, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
        """The published tensors: weights in `dtype`, d2t int64, t2d bool, all on the CPU."""
        out = {n: p.detach().to("cpu", dtype).contiguous() for n, p in self.named_parameters()}
        out["d2t"] = self.d2t.detach().to("cpu", torch.int64).contiguous()
        out["t2d"] = self.t2d.detach().to("cpu", torch.bool).contiguous()
        return out


def eagle3_head_for_target(cfg, vocab: DraftVocab, aux_layer_ids: tuple[int, ...] | None = None,
                           intermediate_size: int | None = None,
                           **kw) -> tuple[Eagle3Head, dict]:
    """A fresh head shaped like the target's layers over `vocab` (its MLP `intermediate_size`
    wide, default the target's), and its config.json in the published layout
    (`draft_vocab_size`, and the captured layers when not the default)."""
    from eaglekv.model.draft_io import random_llama_dict
    cfg_dict = {**random_llama_dict(cfg, "LlamaForCausalLMEagle3",
                                    intermediate_size=intermediate_size),
                "draft_vocab_size": vocab.size, "bias": False, "attention_bias": False,
                "torch_dtype": "bfloat16"}
    if cfg_dict.get("rope_scaling"):
        raise ValueError(f"the EAGLE-3 trainer applies plain RoPE (theta only); the target has "
                         f"rope_scaling={cfg_dict['rope_scaling']}")
    if aux_layer_ids is not None:
        cfg_dict["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    head = Eagle3Head(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg_dict["intermediate_size"], cfg.rms_norm_eps, cfg_dict["rope_theta"],
                      vocab, **kw)
    return head, cfg_dict


MLP_ROWS = ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight")   # (I, H)
MLP_COLS = "midlayer.mlp.down_proj.weight"                                      # (H, I)


def widen_mlp(sd: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
    """A published head's tensors with its MLP widened to `fresh`'s width, computing the same
    function: its gate/up rows first, then `fresh`'s (random) rows; down_proj's new columns
    zero, so the new units add nothing until training moves them (Net2Net's wider layer
    with a zero output). A head already that wide comes back unchanged; a wider one is an
    error (narrowing would change what it computes)."""
    I0, I = sd[MLP_COLS].shape[1], fresh[MLP_COLS].shape[1]
    if I0 == I:
        return sd
    if I0 > I:
        raise ValueError(f"the published head's MLP is {I0} wide, more than the {I} asked; "
                         f"narrowing it would change what it computes")
    out = dict(sd)
    for n in MLP_ROWS:
        out[n] = torch.cat([sd[n], fresh[n][I0:].to(sd[n].dtype)])
    down = sd[MLP_COLS]
    out[MLP_COLS] = torch.cat([down, down.new_zeros(down.shape[0], I - I0)], 1)
    return out
