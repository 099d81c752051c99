"""The CUDA attention backend: Triton kernels over the paged KV cache, no padded gather.

Per layer a forward is two kernels: RoPE on q and k fused with the guarded K/V store
(`rope_store_qkv`), then attention read straight through the request -> token table
(`decode_attention` when every request extends by one token, `extend_attention` with the
causal or tree mask otherwise). Every slot the kernels read or write is checked against the
pool's size_limit; a bad one is recorded in the device error buffer and raised at the step's
sync (kernels/guard.py). The slots a target forward reads are checked once for all its layers
(`begin_forward`, kernels/table_guard.py): the layers read the checked copy with the unchecked
attention kernels. The draft's reads (its kv_indices, one layer) are checked in the kernels.

Metadata holds device tensors only (its host ints are bounds fixed at construction), so a
forward over it can be captured in a CUDA graph (cuda_graph.py) and replayed with new values
copied into the same tensors.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from eaglekv.attention.backend import AttentionBackend
from eaglekv.core import ForwardBatch
from eaglekv.kernels.attention import decode_attention, default_num_splits, extend_attention
from eaglekv.kernels.fused import norm_matmul_rope_store, rope_store_qkv
from eaglekv.kernels.guard import checks_enabled, guard_segments
from eaglekv.kernels.table_guard import guard_table_rows
from eaglekv.memory import KVPool, ReqToTokenPool
from eaglekv.model.rope import RotaryEmbedding

# A decode's split-K count is a compile-time constant of `_decode_kernel`, and the graphs
# capture it from the context limit. An eager decode (the draft's catch-up, a sampled request's
# draft steps, a batch past the graphs) that took its count from the actual context met a new
# count every 64 keys up to 1024, each compiled inside a step (~0.5 s on an H100 without
# Triton's disk cache; found 2026-12-06). On CUDA every decode now sizes its splits by the
# context limit, as the graphs do: one kernel per batch bucket; the splits past a request's
# keys are empty (they return at once, the merge skips them). EAGLEKV_FIXED_DECODE_SPLITS=0
# sizes them by the actual context again; the CPU (the interpreter: tests) always does.
FIXED_DECODE_SPLITS = os.environ.get("EAGLEKV_FIXED_DECODE_SPLITS", "1") != "0"


@dataclass
class TritonAttnMetadata:
    kv_start: torch.Tensor            # (B,) int64 flat offset of each request's row in the table
    out_cache_loc: torch.Tensor       # (T,) slots the new tokens' K/V go to
    kv_len: torch.Tensor | None       # decode: (B,) keys per request (the new one included)
    prefix_len: torch.Tensor | None = None   # extend: (B,) cached tokens before the window
    extend_len: torch.Tensor | None = None   # extend: (B,) new tokens
    q_start: torch.Tensor | None = None      # extend: (B,) first flat query of each request
    mask: torch.Tensor | None = None         # extend: (B, N, N) tree mask, None = causal
    max_extend: int = 1
    num_splits: int | None = None            # decode: split-K of the attention (host bound)
    table: torch.Tensor | None = None        # the slot table, if not req_to_token (draft)
    max_keys: int | None = None              # host bound on a request's keys (None: width)
    reads_checked: bool = False              # table holds only checked slots (begin_forward)
    one_token: bool = False                  # decode: a target forward of one new token each

    @property
    def decode(self) -> bool:
        return self.kv_len is not None


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.table = req_to_token.req_to_token.view(-1)                  # flat int32
        self.width = req_to_token.width
        dev = kv_pool.k_buffer[0].device
        self.sm_count = (torch.cuda.get_device_properties(dev).multi_processor_count
                         if dev.type == "cuda" else 132)
        self.fixed_decode_splits = FIXED_DECODE_SPLITS and dev.type == "cuda"
        if dev.type == "cuda":      # the fused decode merge's counters, before any capture
            from eaglekv.kernels.attention_triton import decode_tickets
            decode_tickets(dev)

    def init_forward_metadata(self, batch: ForwardBatch) -> TritonAttnMetadata:
        kv_start = batch.req_pool_indices * self.width
        if batch.extend_mask is None and all(e == 1 for e in batch.extend_lens_cpu):
            max_keys = max(batch.prefix_lens_cpu) + 1
            meta = self.decode_metadata(kv_start, batch.prefix_lens + 1, batch.out_cache_loc,
                                        max_keys, one_token=True)
            meta.max_keys = max_keys
            return meta
        q_start = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
        max_keys = max(p + e for p, e in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu))
        return TritonAttnMetadata(kv_start=kv_start, out_cache_loc=batch.out_cache_loc,
                                  kv_len=None, prefix_len=batch.prefix_lens,
                                  extend_len=batch.extend_lens, q_start=q_start,
                                  mask=batch.extend_mask, max_extend=max(batch.extend_lens_cpu),
                                  max_keys=max_keys)

    def decode_metadata(self, kv_start: torch.Tensor, kv_len: torch.Tensor,
                        out_cache_loc: torch.Tensor, max_kv_len: int, one_token: bool = False
                        ) -> TritonAttnMetadata:
        """One query per request over `kv_len[b]` keys; `max_kv_len` (a host bound, e.g. the
        context limit in a graph) picks the split-K, or the context limit itself when
        `fixed_decode_splits` (CUDA: one compiled kernel per batch bucket). `one_token`: the
        target's forward of one new token per request (not a verify or a draft), whose
        attention may read the earlier keys early (`attention_triton.DECODE_PREFETCH`)."""
        if self.fixed_decode_splits:
            max_kv_len = max(max_kv_len, self.width)
        splits = default_num_splits(kv_start.shape[0], self.kv_pool.kv_heads, max_kv_len,
                                    self.sm_count)
        return TritonAttnMetadata(kv_start=kv_start, out_cache_loc=out_cache_loc, kv_len=kv_len,
                                  num_splits=splits, one_token=one_token)

    def verify_metadata(self, kv_start: torch.Tensor, prefix_len: torch.Tensor,
                        extend_len: torch.Tensor, q_start: torch.Tensor, mask: torch.Tensor,
                        n: int, out_cache_loc: torch.Tensor, *, chain: bool
                        ) -> TritonAttnMetadata:
        """A verify forward's metadata: `n` tree nodes per request (b of them), node j's K/V
        at row position prefix_len + j, visible to the nodes `mask` (b, n, n) says. A chain's
        (`chain`: node i sees nodes 0..i, the causal mask) goes to the decode kernel as b * n
        queries, query (r, i) over the first prefix_len[r] + i + 1 keys of row r, while b * n
        <= CHAIN_VERIFY_DECODE_MAX_TOKENS; otherwise the extend kernel under the mask. Device
        tensors only and host ints fixed per b and n: captured per bucket as before."""
        b = kv_start.shape[0]
        if chain and 0 < b * n <= CHAIN_VERIFY_DECODE_MAX_TOKENS:
            steps = torch.arange(1, n + 1, dtype=prefix_len.dtype, device=prefix_len.device)
            return self.decode_metadata(kv_start[:, None].expand(b, n).contiguous().view(-1),
                                        (prefix_len[:, None] + steps).reshape(-1),
                                        out_cache_loc, self.width)
        return TritonAttnMetadata(kv_start=kv_start, out_cache_loc=out_cache_loc, kv_len=None,
                                  prefix_len=prefix_len, extend_len=extend_len,
                                  q_start=q_start, mask=mask, max_extend=n)

    def init_decode_metadata(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                             kv_lens: tuple[int, ...], out_cache_loc: torch.Tensor
                             ) -> TritonAttnMetadata:
        """One query per sequence i over the slots `kv_indices[kv_indptr[i] : + kv_lens[i]]`
        (the draft's branches, lists from `generate_draft_decode_kv_indices`)."""
        n = len(kv_lens)
        kv_len = torch.tensor(kv_lens, dtype=torch.int64).to(kv_indices.device, non_blocking=True)
        return self.indexed_decode_metadata(kv_indptr[:n], kv_indices, kv_len, out_cache_loc,
                                            max(kv_lens))

    def indexed_decode_metadata(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                                kv_len: torch.Tensor, out_cache_loc: torch.Tensor,
                                max_kv_len: int) -> TritonAttnMetadata:
        """As `init_decode_metadata` with the lengths on the device (n,) and a host bound.
        CPU: the offsets must be the packed segments' starts (`guard_segments`), and the
        ownership checked mode checks the reads."""
        if not kv_indptr.is_cuda:
            lens = tuple(kv_len.tolist())
            kv_indptr = guard_segments(kv_indptr, lens, kv_indices.shape[0], "draft kv_indptr")
            self.kv_pool.check_segment_reads(kv_indices, kv_indptr, lens)
        meta = self.decode_metadata(kv_indptr, kv_len, out_cache_loc, max_kv_len)
        meta.table = kv_indices
        return meta

    def begin_forward(self, meta: TritonAttnMetadata) -> TritonAttnMetadata:
        """Once per target forward, before its layers: every slot the layers will read from
        req_to_token, checked and copied in one launch (`guard_table_rows`); the metadata
        returned points the layers at the copy, with lengths clamped to it, and lets them read
        it unchecked. A draft's metadata (its own table) and `guard.unchecked()` pass through;
        so does everything inside `layer_checks()` (the kernels check every layer, the way
        before this: kept to measure one against the other)."""
        if meta.table is not None or meta.reads_checked or not checks_enabled() \
                or not CHECK_ONCE:
            return meta
        width = self.width if meta.max_keys is None else max(1, min(meta.max_keys, self.width))
        op = "decode_attention" if meta.decode else "extend_attention"
        g = guard_table_rows(self.table, meta.kv_start, meta.prefix_len,
                             meta.kv_len if meta.decode else meta.extend_len, width,
                             self.kv_pool.size_limit, op)
        if meta.decode:
            return replace(meta, kv_start=g.kv_start, kv_len=g.extend_len, table=g.rows,
                           reads_checked=True)
        return replace(meta, kv_start=g.kv_start, prefix_len=g.prefix_len,
                       extend_len=g.extend_len, table=g.rows, reads_checked=True)

    def rope_inputs(self, rope: RotaryEmbedding, positions: torch.Tensor):
        cos, sin = rope.cos_sin()
        return cos, sin, positions

    def forward_qkv(self, qkv, rope_in, layer, meta: TritonAttnMetadata, scale, num_heads,
                    num_kv_heads):
        cos, sin, positions = rope_in
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer)
        q = rope_store_qkv(qkv, cos, sin, positions, k_buf, v_buf, meta.out_cache_loc,
                           num_heads=num_heads, num_kv_heads=num_kv_heads,
                           size_limit=self.kv_pool.size_limit, layer=layer)
        return self.attend(q, layer, meta, scale)

    def forward_norm_qkv(self, x, residual, norm_weight, eps, w, rope_in, layer,
                         meta: TritonAttnMetadata, scale, num_heads, num_kv_heads, matmul=None,
                         defer_merge=False):
        """`norm_matmul_rope_store` (the qkv matmul with RoPE and the K/V store, in one kernel
        where `fused.use_gemv_rope` says so), then attend (`defer_merge`: a split-K decode
        returns its partials, `attention.DecodePartials`, for `fused.gemv_merge`)."""
        cos, sin, positions = rope_in
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer)
        q, residual = norm_matmul_rope_store(
            x, residual, norm_weight, eps, w, cos, sin, positions, k_buf, v_buf,
            meta.out_cache_loc, num_heads=num_heads, num_kv_heads=num_kv_heads,
            size_limit=self.kv_pool.size_limit, layer=layer, matmul=matmul)
        return self.attend(q, layer, meta, scale, defer_merge=defer_merge), residual

    def forward(self, q, k, v, layer, meta: TritonAttnMetadata, scale):
        """q, k already rotated: store K/V (guarded), then attend."""
        self.kv_pool.set_kv_buffer(layer, meta.out_cache_loc, k, v)
        return self.attend(q, layer, meta, scale)

    def attend(self, q: torch.Tensor, layer: int, meta: TritonAttnMetadata, scale: float,
               defer_merge: bool = False):
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer)
        limit = self.kv_pool.size_limit
        table = self.table if meta.table is None else meta.table
        check = not meta.reads_checked
        if meta.decode:
            return decode_attention(q, k_buf, v_buf, table, meta.kv_start, meta.kv_len,
                                    scale, size_limit=limit, num_splits=meta.num_splits,
                                    layer=layer, checked=check, defer_merge=defer_merge,
                                    one_token=meta.one_token and meta.reads_checked)
        return extend_attention(q, k_buf, v_buf, table, meta.kv_start, meta.prefix_len,
                                meta.extend_len, meta.q_start, scale, size_limit=limit,
                                mask=meta.mask, max_extend=meta.max_extend, layer=layer,
                                checked=check, max_keys=meta.max_keys or self.width)


