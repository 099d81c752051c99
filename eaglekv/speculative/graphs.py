"""A greedy EAGLE step as one CUDA graph per batch bucket (`SpecStepGraphs`), replayed by
the EagleWorker between the host's slot work (`prepare_draft`: draft slots, req_to_token
entries, the draft kv-indices; `alloc_verify`) and the step's one sync.

Static inputs: each request's draft distribution and hidden state at the root, its committed
length, its req_to_token row, the root token, the draft write slots (B, K, S), the verify
slots (B, N) and a live-row flag. The draft kv-indices buffers are the DraftSlots' own (fixed
addresses). Only greedy batches without penalties or logprobs replay: a sampled step draws
with each request's own generator in the host's order, and those batches run eagerly (with
the verify forward replayed from `VerifyGraphs`).
"""

from __future__ import annotations

import torch

from eaglekv.attention.triton_backend import TritonAttnMetadata
from eaglekv.cuda_graph import CapturedForwards
from eaglekv.sampling import valid_argmax
from eaglekv.speculative.accept import greedy_accept
from eaglekv.speculative.drafter import DraftOut
from eaglekv.speculative.slots import DraftBatch
from eaglekv.speculative.tree import build_tree, organize


class SpecStepGraphs(CapturedForwards):
    """A whole greedy EAGLE step on the device, one graph per batch bucket: the draft loop and
    the tree, the verify forward under the tree mask, greedy acceptance, the commit moves of
    the accepted K/V and the draft extend over the verify window. The host allocates the
    draft and the verify slots before the replay (both held at once: `DraftSlots.peak_pages`
    counts them together), then reads one small tensor at the step's sync:
    [usable, accept_len, committed tokens...] per request.

    A padded row has committed length 0, row 0 of req_to_token (the padding row) and only
    slot 0 (the padding page) to write: it reads and writes no request's KV."""

    name = "spec step"
    first_call_id = 4 << 20

    def __init__(self, worker, max_batch: int, progress: bool = True, capture: bool = True):
        res = worker.res
        super().__init__(res.model, res.backend, max_batch, capture)
        self.worker = worker
        S, K, N, n, dev = worker.S, worker.K, worker.N, self.buckets[-1], res.device
        V, H = res.model.cfg.vocab_size, res.model.cfg.hidden_size
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        self.root_logits = torch.zeros(n, V, dtype=res.dtype, device=dev)
        self.root_hidden = torch.zeros(n, H, dtype=res.dtype, device=dev)
        self.seq_lens, self.live, self.rows, self.root = z(n), z(n), z(n), z(n)
        self.dslots, self.vslots = z(n, K, S), z(n, N)
        self.extend_len = torch.full((n,), N, dtype=torch.int64, device=dev)
        self.q_start = torch.arange(n, device=dev) * N
        self.capture_all(progress)

    def _forward(self, b: int):
        w, res = self.worker, self.worker.res
        S, N = w.S, w.N
        L, rows, vslots = self.seq_lens[:b], self.rows[:b], self.vslots[:b]
        # 1. draft: S - 1 forwards over the branches, then the tree
        d = DraftBatch(w.slots, self.dslots[:b], [])
        pool = w.loop.run(None, self.root_logits[:b], self.root_hidden[:b], L,
                          self.dslots[:b], d.decode_meta, None, d.reorder_kv,
                          live=self.live[:b])
        tree = build_tree(self.root[:b], pool.tokens, pool.parents, organize(pool.scores, N),
                          None)
        # 2. verify: N nodes per request at L + depth under the tree mask
        meta = TritonAttnMetadata(kv_start=rows * self.backend.width,
                                  out_cache_loc=vslots.reshape(-1), kv_len=None, prefix_len=L,
                                  extend_len=self.extend_len[:b], q_start=self.q_start[:b],
                                  mask=tree.mask, max_extend=N)
        out = res.model.forward_tokens(tree.tokens.reshape(-1),
                                       (L[:, None] + tree.depth).reshape(-1), self.backend,
                                       meta, return_hidden=True,
                                       capture_layers=w.drafter.capture_layers)
        logits = out.logits.view(b, N, -1)                                       # (b, N, V)
        feats = w.drafter.features(out).view(b, N, -1)                           # (b, N, Hf)
        # 3. greedy acceptance; 4. the accepted K/V to depth order (as EagleWorker.decode)
        ok = valid_argmax(logits)                                                 # (b,)
        vr = greedy_accept(tree, logits.argmax(-1), S)
        committed = vr.committed_tokens(tree)                                     # (b, S + 1)
        P = min(S, N - 1)
        path, dst = vr.path[:, 1:P + 1], vslots[:, 1:P + 1]
        src = torch.where(path >= 0, vslots.gather(1, path.clamp(min=0)), dst)
        res.kv_pool.move_kv(dst, src)
        # 5. the draft over the verify window: the next roots
        window = w.window_forward(rows, L, committed, feats, vslots, vr)
        host = torch.cat([ok[:, None].long(), vr.accept_len[:, None], committed], 1)
        return host, window

    def run(self, root_logits, root_hidden, seq_lens, rows, root, dslots, vslots):
        """One greedy step of n requests (device tensors; draft kv-indices prepared, verify
        slots in req_to_token) -> (host (n, S + 3) int64, DraftOut of the next roots), views
        of the graph's buffers valid until the next replay."""
        n = seq_lens.shape[0]
        b = self.bucket(n)
        for dst, src in ((self.root_logits, root_logits), (self.root_hidden, root_hidden),
                         (self.seq_lens, seq_lens), (self.rows, rows), (self.root, root),
                         (self.dslots, dslots), (self.vslots, vslots)):
            dst[:n].copy_(src)
        self.live[:n].fill_(1)
        if b > n:     # rows a larger batch left: padding again
            for buf in (self.seq_lens, self.live, self.rows, self.dslots, self.vslots):
                buf[n:b].zero_()
        host, window = self._replay(b)
        return host[:n], DraftOut(window.logits[:n], window.hidden[:n])
