"""The trainable draft head: the published EAGLE-1/2 module as a plain nn.Module.

It runs as the engine runs it: draft input at position p is (token p+1, feature p), causal
attention over the head's own positions, RoPE at the token positions.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)
                                                       + self.eps))).to(x.dtype)


class Attention(nn.Module):
    """q/k/v read `in_features` (H; 2H in an EAGLE-3 midlayer), o_proj writes H."""

    def __init__(self, H, heads, kv_heads, D, in_features=None):
        super().__init__()
        self.heads, self.kv_heads, self.D = heads, kv_heads, D
        n_in = H if in_features is None else in_features
        self.q_proj = nn.Linear(n_in, heads * D, bias=False)
        self.k_proj = nn.Linear(n_in, kv_heads * D, bias=False)
        self.v_proj = nn.Linear(n_in, kv_heads * D, bias=False)
        self.o_proj = nn.Linear(heads * D, H, bias=False)


class MLP(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, H, heads, kv_heads, D, I, eps):
        super().__init__()
        self.self_attn = Attention(H, heads, kv_heads, D)
        self.mlp = MLP(H, I)
        self.post_attention_layernorm = RMSNorm(H, eps)


def init_params(module: nn.Module, std: float, seed: int) -> None:
    """Norm weights 1, biases 0, every other parameter ~ N(0, std) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class EagleHead(nn.Module):
    """The published EAGLE-1/2 head (SafeAILab/EAGLE cnets1.py `Model` without embed_tokens):
    state_dict keys fc.weight, fc.bias, layers.0.self_attn.{q,k,v,o}_proj.weight,
    layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight.
    q/k in Hugging Face's rotate-half RoPE layout."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, rms_norm_eps: float, rope_theta: float,
                 fc_bias: bool = True, init_std: float = 0.02, seed: int = 0):
        super().__init__()
        H = hidden_size
        self.fc = nn.Linear(2 * H, H, bias=fc_bias)
        self.layers = nn.ModuleList([Layer(H, num_heads, num_kv_heads, head_dim,
                                           intermediate_size, rms_norm_eps)])
        inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        init_params(self, init_std, seed)

    @property
    def layer(self) -> Layer:
        return self.layers[0]

    def rope(self, positions: torch.Tensor):
        """positions (..., T) -> cos, sin (..., 1, T, D) for (B, heads, T, D) tensors."""
        f = positions.float()[..., None] * self.inv_freq                    # (..., T, D/2)
        emb = torch.cat([f, f], -1)
        return emb.cos().unsqueeze(-3), emb.sin().unsqueeze(-3)

    def qkv(self, x, positions):
        """x (B, T, H) -> q (B, h, T, D), k, v (B, h, T, D) (kv heads repeated), RoPE applied."""
        a = self.layer.self_attn
        B, T, _ = x.shape
        q = a.q_proj(x).view(B, T, a.heads, a.D).transpose(1, 2)
        k = a.k_proj(x).view(B, T, a.kv_heads, a.D).transpose(1, 2)
        v = a.v_proj(x).view(B, T, a.kv_heads, a.D).transpose(1, 2)
        cos, sin = self.rope(positions)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = a.heads // a.kv_heads
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(self, x, attn):
        """x (B, T, H), attn (B, h, T, D) -> g (B, T, H)."""
        B, T, _ = x.shape
        r = x + self.layer.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        return r + self.layer.mlp(self.layer.post_attention_layernorm(r))

    def forward(self, emb, feat, positions=None):
        """emb = embed(tok_{p+1}), feat = f_p, both (B, T, H) -> g (B, T, H); causal."""
        x = self.fc(torch.cat([emb, feat], -1))
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        q, k, v = self.qkv(x, positions)
        return self.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def published_state_dict(self, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", dtype).contiguous() for n, p in self.state_dict().items()}


def head_for_target(cfg, **kw) -> tuple[EagleHead, dict]:
    """A fresh head shaped like the target's layers, and its config.json (published layout)."""
    from eaglekv.model.draft_checkpoint import random_eagle_draft
    cfg_dict, _ = random_eagle_draft(cfg, with_embed=False, fc_bias=True)
    cfg_dict["torch_dtype"] = "bfloat16"
    head = EagleHead(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size, cfg.rms_norm_eps, cfg_dict["rope_theta"], **kw)
    return head, cfg_dict
