"""Attention behind a small interface: a backend prepares metadata once per forward from the
batch (kv indices, masks), then each layer only calls `forward`.

The PyTorch reference backend gathers K/V through req_to_token into padded `(B, S)` tensors and
runs SDPA with a causal (or custom, e.g. tree) mask. The gather is guarded: every slot id read
from req_to_token is checked against the pool's size_limit once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaglekv.core import ForwardBatch
from eaglekv.kernels.fused import norm_matmul
from eaglekv.kernels.guard import guard_segments
from eaglekv.memory import KVPool, ReqToTokenPool
from eaglekv.model.rope import RotaryEmbedding


class AttentionBackend:
    """Interface: `init_forward_metadata(batch)`, `begin_forward` and `rope_inputs` once per
    forward, then `forward_qkv(...)` (or `forward(...)` with q and k already rotated) per
    layer."""

    def init_forward_metadata(self, batch: ForwardBatch):
        raise NotImplementedError

    def begin_forward(self, meta):
        """Work done once per forward before the first layer, inside a captured graph too
        (the Triton backend checks the slots every layer will read); returns the metadata the
        layers use."""
        return meta

    def rope_inputs(self, rope: RotaryEmbedding, positions: torch.Tensor):
        """What `forward_qkv` needs to rotate this forward's tokens: here (T, 1, D/2) complex
        rotations, computed once per forward."""
        return rope.rotations(positions)

    def forward_qkv(self, qkv: torch.Tensor, rope_in, layer: int, meta, scale: float,
                    num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """qkv: (T, H + 2 Hkv, D), q and k not yet rotated -> attention output (T, H, D); the
        new tokens' K/V go into the cache on the way."""
        H, Hkv = num_heads, num_kv_heads
        qk = RotaryEmbedding.apply(qkv[:, :H + Hkv], rope_in)           # q and k in one go
        return self.forward(qk[:, :H], qk[:, H:], qkv[:, H + Hkv:], layer, meta, scale)

    def forward_norm_qkv(self, x: torch.Tensor, residual: torch.Tensor | None,
                         norm_weight: torch.Tensor, eps: float, w: torch.Tensor, rope_in,
                         layer: int, meta, scale: float, num_heads: int, num_kv_heads: int,
                         matmul=None, defer_merge: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's add + RMSNorm + qkv matmul (`fused.norm_matmul`, the matmul through
        `matmul`), then `forward_qkv` -> (attention output (T, H, D), new residual).
        `defer_merge` (a one-token decode whose o projection is `fused.gemv_merge`): a backend
        may return the attention as `attention.DecodePartials`; this one never does."""
        qkv, residual = norm_matmul(x, residual, norm_weight, eps, w, matmul=matmul)
        H, Hkv = num_heads, num_kv_heads
        qkv = qkv.view(x.shape[0], H + 2 * Hkv, qkv.shape[1] // (H + 2 * Hkv))
        return self.forward_qkv(qkv, rope_in, layer, meta, scale, H, Hkv), residual

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta,
                scale: float) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class TorchAttnMetadata:
    batch: ForwardBatch | None        # None for decode metadata built from kv indices
    kv_idx: torch.Tensor              # (B, Smax) int64 slots, padded with slot 0
    tok_b: torch.Tensor               # (T,) request of each flat token
    tok_t: torch.Tensor               # (T,) index of the token within its request's extend
    t_max: int
    mask: torch.Tensor | None         # (B, 1, Tmax, Smax) bool, None if nothing is masked
    single: bool                      # B == 1: no padding, flat == padded
    out_cache_loc: torch.Tensor       # (T,) slots the new tokens' K/V are written to
    run_start: int | None = None      # B == 1 and slots consecutive: K/V are a plain slice


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    def init_forward_metadata(self, batch: ForwardBatch) -> TorchAttnMetadata:
        dev = batch.input_ids.device
        seq_lens = batch.seq_lens_cpu
        ext = batch.extend_lens_cpu
        B, s_max, t_max = batch.batch_size, max(seq_lens), max(ext)
        rows = self.req_to_token.req_to_token[batch.req_pool_indices]   # (B, W) int32
        kv_idx = rows[:, :s_max].to(torch.int64)                         # (B, Smax)
        seq = torch.tensor(seq_lens, device=dev)
        key_pos = torch.arange(s_max, device=dev)
        valid_key = key_pos[None, :] < seq[:, None]                      # (B, Smax)
        kv_idx = torch.where(valid_key, kv_idx, torch.zeros_like(kv_idx))
        # guarded read: CPU raises now; CUDA records the error (no sync) and reads slot 0 instead
        kv_idx = self.kv_pool.guard_reads(kv_idx)
        tok_b = torch.repeat_interleave(torch.arange(B, device=dev), batch.extend_lens,
                                        output_size=batch.num_tokens)
        starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
        tok_t = torch.arange(batch.num_tokens, device=dev) - starts[tok_b]
        # query t of request b sits at position prefix_b + t
        q_pos = batch.prefix_lens[:, None] + torch.arange(t_max, device=dev)[None, :]  # (B, Tmax)
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & valid_key[:, None, :]   # (B,Tmax,Smax)
        if batch.extend_mask is not None:
            # keys inside the extend window follow the custom (tree) mask; the prefix stays
            # visible. Key column s of request b is window token rel = s - prefix_b.
            rel = key_pos[None, :] - batch.prefix_lens[:, None]                         # (B, Smax)
            inside = (rel >= 0) & (rel < batch.extend_lens[:, None])                    # (B, Smax)
            em = batch.extend_mask[:, :t_max, :t_max]                                   # (B,Tmax,Tmax)
            rel_idx = rel.clamp(0, t_max - 1)[:, None, :].expand(B, t_max, s_max)       # (B,Tmax,Smax)
            mask = torch.where(inside[:, None, :], em.gather(2, rel_idx), mask)
        trivial = B == 1 and t_max == 1 and batch.extend_mask is None
        run_start = None
        if B == 1 and not kv_idx.is_cuda:  # consecutive slots: read a slice, no gather (CPU)
            first = int(kv_idx[0, 0])
            if torch.equal(kv_idx[0], torch.arange(first, first + s_max, device=dev)):
                run_start = first
        return TorchAttnMetadata(batch=batch, kv_idx=kv_idx, tok_b=tok_b, tok_t=tok_t, t_max=t_max,
                                 mask=None if trivial else mask[:, None], single=B == 1,
                                 out_cache_loc=batch.out_cache_loc, run_start=run_start)

    def init_decode_metadata(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                             kv_lens: tuple[int, ...], out_cache_loc: torch.Tensor
                             ) -> TorchAttnMetadata:
        """One query token per sequence, sequence i attending to the slots
        `kv_indices[kv_indptr[i] : kv_indptr[i] + kv_lens[i]]` (its own new slot included).

        This is how the draft decodes its topk branches: each branch is a sequence whose list
        (prefix + its draft tokens) comes from `generate_draft_decode_kv_indices`. `kv_lens`
        is given on the host, so no device value is read here.
        """
        dev = kv_indices.device
        n, s_max = len(kv_lens), max(kv_lens)
        lens = torch.tensor(kv_lens, device=dev)                          # (n,)
        key_pos = torch.arange(s_max, device=dev)
        valid = key_pos[None, :] < lens[:, None]                          # (n, Smax)
        starts = guard_segments(kv_indptr[:n], kv_lens, kv_indices.shape[0], "draft kv_indptr")
        flat = starts[:, None].to(torch.int64) + key_pos[None, :]         # (n, Smax)
        flat = torch.where(valid, flat, torch.zeros_like(flat))
        return self.padded_decode_metadata(kv_indices[flat].to(torch.int64), valid, out_cache_loc)

    def padded_decode_metadata(self, kv_idx: torch.Tensor, valid: torch.Tensor,
                               out_cache_loc: torch.Tensor) -> TorchAttnMetadata:
        """One query token per row i, attending to the slots `kv_idx[i, valid[i]]`
        (kv_idx, valid: (n, Smax)); every slot read is guarded."""
        kv_idx = torch.where(valid, kv_idx, torch.zeros_like(kv_idx))
        kv_idx = self.kv_pool.guard_reads(kv_idx)
        n = kv_idx.shape[0]
        ar = torch.arange(n, device=kv_idx.device)
        return TorchAttnMetadata(batch=None, kv_idx=kv_idx, tok_b=ar, tok_t=torch.zeros_like(ar),
                                 t_max=1, mask=valid[:, None, None, :], single=n == 1,
                                 out_cache_loc=out_cache_loc)

    def forward(self, q, k, v, layer, meta: TorchAttnMetadata, scale):
        """q: (T, H, D), k/v: (T, Hkv, D) for the new tokens -> (T, H, D)."""
        self.kv_pool.set_kv_buffer(layer, meta.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer)
        B, S = meta.kv_idx.shape
        if meta.run_start is not None:  # slots run_start .. run_start + S - 1 (checked above)
            kc = k_buf[meta.run_start:meta.run_start + S].transpose(0, 1).unsqueeze(0)
            vc = v_buf[meta.run_start:meta.run_start + S].transpose(0, 1).unsqueeze(0)
        else:
            flat = meta.kv_idx.view(-1)
            kc = k_buf.index_select(0, flat).view(B, S, *k_buf.shape[1:]).transpose(1, 2)
            vc = v_buf.index_select(0, flat).view(B, S, *v_buf.shape[1:]).transpose(1, 2)
        # kc, vc: (B, Hkv, S, D)
        if meta.single:
            qp = q.transpose(0, 1).unsqueeze(0)            # (1, H, T, D)
        else:
            T, H, D = q.shape
            qp = q.new_zeros(B, meta.t_max, H, D)
            qp[meta.tok_b, meta.tok_t] = q
            qp = qp.transpose(1, 2)                         # (B, H, Tmax, D)
        out = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=meta.mask, scale=scale,
                                             enable_gqa=kc.shape[1] != qp.shape[1])
        out = out.transpose(1, 2)                           # (B, Tmax, H, D)
        if meta.single:
            return out[0]
        return out[meta.tok_b, meta.tok_t]                  # (T, H, D)
