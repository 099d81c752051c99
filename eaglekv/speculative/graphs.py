"""The draft phase of a greedy EAGLE step as CUDA graphs, one per batch bucket: the S - 1
draft forwards with their top-k selections (DraftLoop) and the tree built from the candidate
pool (organize, build_tree), replayed by the EagleWorker between `prepare_draft` (slots,
req_to_token entries and the draft kv-indices, eager) and the verify graph.

Static inputs: each request's draft distribution and hidden state at the root, its committed
length, the root token, the draft write slots (B, K, S) and a live-row flag. A padded row has
length 0 and flag 0: its draft forwards read no key (kv_len 0) and write the padding page
(slot 0). The draft kv-indices buffers are the DraftSlots' own (fixed addresses). Only greedy
batches replay: a sampled chain draws with each request's own generator, on the host's order.
"""

from __future__ import annotations

import torch

from eaglekv.core import DraftTree
from eaglekv.cuda_graph import CapturedForwards
from eaglekv.speculative.slots import DraftBatch
from eaglekv.speculative.tree import build_tree, organize


class DraftGraphs(CapturedForwards):
    name = "draft"
    first_call_id = 3 << 20

    def __init__(self, worker, max_batch: int, progress: bool = True, capture: bool = True):
        drafter, res = worker.drafter, worker.res
        super().__init__(res.model, drafter.backend, max_batch, capture)
        self.worker = worker
        S, K, n, dev = worker.S, worker.K, self.buckets[-1], res.device
        V, H = res.model.cfg.vocab_size, res.model.cfg.hidden_size
        self.root_logits = torch.zeros(n, V, dtype=res.dtype, device=dev)
        self.root_hidden = torch.zeros(n, H, dtype=res.dtype, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.live = torch.zeros(n, dtype=torch.int64, device=dev)
        self.root = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(n, K, S, dtype=torch.int64, device=dev)   # padding: slot 0
        self.capture_all(progress)

    def _forward(self, b: int) -> DraftTree:
        w = self.worker
        d = DraftBatch(w.slots, self.slots[:b], [])
        pool = w.loop.run(None, self.root_logits[:b], self.root_hidden[:b], self.seq_lens[:b],
                          self.slots[:b], d.decode_meta, None, d.reorder_kv,
                          live=self.live[:b])
        return build_tree(self.root[:b], pool.tokens, pool.parents,
                          organize(pool.scores, w.N), None)

    def run(self, root_logits: torch.Tensor, root_hidden: torch.Tensor, seq_lens: torch.Tensor,
            root: torch.Tensor, slots: torch.Tensor) -> DraftTree:
        """The draft phase of n greedy requests -> their verify tree (views of the graph's
        buffers, valid until the next replay). The draft kv-indices must be prepared."""
        n = seq_lens.shape[0]
        b = self.bucket(n)
        self.root_logits[:n].copy_(root_logits)
        self.root_hidden[:n].copy_(root_hidden)
        self.seq_lens[:n].copy_(seq_lens)
        self.root[:n].copy_(root)
        self.slots[:n].copy_(slots)
        self.live[:n].fill_(1)
        if b > n:     # rows a larger batch left: padding again
            self.seq_lens[n:b].zero_()
            self.live[n:b].zero_()
            self.slots[n:b].zero_()
        t = self._replay(b)
        return DraftTree(tokens=t.tokens[:n], parent=t.parent[:n], depth=t.depth[:n],
                         mask=t.mask[:n], first_child=t.first_child[:n],
                         next_sibling=t.next_sibling[:n], draft_probs=None)
