"""A greedy EAGLE step as one CUDA graph per batch bucket (`SpecStepGraphs`), replayed by
the EagleWorker between the host's slot allocation (`DraftSlots.alloc_draft`,
`alloc_verify_slots`) and the step's one sync.

Static inputs: each request's draft distribution and hidden state at the root, and one packed
int64 block of its committed length, req_to_token row, root token, live-row flag, draft write
slots (B, K, S) and verify slots (B, N). The draft kv-indices buffers are the DraftSlots' own
(fixed addresses), filled inside the graph. Only greedy batches without penalties or
logprobs replay: a sampled step draws with each request's own generator in the host's order,
and those batches run eagerly (with the verify forward replayed from `VerifyGraphs`).
"""

from __future__ import annotations

import torch

from eaglekv.errors import KVIndexError
from eaglekv.cuda_graph import CapturedForwards
from eaglekv.kernels.greedy import greedy_pick
from eaglekv.kernels.guard import guard_indices, guard_path
from eaglekv.speculative.accept import greedy_accept
from eaglekv.speculative.drafter import DraftOut, stack_roots
from eaglekv.speculative.phases import phase
from eaglekv.speculative.slots import DraftBatch
from eaglekv.speculative.tree import chain_shape, verify_tree


class SpecStepGraphs(CapturedForwards):
    """A whole greedy EAGLE step on the device, one graph per batch bucket: the draft's
    req_to_token entries and kv lists, the draft loop and the tree, the verify window's
    req_to_token entries, the verify forward under the tree mask, greedy acceptance, the
    commit moves of the accepted K/V and the draft extend over the verify window. The host
    allocates the draft and the verify slots before the replay (both held at once:
    `DraftSlots.peak_pages` counts them together), packs every per-request input into one
    pinned block (one host-to-device copy), then reads one small tensor at the step's sync:
    [usable, accept_len, committed tokens...] per request. So a step costs the host five
    device calls: the copy, two root copies, the replay and the read.

    A padded row has committed length 0, row 0 of req_to_token (the padding row), live 0 and
    only slot 0 (the padding page) to write: it reads and writes no request's KV."""

    name = "spec step"
    first_call_id = 4 << 20

    def __init__(self, worker, max_batch: int, progress: bool = True, capture: bool = True):
        res = worker.res
        super().__init__(res.model, res.backend, max_batch, capture)
        self.worker = worker
        S, K, N, n, dev = worker.S, worker.K, worker.N, self.buckets[-1], res.device
        V, H = res.model.cfg.vocab_size, res.model.cfg.hidden_size
        self.root_logits = torch.zeros(n, V, dtype=res.dtype, device=dev)
        self.root_hidden = torch.zeros(n, H, dtype=res.dtype, device=dev)
        # the packed inputs: [seq_lens | rows | root | live | draft slots (n*K*S) | verify
        # slots (n*N)], each region sized for the largest bucket; a bucket uses the first
        # b (b*K*S, b*N) entries of each, so every view is contiguous
        self.widths = (1, 1, 1, 1, K * S, N)
        self.offsets = [0]
        for w in self.widths:
            self.offsets.append(self.offsets[-1] + w * n)
        self.host = torch.zeros(self.offsets[-1], dtype=torch.int64)
        if capture:
            self.host = self.host.pin_memory()
        self.host_np = self.host.numpy()
        self.inputs = torch.zeros(self.offsets[-1], dtype=torch.int64, device=dev)
        self.extend_len = torch.full((n,), N, dtype=torch.int64, device=dev)
        self.q_start = torch.arange(n, device=dev) * N
        # the batch's committed lengths summed on the host (guard 2's fit, checked in `run`
        # before the replay; 0 while capturing: every row is padding then)
        self.lens_sum = 0
        self.chain = None         # run_chain's buffers, made on its first use
        self.chains = 0           # chains run (each of 2+ replays)
        # a chain's tree but its tokens, made once before the capture (`tree.chain_shape`)
        self.tree_shape = chain_shape(n, N, dev) if K == 1 else None
        self.capture_all(progress)

    def _views(self, b: int, x) -> list:
        """The regions of the packed block `x` (device tensor or host array) for bucket b."""
        w = self.worker
        out = [x[o:o + b * width] for o, width in zip(self.offsets, self.widths)]
        out[4] = out[4].reshape(b, w.K, w.S)
        out[5] = out[5].reshape(b, w.N)
        return out

    def _forward(self, b: int):
        w, res = self.worker, self.worker.res
        S, N = w.S, w.N
        L, rows, root, live, dslots, vslots = self._views(b, self.inputs)
        # 1. draft: its slots checked (a bad one is named from this static buffer at the
        # sync, and slot 0 goes on in its place), into req_to_token, its kv lists (guarded),
        # S - 1 forwards over the branches, then the tree
        with phase("draft"):
            dslots = guard_indices(dslots, res.kv_pool.size_limit, "draft out_cache_loc")
            w.slots.write_draft_tables(rows, L, dslots, self.lens_sum)
            d = DraftBatch(w.slots, dslots, [])
            pool = w.loop.run(None, self.root_logits[:b], self.root_hidden[:b], L, dslots,
                              d.decode_meta, None, d.reorder_kv, live=live)
            tree = verify_tree(root, pool, N, chain=w.K == 1, shape=self.tree_shape)
        # 2. verify: N nodes per request at L + depth under the tree mask
        with phase("verify"):
            w.slots.write_verify_table(rows, L, vslots)
            meta = self.backend.verify_metadata(rows * self.backend.width, L,
                                                self.extend_len[:b], self.q_start[:b],
                                                tree.mask, N, vslots.reshape(-1),
                                                chain=w.K == 1)
            out = res.model.forward_tokens(tree.tokens.reshape(-1),
                                           (L[:, None] + tree.depth).reshape(-1), self.backend,
                                           meta, return_hidden=True,
                                           capture_layers=w.drafter.capture_layers)
            logits = out.logits.view(b, N, -1)                                   # (b, N, V)
            feats = w.drafter.features(out).view(b, N, -1)                       # (b, N, Hf)
        # 3. greedy acceptance; 4. the accepted K/V to depth order (as EagleWorker.decode)
        # each node's argmax and its validity in one launch (kernels/greedy.py)
        with phase("accept"):
            pick = greedy_pick(logits.view(b * N, -1)).view(b, N, 2)              # (b, N, 2)
            ok = pick[..., 1].all(-1)                                             # (b,)
            vr = greedy_accept(tree, pick[..., 0], S)
            # the accepted nodes address the verify window: checked as the eager step does
            vr.path = guard_path(vr.path, tree.parent, "tree retrieve (accepted node)")
            committed = vr.committed_tokens(tree)                                 # (b, S + 1)
            P = min(S, N - 1)
            path, dst = vr.path[:, 1:P + 1], vslots[:, 1:P + 1]
            src = torch.where(path >= 0, vslots.gather(1, path.clamp(min=0)), dst)
            res.kv_pool.move_kv(dst, src)
        # 5. the draft over the verify window: the next roots
        with phase("extend"):
            window = w.window_forward(rows, L, committed, feats, vslots, vr)
        host = torch.cat([ok[:, None].long(), vr.accept_len[:, None], committed], 1)
        return host, window

    def _fill(self, reqs, dslots: torch.Tensor, vslots: torch.Tensor, reach: int) -> int:
        """Pack the n requests' inputs (draft slots (n, K, S), the first step's verify slots
        (n, N), on the host) into the static buffers; guard 2 checked for their committed
        lengths plus `reach` tokens each. -> the bucket."""
        n = len(reqs)
        b = self.bucket(n)
        lens = [r.kv_len for r in reqs]
        self.lens_sum = sum(lens)
        self.worker.slots.check_fit(self.lens_sum + n * reach, b)   # guard 2, padded rows in
        h = self.host_np
        h[:] = 0                                           # padded rows: row 0, slot 0, dead
        L, rows, root, live, ds, vs = self._views(b, h)
        L[:n], rows[:n], live[:n] = lens, [r.row for r in reqs], 1
        root[:n] = [r.output_ids[-1] for r in reqs]
        ds[:n], vs[:n] = dslots.numpy(), vslots.numpy()
        # the host block is not written again before the step's sync: the copy is done then
        self.inputs.copy_(self.host, non_blocking=True)
        stack_roots(reqs, 0, self.root_logits[:n])
        stack_roots(reqs, 1, self.root_hidden[:n])
        return b

    def run(self, reqs, dslots: torch.Tensor, vslots: torch.Tensor):
        """One greedy step of the n requests `reqs` (draft slots (n, K, S) and verify slots
        (n, N) allocated, on the host) -> (host (n, S + 3) int64, DraftOut of the next roots),
        views of the graph's buffers valid until the next replay."""
        n = len(reqs)
        host, window = self._replay(self._fill(reqs, dslots, vslots, 0))
        return host[:n], DraftOut(window.logits[:n], window.hidden[:n])

    def run_chain(self, reqs, dslots: torch.Tensor, vchain: torch.Tensor):
        """k greedy steps of the n requests back to back, no host work between them (the
        speculative form of `DecodeGraphs.replay_chain`): step j + 1's inputs are made from
        step j's outputs on the device (committed length + accept_len + 1, the root token
        committed[accept_len], the window's draft roots), its verify slots are `vchain[j + 1]`
        and the draft slots are the same scratch every step. A request whose budget
        (max_new_tokens) is used up after step j is frozen for the rest of the chain: it
        becomes a padded row (row 0, length 0, not live, only slot 0 to write), so it reads
        and writes no request's KV nor req_to_token entry, and its positions never pass what
        one step may reach at its budget's end (EagleWorker._chain_result stops counting it
        there too). `vchain` (k, n, N) host
        slots, each step's own; every slot the chain writes is range-checked here on the host
        before the first replay (the in-graph guards name a bad slot from the static buffer,
        which after a chain holds the last step's only).
        -> (host (k, n, S + 3) int64 per step, DraftOut of the last step's next roots), on the
        device, read at the step's one sync."""
        k, n, N = vchain.shape
        S = self.worker.S
        limit = self.worker.res.kv_pool.size_limit
        for name, s in (("spec chain verify out_cache_loc", vchain),
                        ("spec chain draft out_cache_loc", dslots)):
            bad = (s < 0) | (s >= limit)
            if bool(bad.any()):
                raise KVIndexError(name, int(s[bad][0]), limit, int(bad.sum()), s.numel())
        b = self._fill(reqs, dslots, vchain[0], (k - 1) * (S + 1))
        self.chains += 1
        n_max = self.buckets[-1]
        if self.chain is None or self.chain[0].shape[0] < k + 1:
            dev = self.inputs.device
            host = torch.zeros(k + 1, n_max * N, dtype=torch.int64)   # + the budgets' row
            self.chain = (host.pin_memory() if self.capture else host,
                          torch.zeros(k + 1, n_max * N, dtype=torch.int64, device=dev),
                          torch.zeros(k, n_max, S + 3, dtype=torch.int64, device=dev))
        host, vdev, out = self.chain[0][:k + 1], self.chain[1][:k + 1], self.chain[2][:k]
        host[:, :b * N] = 0                                # padded rows: slot 0, no budget
        host[:k, :n * N] = vchain.reshape(k, n * N)
        host[k, :n] = torch.tensor([r.params.max_new_tokens - len(r.output_ids) for r in reqs])
        vdev.copy_(host, non_blocking=True)
        L, rows, root, live, ds, vs = self._views(b, self.inputs)
        left = vdev[k, :b]                                 # tokens each row may still make
        window = None
        for j in range(k):
            if j:                 # step j's inputs from step j - 1's outputs, on the device
                prev = out[j - 1, :b]
                acc = prev[:, 1]
                adv = (acc + 1) * live                    # padded and frozen rows: 0
                left.sub_(adv)
                alive = (left > 0).long()
                root.copy_(prev[:, 2:].gather(1, acc[:, None]).view(-1))
                L.add_(adv).mul_(alive)                   # frozen: a padded row from here
                rows.mul_(alive)                          # (row 0, length 0, not live, only
                live.copy_(alive)                         # slot 0 to write)
                ds.mul_(alive[:, None, None])
                torch.mul(vdev[j, :b * N].view(b, N), alive[:, None], out=vs)
                self.root_logits[:b].copy_(window.logits)
                self.root_hidden[:b].copy_(window.hidden)
                # guard 2 was checked for the whole chain above; an eager replay
                # (capture=False) sums the device lengths itself from here on
                self.lens_sum = None
            step, window = self._replay(b)
            out[j, :b].copy_(step)
        return out[:, :n], DraftOut(window.logits[:n], window.hidden[:n])
