"""Shared test helpers for the draft models: run a draft over a paged cache as the engine does
(its own one-layer KV pools, the ReqToTokenPool and the allocator), round by round; and the
plain-torch reference of the published EAGLE-1 module (test_eagle_draft, test_train_draft)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaglekv.attention import TorchAttentionBackend
from eaglekv.core import ForwardBatch
from eaglekv.memory import KVPool, ReqToTokenPool, SlotAllocator


@dataclass
class Round:
    """One round of a paged run: request b adds ns[b] tokens at positions pos[b] ..
    pos[b] + ns[b] - 1 of req_to_token row rows[b]; their slots, request by request."""
    pos: list[int]
    ns: list[int]
    rows: list[int]
    slots: torch.Tensor          # (sum(ns),)

    def take(self, per_request: list[torch.Tensor]) -> list[torch.Tensor]:
        """per_request[b]: (T_b, ...) over request b's whole sequence -> [(ns[b], ...)]."""
        return [x[p:p + n] for x, p, n in zip(per_request, self.pos, self.ns)]

    def batch(self, ids: list[torch.Tensor]) -> ForwardBatch:
        """The batch of this round's tokens; ids[b]: (T_b,) request b's whole sequence."""
        return ForwardBatch.build([x.tolist() for x in self.take(ids)], self.pos, self.rows,
                                  self.slots)


class DraftRunner:
    """A draft on its own one-layer pools (`num_pools`: one per draft layer), a ReqToTokenPool
    and an allocator, as the engine has."""

    def __init__(self, draft, page_size: int, size: int = 256, num_pools: int = 1):
        self.draft = draft
        self.pools = [KVPool(size, page_size, *draft.kv_shape()) for _ in range(num_pools)]
        self.r2t = ReqToTokenPool(4, 128)
        self.alloc = SlotAllocator(size, page_size)
        self.backends = [TorchAttentionBackend(p, self.r2t) for p in self.pools]
        self.pool, self.backend = self.pools[0], self.backends[0]

    def rounds(self, counts: list[list[int]]):
        """counts[r][b]: tokens request b adds in round r. Yields each round's `Round`, its slots
        allocated and written to req_to_token; after the last round frees every slot and row and
        checks that the allocator and the ReqToTokenPool are whole again."""
        B = len(counts[0])
        rows = [self.r2t.alloc() for _ in range(B)]
        pos, last = [0] * B, [-1] * B
        for ns in counts:
            slots = []
            for b, n in enumerate(ns):
                s = self.alloc.alloc(n, pos[b], last[b])
                self.r2t.req_to_token[rows[b], pos[b]:pos[b] + n] = s.int()
                slots.append(s)
            yield Round(list(pos), list(ns), rows, torch.cat(slots))
            pos = [p + n for p, n in zip(pos, ns)]
            last = [int(s[-1]) if len(s) else l for s, l in zip(slots, last)]
        for b, row in enumerate(rows):
            self.alloc.free(self.r2t.req_to_token[row, :pos[b]])
            self.r2t.free(row)
        self.alloc.check_integrity()
        self.r2t.check_integrity()
        assert self.alloc.is_full()

    def forward(self, rnd: Round, ids: list[torch.Tensor], hidden: torch.Tensor,
                layer: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One draft forward over the round's tokens (`layer`: that head of a multi-layer draft,
        on its own pool). ids[b]: (T_b,) whole sequence; hidden: (sum(ns), W) the features fed.
        Returns per request (logits (ns[b], V), g (ns[b], H))."""
        batch = rnd.batch(ids)
        be = self.backends[layer or 0]
        args = (batch.input_ids, batch.positions, hidden, be, be.init_forward_metadata(batch))
        out = self.draft.forward(*args) if layer is None else self.draft.forward(layer, *args)
        cfg = self.draft.cfg
        vocab = getattr(cfg, "draft_vocab_size", cfg.vocab_size)   # EAGLE-3: its own vocabulary
        assert out.logits.shape == (batch.num_tokens, vocab)
        assert out.hidden.shape == (batch.num_tokens, cfg.hidden_size)
        return list(zip(out.logits.split(rnd.ns), out.hidden.split(rnd.ns)))

    def prefill_batch(self, ids: torch.Tensor) -> tuple[ForwardBatch, torch.Tensor]:
        """One request of ids (T,) at positions 0 .. T-1 on fresh slots, left allocated:
        (its batch, the slots (T,))."""
        row = self.r2t.alloc()
        slots = self.alloc.alloc(len(ids))
        self.r2t.req_to_token[row, :len(ids)] = slots.int()
        return ForwardBatch.build([ids.tolist()], [0], [row], slots), slots


def gather(per_round: list[list[tuple[torch.Tensor, ...]]]) -> list[tuple[torch.Tensor, ...]]:
    """per_round[r][b]: a tuple of (ns[b], ...) tensors -> per request b, the tuple of their
    concatenations over the rounds."""
    return [tuple(torch.cat(parts) for parts in zip(*per_req)) for per_req in zip(*per_round)]


def target_embed_head(target_sd: dict[str, torch.Tensor], tied: bool):
    """(embedding (V, H), LM head (V, H)) of a tiny HF Llama's state dict."""
    emb = target_sd["model.embed_tokens.weight"]
    return emb, emb if tied else target_sd["lm_head.weight"]


# ---- the reference: the published module in plain torch (HF rotate-half RoPE) ------------------
def reference_forward(cfg_dict, sd, embed_w, head_w, ids, hidden):
    """Full causal attention over the whole sequence; returns (logits (T, V), g (T, H))."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    H, nh = cfg_dict["hidden_size"], cfg_dict["num_attention_heads"]
    nkv, eps = cfg_dict["num_key_value_heads"], cfg_dict["rms_norm_eps"]
    D = cfg_dict.get("head_dim") or H // nh
    T = len(ids)
    p = "layers.0."

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    x = F.linear(torch.cat([embed_w[ids], hidden], -1), sd["fc.weight"], sd.get("fc.bias"))
    h = norm(x, sd[p + "input_layernorm.weight"]) if p + "input_layernorm.weight" in sd else x
    q = F.linear(h, sd[p + "self_attn.q_proj.weight"], sd.get(p + "self_attn.q_proj.bias"))
    k = F.linear(h, sd[p + "self_attn.k_proj.weight"], sd.get(p + "self_attn.k_proj.bias"))
    v = F.linear(h, sd[p + "self_attn.v_proj.weight"], sd.get(p + "self_attn.v_proj.bias"))
    q = q.view(1, T, nh, D).transpose(1, 2)        # (1, nh, T, D)
    k = k.view(1, T, nkv, D).transpose(1, 2)       # (1, nkv, T, D)
    v = v.view(1, T, nkv, D).transpose(1, 2)
    rope = LlamaRotaryEmbedding(LlamaConfig(**{k_: v_ for k_, v_ in cfg_dict.items()
                                               if k_ not in ("model_type", "architectures")}))
    cos, sin = rope(v, torch.arange(T)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)                       # (1, nh, T, T)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(T, nh * D)
    r = x + F.linear(attn, sd[p + "self_attn.o_proj.weight"])
    m = norm(r, sd[p + "post_attention_layernorm.weight"])
    mlp = F.linear(F.silu(F.linear(m, sd[p + "mlp.gate_proj.weight"]))
                   * F.linear(m, sd[p + "mlp.up_proj.weight"]), sd[p + "mlp.down_proj.weight"])
    g = r + mlp
    return g @ head_w.T, g