CHECK_ONCE = True     # False inside `layer_checks()` only
# A chain's verify through the decode kernel (`verify_metadata`) for verifies of at most this
# many tokens (b * n: S5 and S7 chains up to batch 8); 0: off, every verify in the extend kernel
# under its tree mask. A verify layer's attention was the extend kernel 7.1 us + its merge
# 1.5 us where the decode's is 3.7 + 1.3 us (H100 profile, S5, batch 1); end to end on an H100
# (2026-12-06, bench/results/gpu_bench_h100_20261206b_vdec.json, one process) it took EAGLE-3
# S5 from 1.64x to 1.77x plain at batch 1 and S7 from 1.86x to 1.96x (batch 4: 1.53x -> 1.67x,
# 1.91x -> 2.06x). On by default since then; EAGLEKV_CHAIN_VERIFY_DECODE=0 (or the bench's
# `_novdec` modes) restores the extend kernel.
CHAIN_VERIFY_DECODE_MAX_TOKENS = int(os.environ.get("EAGLEKV_CHAIN_VERIFY_DECODE", "64"))


@contextmanager
def layer_checks():
    """Measurement only: forwards prepared (graphs captured) inside check every slot in every
    layer's attention kernel instead of once a forward (`TritonAttentionBackend.begin_forward`);
    `eaglekv bench`'s `*_layerchecks` modes time one against the other."""
    global CHECK_ONCE
    prev, CHECK_ONCE = CHECK_ONCE, False
    try:
        yield
    finally:
        CHECK_ONCE = prev
