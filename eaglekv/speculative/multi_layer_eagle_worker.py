"""Multi-layer EAGLE (MTP-style drafts): S draft layers, step k uses layer k.

The draft is one chain of S tokens: select step 0 takes layer 0's distribution at the root
(from its extend), draft step k >= 1 runs layer k alone on the depth-k token (at position
L_b + k - 1, fed the previous step's output hidden) and attends to layer k's own KV of the
committed prefix plus its own new slot. Every layer has its own one-layer KV pool; all share
the ReqToTokenPool and the slot ids.

After verify the draft extends over the whole window of N = S + 1 verify tokens of every
request at once (`b*N + j` is request b's window position j), before the host sync: rows past
the accepted ones write K/V only into slots that are freed right after, and the next root's
distribution is read at flat index `b*N + accept_len - 1` (accept_len counting the bonus,
i.e. `b*N + accepted`). That fixed shape is why guard 3 holds:
num_draft_tokens == num_steps + 1, and topk == 1.
"""

from __future__ import annotations

import torch

from eaglekv.attention import TorchAttentionBackend
from eaglekv.core import ForwardBatch
from eaglekv.errors import ConfigError
from eaglekv.memory import KVPool
from eaglekv.speculative.drafter import Drafter, DraftOut
from eaglekv.speculative.eagle_worker import EagleWorker


def check_chain_config(spec, who: str) -> None:
    """Guard 3 (SGLang PR #27486): one chain of S drafts plus the root fills the window."""
    S, K, N = spec.num_steps, spec.topk, spec.num_draft_tokens
    if N != S + 1:
        raise ConfigError(f"{who}: num_draft_tokens={N} must equal num_steps + 1 = {S + 1} "
                          f"(num_steps={S}): the draft is one chain of one token per draft "
                          f"layer plus the root, and the extend window, the root index "
                          f"b*N + accept_len - 1 and the chain parents all assume it")
    if K != 1:
        raise ConfigError(f"{who}: topk={K} must be 1: multi-layer EAGLE drafts a single "
                          f"chain (step k uses layer k), it does not branch")


class MultiLayerEagleDraftWorker(Drafter):
    """The draft side: S heads, each on its own KV pool."""

    def __init__(self, model, spec, size: int, page_size: int, req_to_token, dtype, device):
        check_chain_config(spec, "MultiLayerEagleDraftWorker")   # before any buffer exists
        if model.num_layers != spec.num_steps:
            raise ConfigError(f"the multi-layer draft has {model.num_layers} layers but "
                              f"num_steps={spec.num_steps}: step k uses layer k, so they must "
                              f"be equal")
        self.model, self.S = model, spec.num_steps
        _, kv_heads, head_dim = model.kv_shape()
        self.pools = [KVPool(size, page_size, 1, kv_heads, head_dim, dtype, device)
                      for _ in range(self.S)]
        self.backends = [TorchAttentionBackend(p, req_to_token) for p in self.pools]
        self.kv_pool = self.pools[0]

    def _all_layers(self, batch: ForwardBatch, hidden: torch.Tensor, idx: torch.Tensor) -> DraftOut:
        """Every layer over `batch` (same inputs: token p + 1 with the target's hidden at p);
        layer 0's logits and hidden at flat indices `idx`."""
        meta = self.backends[0].init_forward_metadata(batch)  # same table for every pool
        outs = [self.model.forward(k, batch.input_ids, batch.positions, hidden,
                                   self.backends[k], meta, logits_indices=idx,
                                   compute_logits=k == 0) for k in range(self.S)]
        return DraftOut(outs[0].logits, outs[0].hidden[idx])

    def extend(self, batch, hidden, contexts=None) -> DraftOut:
        return self._all_layers(batch, hidden, batch.last_token_indices)

    def extend_window(self, batch, hidden, idx) -> DraftOut:
        return self._all_layers(batch, hidden, idx)

    def decode_metadata(self, step, kv_indptr, kv_indices, kv_lens, out_cache_loc,
                        kv_len=None):
        """Layer step + 1 sees the committed prefix and its own new slot only: the earlier
        chain tokens went through other layers, so its pool holds nothing for them."""
        dev = kv_indices.device
        it = step + 1
        L = torch.tensor([n - it for n in kv_lens], device=dev)          # (n,) prefix lengths
        key = torch.arange(max(kv_lens) - it + 1, device=dev)            # (Lmax + 1,)
        flat = kv_indptr[:len(kv_lens), None].to(torch.int64) + key[None, :]  # (n, Lmax+1)
        prefix = key[None, :] < L[:, None]
        flat = torch.where(prefix, flat, torch.zeros_like(flat))
        kv_idx = torch.where(prefix, kv_indices[flat].to(torch.int64),
                             out_cache_loc.to(torch.int64)[:, None])      # (n, Lmax + 1)
        valid = key[None, :] <= L[:, None]
        meta = self.backends[it].padded_decode_metadata(kv_idx, valid, out_cache_loc)
        return it, meta

    def decode(self, tokens, positions, hidden, meta, contexts=None) -> DraftOut:
        layer, m = meta
        out = self.model.forward(layer, tokens, positions, hidden, self.backends[layer], m)
        return DraftOut(out.logits, out.hidden)


class MultiLayerEagleWorker(EagleWorker):
    def __init__(self, res, drafter, spec, chain_steps: int = 1):
        check_chain_config(spec, "MultiLayerEagleWorker")         # before any buffer exists
        super().__init__(res, drafter, spec, chain_steps)

    def _extend_window(self, reqs, res, committed, feats, vslots, seq_lens):
        if not hasattr(self.drafter, "extend_window"):  # e.g. a scripted drafter: after the sync
            return None
        B, N = vslots.shape
        dev = vslots.device
        cols = torch.arange(N, device=dev)
        # window position j of request b: token L_b + j + 1 (accepted, then the bonus, then
        # filler 0 whose rows land in slots freed right after), target hidden at L_b + j
        batch = ForwardBatch(input_ids=committed.clamp(min=0).reshape(-1),
                             positions=(seq_lens[:, None] + cols[None, :]).reshape(-1),
                             req_pool_indices=torch.tensor([r.row for r in reqs], device=dev),
                             prefix_lens=seq_lens, extend_lens=torch.full((B,), N, device=dev),
                             out_cache_loc=vslots.reshape(-1),
                             prefix_lens_cpu=tuple(r.kv_len for r in reqs),
                             extend_lens_cpu=(N,) * B)
        idx = torch.arange(B, device=dev) * N + res.accept_len           # b*N + accept_len - 1
        return self.drafter.extend_window(batch, feats.reshape(B * N, -1), idx)
