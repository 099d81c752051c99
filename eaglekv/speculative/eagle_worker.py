"""EagleWorker: the EAGLE-1/2 speculative runner (EAGLE-3 too, with its drafter).

Per engine step (the scheduler plans which) either
  prefill: target extend (hidden states kept) -> sample the first token -> draft extend over
           the same slots with the ids shifted left by one and that token appended; or
  decode:  draft (S select steps) -> organize + build tree -> verify (one target extend of N
           tokens per request under the tree mask) -> accept -> commit -> draft extend over
           the accepted tokens.
The accept lengths and tokens reach the host once per step (the step's sync), with one flag
per request saying its distributions were usable (`valid_probs` / `valid_argmax`); a request
whose flag is off fails alone and commits nothing. Everything before the sync is tensor code.
Slot ids are shared: one slot addresses the target's and the draft's K/V of the same token.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections import Counter

import numpy as np
import torch

from eaglekv.core import ForwardBatch, SpecStats, StepPlan, StepResult
from eaglekv.kernels.guard import guard_path
from eaglekv.runner import ModelRunner, RunnerResources, guarded
from eaglekv.sampling import apply_penalties, token_logprobs, valid_argmax, valid_probs
from eaglekv.speculative.accept import greedy_accept, sample_accept
from eaglekv.speculative.drafter import Drafter, RootRow, stack_roots
from eaglekv.speculative.phases import phase
from eaglekv.speculative.draft_loop import (DraftLoop, exponential_noise, processed_probs,
                                            uniform_noise)
from eaglekv.speculative.slots import DraftSlots
from eaglekv.speculative.tree import verify_tree


# Speculative chains of SPEC_CHAIN_X times the steps that make a plain chain's tokens at full
# acceptance (`spec_chain_steps`). Why it may pay: the host's work between two chains (the
# sync, the results, the next plan, its slots and copies) leaves the GPU idle for a time a
# chain, not a token; a plain chain of 32 tokens pays it once, a chain of S7 steps (4 at
# full acceptance) about once every 23 tokens at the shipped head's accept 5.8. How much:
# little, by an H100's profile of 2026-12-07 (eagle3_chain_S7K1N8 at batch 1: 6.41 ms of
# wall a chain against 5.35 ms of kernels and ~0.96 ms of boundaries between them, so <=
# ~0.1 ms of host gap a chain, <= ~2%). The cost: a request that stops early (EOS) runs on to
# the chain's end, and newcomers wait a longer chain. 1 (the default) until timed; the
# bench's `_sx2`, `_sx3` modes; EAGLEKV_SPEC_CHAIN_X sets it. Read when a speculative runner
# is built.
SPEC_CHAIN_X = float(os.environ.get("EAGLEKV_SPEC_CHAIN_X", "1"))


def spec_chain_steps(decode_steps: int, num_steps: int, x: float | None = None) -> int:
    """Speculative steps a greedy engine step chains: a chain of `decode_steps` plain tokens
    covers about ceil(decode_steps / (num_steps + 1)) speculative steps at full acceptance
    (32 tokens, S = 5: 6 steps), times `x` (default SPEC_CHAIN_X) rounded up; 1 where plain
    decoding does not chain (CPU: decode_steps 1)."""
    x = SPEC_CHAIN_X if x is None else x
    if x <= 0:
        raise ValueError(f"spec_chain_steps: x = {x}; must be > 0 (EAGLEKV_SPEC_CHAIN_X)")
    if decode_steps <= 1:
        return 1
    return max(1, math.ceil(x * math.ceil(decode_steps / (num_steps + 1)) - 1e-9))


class EagleWorker:
    """The speculative runner: `run(plan) -> StepResult` like ModelRunner, whose instance it
    holds for its target (`self.target`). Its per-request state is the draft's distribution
    and hidden state at the root (`req.draft_state`), set here and cleared by the scheduler
    when it frees the request."""

    separate_decode = True         # speculative steps are planned apart from prefills

    def __init__(self, res: RunnerResources, drafter, spec, chain_steps: int = 1):
        """`chain_steps`: the most greedy steps one engine step replays back to back under
        the whole-step graphs (`_decode_graph`); 1: one step, one sync."""
        self.res, self.drafter, self.spec = res, drafter, spec
        self.S, self.K, self.N = spec.num_steps, spec.topk, spec.num_draft_tokens
        self.chain_steps = chain_steps
        # tokens a request's step gives, on average over the recent steps (the bonus token
        # included): a chain is cut to what the batch's longest remaining budget needs at
        # that rate (chain_len); None until a step was counted
        self.step_tokens: float | None = None
        self.budget_cut = True           # False: whole chains (tests of the frozen rows)
        # host work to run while a whole-step replay (or chain) is on the device, before its
        # sync: called with the steps replayed (AdaptiveWorker's policy; None: nothing)
        self.before_sync = None
        self.target = ModelRunner(res, prefill_graphs=self._prefill_graphs(res, drafter))
        self.loop = DraftLoop(drafter, self.S, self.K)
        self.slots = DraftSlots(res, drafter, spec)
        # the draft extend runs over the whole verify window before the step's sync (fixed
        # shape, one round trip less), on CUDA; after the sync over the accepted tokens on CPU
        self.window_extend = bool(res.cuda_graph_max_bs)
        self.verify_graphs = self.step_graphs = None
        if res.cuda_graph_max_bs:    # the verify forward, captured per batch bucket
            from eaglekv.cuda_graph import VerifyGraphs
            self.verify_graphs = VerifyGraphs(res.model, res.backend, res.cuda_graph_max_bs,
                                              self.N, drafter.capture_layers,
                                              chain=self.K == 1)
            # a whole greedy step as one graph; page_size 1 only: with larger pages the draft
            # and the verify window would both continue the request's partly filled last page
            if self.draft_graphable(drafter) and res.page_size == 1:
                self._capture_step_graphs(res.cuda_graph_max_bs)
        self.reset_stats()

    @staticmethod
    def _prefill_graphs(res: RunnerResources, drafter):
        """The target's captured one-request prefills with their hidden states (for the
        draft), made once per engine and shared by its workers (adaptive holds several);
        None unless `cuda_graph_prefill_tokens` and CUDA graphs are on."""
        if not res.cuda_graph_max_bs or res.cuda_graph_prefill_tokens < 2:
            return None
        if res.prefill_graphs is None:
            from eaglekv.cuda_graph import PrefillGraphs
            res.prefill_graphs = PrefillGraphs(res.model, res.backend,
                                               res.cuda_graph_prefill_tokens,
                                               res.max_context_len, hidden=True,
                                               capture_layers=drafter.capture_layers)
        return res.prefill_graphs

    def _capture_step_graphs(self, max_bs: int) -> None:
        """Capture the whole-step graphs; if a capture fails, say so and keep the eager draft
        with the verify graph (a slower step, never a lost engine)."""
        from eaglekv.speculative.graphs import SpecStepGraphs
        self.slots.hold_both = True     # its draft and verify slots are held at once
        try:
            self.step_graphs = SpecStepGraphs(self, max_bs)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back, loudly
            self.slots.hold_both = False
            self.step_graphs = None
            warnings.warn(f"eaglekv: capturing the speculative step graphs failed ({e!r}); "
                          f"drafting eagerly, the verify still replays its graph",
                          RuntimeWarning, stacklevel=2)

    @staticmethod
    def draft_graphable(drafter) -> bool:
        """The draft phase can be captured: an EAGLE / EAGLE-3 head on the Triton backend
        (device-side lengths), not a scripted drafter that reads contexts on the host."""
        return (not drafter.needs_contexts and drafter.kv_pool is not None
                and hasattr(getattr(drafter, "backend", None), "indexed_decode_metadata")
                and type(drafter).decode_metadata is not Drafter.decode_metadata)

    def reset_stats(self) -> None:
        self.stats = SpecStats(accept_histogram={})
        self.timings = {"draft": 0.0, "verify": 0.0, "accept": 0.0, "extend": 0.0}

    # ---- step geometry (asked by the scheduler) ------------------------------------------------
    def step_pages(self, kv_len: int) -> int:
        """Pages a running request may need during its next decode step (draft slots are
        returned before the verify slots are taken, so the peak is the larger of the two)."""
        return self.slots.peak_pages(kv_len)

    def window_pages(self, kv_len: int) -> int:
        """Pages past a request's last token its last step may hold: a whole step's peak."""
        return self.slots.peak_pages(kv_len)

    def uniform_step_pages(self) -> int | None:
        """step_pages when it does not depend on the length (one slot a page), else None."""
        return self.slots.peak_pages(0) if self.res.page_size == 1 else None

    @staticmethod
    def can_decode(req) -> bool:
        """Prefilled and sampled: the draft's root state exists."""
        return req.draft_state is not None

    # ---- one step --------------------------------------------------------------------------------
    def run(self, plan: StepPlan) -> StepResult:
        with guarded(self.res.device):
            return self.prefill(plan) if plan.kind == "extend" else self.decode(plan.reqs)

    # ---- prefill --------------------------------------------------------------------------------
    def prefill(self, plan: StepPlan) -> StepResult:
        """A (chunk of a) prefill: the target extends and samples like a plain step, then the
        draft extends over the same slots (input at p: token p + 1). A request whose prefill
        is chunked samples nothing yet (its input ends with the next prompt token), and its
        draft state stays None until the chunk that completes it."""
        reqs = plan.reqs
        target = self.target
        if target.prefill_graphs is not None and target.prefill_fits(plan):   # replayed
            out = target.replay_prefill(plan)
            res = target.sample(plan, plan.sampling, out.logits)
            extend_lens = [len(x) for x in plan.ids]
        else:
            res, out, batch = target.run_extend(plan, return_hidden=True,
                                                capture_layers=self.drafter.capture_layers)
            extend_lens = batch.extend_lens_cpu
        feats = self.drafter.features(out)                                        # (T, Hf)
        live = [i for i, r in enumerate(reqs) if not res.failed[i]]
        if live:
            # draft input at position p is (token p + 1, target hidden p): the prompt shifted
            # left by one, then the sampled token where the prompt is complete
            ids, ctx = [], []
            for i in live:
                r, p = reqs[i], plan.prefix_lens[i]
                ids.append(r.all_ids[p + 1:r.kv_len] + (res.tokens[i] or
                                                         [r.all_ids[r.kv_len]]))
                if self.drafter.needs_contexts:      # O(length): only for a drafter that reads it
                    ctx.append(r.all_ids + (res.tokens[i] or []))
            cu = [0]
            for ext in extend_lens:
                cu.append(cu[-1] + ext)
            hidden = torch.cat([feats[cu[i]:cu[i + 1]] for i in live])
            self._draft_extend([reqs[i] for i in live], ids, [plan.prefix_lens[i] for i in live],
                               torch.cat([plan.slots[i] for i in live]), hidden, ctx)
        for i, r in enumerate(reqs):
            if res.tokens[i] is None:   # still prefilling (or failed): no root yet
                r.draft_state = None
        return res

    def _draft_extend(self, reqs, ids, prefix, slots, hidden, contexts) -> None:
        """The draft over the requests' new tokens; its last position is the next root.
        `contexts`: each request's tokens with this step's included (for a drafter that needs
        them: the books are committed after the runner returns)."""
        t0 = time.perf_counter()
        with phase("extend"):
            batch = ForwardBatch.build(ids, prefix, [r.row for r in reqs], slots, self.res.device)
            out = self.drafter.extend(batch, hidden, contexts if self.drafter.needs_contexts
                                      else None)
            for i, r in enumerate(reqs):
                r.draft_state = RootRow(out, i)
        self.timings["extend"] += time.perf_counter() - t0

    # ---- decode ---------------------------------------------------------------------------------
    def decode(self, reqs, max_chain: int | None = None) -> StepResult:
        """One speculative step of `reqs`, or a chain of greedy whole-step replays of at most
        `max_chain` steps (None: `chain_steps`; see `chain_len`)."""
        S, N = self.S, self.N
        dev = self.res.device
        B = len(reqs)
        t0 = time.perf_counter()
        if self._step_graph_fits(reqs):
            return self._decode_graph(reqs, t0, max_chain)
        seq_lens = torch.tensor([r.kv_len for r in reqs], device=dev)              # (B,)
        rows = torch.tensor([r.row for r in reqs], device=dev)                     # (B,)
        # 1. draft: slots, req_to_token entries and kv indices, then the select steps
        with phase("draft"):
            d = self.slots.prepare_draft(reqs, rows, seq_lens)
            root_logits = stack_roots(reqs, 0)                                        # (B, V)
            root_hidden = stack_roots(reqs, 1)                                        # (B, H)
            contexts_of = None
            if self.drafter.needs_contexts:
                def contexts_of(paths):
                    return [r.all_ids + p for r, pk in zip(reqs, paths.tolist()) for p in pk]
            root = torch.tensor([r.output_ids[-1] for r in reqs], device=dev)         # (B,)
            pool = self.loop.run(reqs, root_logits, root_hidden, seq_lens, d.slots,
                                 d.decode_meta, contexts_of, d.reorder_kv)
            tree = verify_tree(root, pool, N, chain=self.K == 1)
            self.slots.release_draft(d)
        t1 = time.perf_counter()
        # 2. verify: N tree nodes per request at positions L_b + depth, under the tree mask
        with phase("verify"):
            vslots = self.slots.alloc_verify(reqs, rows, seq_lens)                     # (B, N) cpu
            batch = ForwardBatch(input_ids=tree.tokens.reshape(-1),
                                 positions=(seq_lens[:, None] + tree.depth).reshape(-1),
                                 req_pool_indices=rows, prefix_lens=seq_lens,
                                 extend_lens=torch.full((B,), N, device=dev),
                                 out_cache_loc=vslots.reshape(-1).to(dev),
                                 prefix_lens_cpu=tuple(r.kv_len for r in reqs),
                                 extend_lens_cpu=(N,) * B, extend_mask=tree.mask)
            if self.verify_graphs is not None and self.verify_graphs.bucket(B) is not None:
                out = self.verify_graphs.run(batch.input_ids, batch.positions, rows, seq_lens,
                                             batch.out_cache_loc, tree.mask)
            else:
                out = self.res.model.forward(batch, self.res.backend, return_hidden=True,
                                             capture_layers=self.drafter.capture_layers)
            logits = out.logits.view(B, N, -1)                                        # (B, N, V)
            feats = self.drafter.features(out).view(B, N, -1)                         # (B, N, Hf)
        t2 = time.perf_counter()
        # 3. accept (on the penalized logits; logprobs report the raw ones)
        with phase("accept"):
            pl = self._penalized(reqs, logits, tree)
            # ok[b]: every node's argmax and distribution is usable. A bad row's walk below stays
            # in range (NaN comparisons are False) and is dropped after the sync; rows never mix.
            # (A non-finite draft q is harmless: u * q(x) < p(x) fails, the bonus is drawn from p.)
            ok = valid_argmax(pl)                                                      # (B,)
            if all(r.params.greedy for r in reqs) and tree.draft_probs is None:
                res = greedy_accept(tree, pl.argmax(-1), S)
            else:
                p = processed_probs(pl.reshape(B * N, -1),
                                    [r.params for r in reqs for _ in range(N)]).view(B, N, -1)
                ok = ok & valid_probs(p)
                gens = [r.generator for r in reqs]
                res = sample_accept(tree, p, uniform_noise(gens, N, dev),
                                    exponential_noise(gens, p.shape[-1], dev), S)
            res.path = guard_path(res.path, tree.parent, "tree retrieve (accepted node)")
            committed = res.committed_tokens(tree)                                    # (B, S + 1)
            # 4. commit on the device: accepted node at depth j -> position L_b + j (slot j)
            P = min(S, N - 1)
            vdev = vslots.to(dev)
            path = res.path[:, 1:P + 1]                                               # (B, P)
            dst = vdev[:, 1:P + 1]
            src = torch.where(path >= 0, vdev.gather(1, path.clamp(min=0)), dst)      # (B, P)
            self.res.kv_pool.move_kv(dst, src)
            hid = feats.gather(1, res.path[:, :P + 1].clamp(min=0)[:, :, None].expand(
                B, P + 1, feats.shape[-1]))                                           # (B, P+1, Hf)
        with phase("extend"):
            window = self._extend_window(reqs, res, committed, feats, vdev, seq_lens)
        host = torch.cat([ok[:, None].long(), res.accept_len[:, None], committed],
                         1).tolist()                                              # the sync
        good, acc, toks = [h[0] for h in host], [h[1] for h in host], [h[2:] for h in host]
        lps = self._window_logprobs(reqs, logits, res.path, acc, toks, good)
        t3 = time.perf_counter()
        self.timings["draft"] += t1 - t0
        self.timings["verify"] += t2 - t1
        self.timings["accept"] += t3 - t2
        return self._step_result(reqs, vslots, good, acc, toks, lps, hid, window)

    def _step_graph_fits(self, reqs) -> bool:
        return (self.step_graphs is not None and reqs[0].draft_state[1] is not None
                and self.step_graphs.bucket(len(reqs)) is not None
                and all(r.params.greedy and not r.params.has_penalties
                        and r.params.logprobs is None for r in reqs))

    def _decode_graph(self, reqs, t0, max_chain: int | None = None) -> StepResult:
        """A greedy step as one replay (speculative/graphs.py): the host takes the draft and
        the verify slots, the graph writes the tables, and the host reads [usable,
        accept_len, committed...] at the sync. A chain (`chain_len` > 1) replays k steps
        before that one sync, each with its own verify slots."""
        k = self.chain_len(reqs, max_chain)
        dslots, owned = self.slots.alloc_draft(reqs)                              # (B, K, S)
        try:
            vslots = (self.slots.alloc_verify_slots(reqs) if k == 1                # (B, N) cpu
                      else self.slots.alloc_verify_chain(reqs, k))                # (k, B, N)
        except BaseException:
            self.res.allocator.free(torch.cat(owned))
            raise
        if k == 1:
            host_t, window = self.step_graphs.run(reqs, dslots, vslots)
        else:
            host_t, window = self.step_graphs.run_chain(reqs, dslots, vslots)
        # the draft slots are the replay's scratch: they go back to the books while the device
        # works (only the host allocates, and not before this step's sync)
        self.res.allocator.free(torch.cat(owned))
        if self.before_sync is not None:      # the device is busy with the replays: host
            self.before_sync(k)               # work here is hidden behind them
        host = host_t.tolist()                                                    # the sync
        self.timings["verify"] += time.perf_counter() - t0    # the whole step, one replay
        if k > 1:
            return self._chain_result(reqs, vslots, host, window)
        good, acc, toks = [h[0] for h in host], [h[1] for h in host], [h[2:] for h in host]
        return self._step_result(reqs, vslots, good, acc, toks, [None] * len(reqs), None,
                                 window)

    def chain_len(self, reqs, max_chain: int | None = None) -> int:
        """Steps the next whole-step replay chains (1: no chain): at most `chain_steps` (and
        `max_chain` when given), and at most what the pool's free slots hold (the draft's
        K * S scratch once, N verify slots a step: a chain never preempts). A request whose
        budget runs out inside the chain is frozen there on the device (`run_chain`); one that
        stops early otherwise (EOS, a stop id) runs on to the chain's end, and the stop rules
        drop its extra tokens."""
        k = self.chain_steps if max_chain is None else min(self.chain_steps, max_chain)
        if k <= 1:
            return 1
        if self.budget_cut and self.step_tokens is not None:
            # the steps the batch's longest remaining budget needs at the recent rate: the
            # replays past a request's budget run frozen rows, device time for nothing (on an
            # H100 at batch 1 a request's last 6-step chain of S5 gave 5 tokens in 10 ms)
            left = max(r.params.max_new_tokens - len(r.output_ids) for r in reqs)
            k = min(k, max(1, math.ceil(left / self.step_tokens)))
        n = len(reqs)
        free = self.res.allocator.available_slots() - n * self.K * self.S
        return max(1, min(k, free // (n * self.N)))

    def _chain_result(self, reqs, vchain, host, window) -> StepResult:
        """A chain's StepResult: per request the tokens of its steps in order, up to the step
        its budget ran out in (run_chain froze it after that one: the later steps' outputs
        are a padded row's) or a step whose logits were unusable (it then fails after the
        tokens before it, as a decode chain's request does, and every verify slot of its
        chain goes back); `accepted` is the list of its steps' accept lengths (the scheduler
        counts those whose tokens it keeps). The accepted slots of each counted step stay
        (positions L_j .. L_j + a_j), the rest go back."""
        k, B, N = vchain.shape
        result = StepResult(tokens=[None] * B, logprobs=[None] * B, failed=[False] * B,
                            kv_advance=[0] * B, last_slots=[-1] * B, accepted=[None] * B,
                            draft_tokens=N - 1)
        vc = vchain.numpy()
        keep = np.zeros((k, B, N), dtype=bool)
        counted = []
        for b, r in enumerate(reqs):
            toks, accs, failed = [], [], False
            room = r.params.max_new_tokens - len(r.output_ids)
            for j in range(k):
                if len(toks) >= room:           # frozen from here (run_chain)
                    break
                ok, a, *committed = host[j][b]
                if not ok:
                    failed = True
                    break
                toks += committed[:a + 1]
                accs.append(a)
            result.tokens[b] = toks or None
            if failed:              # fails alone after its good steps; nothing is committed
                result.failed[b] = True
                continue
            for j, a in enumerate(accs):
                keep[j, b, :a + 1] = True
            result.kv_advance[b] = len(toks)
            result.last_slots[b] = int(vc[len(accs) - 1, b, accs[-1]])
            result.accepted[b] = accs
            # engine-wide counts: the steps whose tokens the stop rules keep
            kept, start = r.tokens_kept(toks), 0
            for a in accs:
                if start >= kept:
                    break
                counted.append(a)
                start += a + 1
        result.free_slots = torch.from_numpy(vc[~keep])
        self._count(counted)
        for b, r in enumerate(reqs):
            if not result.failed[b]:
                r.draft_state = RootRow(window, b)
        return result

    def _step_result(self, reqs, vslots, good, acc, toks, lps, hid, window) -> StepResult:
        """After the sync: the rejected tail goes back, a failed request commits nothing; the
        next roots come from the window extend, or the draft extends now."""
        B, N = vslots.shape
        result = StepResult(tokens=[None] * B, logprobs=[None] * B, failed=[False] * B,
                            kv_advance=[0] * B, last_slots=[-1] * B, accepted=[None] * B,
                            draft_tokens=N - 1)
        # what goes back, row by row, built on the host's lists (one tensor, not B slices:
        # at batch 64 this loop was 0.3 ms of tensor indexing): past the accepted path, or
        # the whole row of a failed request
        vl = vslots.tolist()
        past = np.arange(N)[None, :] > np.asarray(acc)[:, None]                   # (B, N)
        past[~np.asarray(good, dtype=bool)] = True
        result.free_slots = torch.from_numpy(vslots.numpy()[past])
        live, ids, prefix, slots, hidden, ctx = [], [], [], [], [], []
        for b, r in enumerate(reqs):
            if not good[b]:   # fails alone: its verify slots go back (above)
                result.failed[b] = True
                continue
            a = acc[b]
            result.kv_advance[b], result.last_slots[b] = a + 1, vl[b][a]
            result.accepted[b], result.tokens[b], result.logprobs[b] = a, toks[b][:a + 1], lps[b]
            live.append(r)
            if window is None:
                ids.append(toks[b][:a + 1])
                prefix.append(r.kv_len)
                slots.append(vslots[b, :a + 1])
                hidden.append(hid[b, :a + 1])
                if self.drafter.needs_contexts:
                    ctx.append(r.all_ids + toks[b][:a + 1])
        self._count([a for a, g in zip(acc, good) if g])
        if window is not None:  # the draft already ran over the window, before the sync
            for b, r in enumerate(reqs):
                if good[b]:
                    r.draft_state = RootRow(window, b)
        elif live:
            self._draft_extend(live, ids, prefix, torch.cat(slots), torch.cat(hidden), ctx)
        return result

    @staticmethod
    def _penalized(reqs, logits, tree):
        """(B, N, V) verify logits with each request's penalties: node j's logits predict the
        token after node j, so its output is the request's output plus the draft tokens on
        the path to j (the root is the last output token already)."""
        if not any(r.params.has_penalties for r in reqs):
            return logits
        B, N = tree.tokens.shape
        toks, mask = tree.tokens.tolist(), tree.mask.tolist()
        params, outputs, contexts = [], [], []
        for b, r in enumerate(reqs):
            for j in range(N):
                path = [toks[b][i] for i in range(1, N) if mask[b][j][i]]
                params.append(r.params)
                outputs.append(r.output_ids + path)
                contexts.append(r.all_ids + path)
        return apply_penalties(logits.reshape(B * N, -1), params, outputs,
                               contexts).view(B, N, -1)

    @staticmethod
    def _window_logprobs(reqs, logits, path, acc, toks, good) -> list[list | None]:
        """TokenLogprobs of each request's a + 1 committed tokens (None where not asked for,
        or where `good[b]` is off: it failed): committed token j was chosen from the target's
        logits at the accepted node path[j]."""
        want = [b for b, r in enumerate(reqs) if r.params.logprobs is not None and good[b]]
        out: list[list | None] = [None] * len(reqs)
        if not want:
            return out
        rows = torch.cat([logits[b, path[b, :acc[b] + 1]] for b in want])         # (n, V)
        flat = token_logprobs(rows, [t for b in want for t in toks[b][:acc[b] + 1]],
                              [reqs[b].params.logprobs for b in want for _ in range(acc[b] + 1)])
        i = 0
        for b in want:
            out[b], i = flat[i:i + acc[b] + 1], i + acc[b] + 1
        return out

    def _extend_window(self, reqs, res, committed, feats, vslots, seq_lens):
        """The draft over the whole verify window before the sync, when `window_extend`:
        window position j of request b sits at L_b + j, input token committed[b, j] (the
        accepted tokens, then the bonus, then filler 0 whose K/V land in verify slots freed
        right after) with the target feature of the accepted node at depth j; the next root
        is position L_b + accept_len. Returns a DraftOut of the next roots, or None (the
        draft then extends over the accepted tokens after the sync)."""
        if not self.window_extend or not hasattr(self.drafter, "extend_window"):
            return None
        rows = torch.tensor([r.row for r in reqs], device=vslots.device)
        return self.window_forward(rows, seq_lens, committed, feats, vslots, res,
                                   tuple(r.kv_len for r in reqs))

    def window_forward(self, rows, seq_lens, committed, feats, vslots, res, prefix_cpu=None):
        """`_extend_window`'s forward, tensors only (a CUDA graph captures it too, with
        `prefix_cpu` None: the Triton backend needs no prefix length on the host)."""
        B = vslots.shape[0]
        W = min(self.S, self.N - 1) + 1                  # the most tokens a step commits
        dev = vslots.device
        cols = torch.arange(W, device=dev)
        path = res.path[:, :W].clamp(min=0)                                       # (B, W)
        hidden = feats.gather(1, path[:, :, None].expand(B, W, feats.shape[-1]))  # (B, W, Hf)
        batch = ForwardBatch(input_ids=committed[:, :W].clamp(min=0).reshape(-1),
                             positions=(seq_lens[:, None] + cols[None, :]).reshape(-1),
                             req_pool_indices=rows, prefix_lens=seq_lens,
                             extend_lens=torch.full((B,), W, device=dev),
                             out_cache_loc=vslots[:, :W].reshape(-1),
                             prefix_lens_cpu=prefix_cpu or (0,) * B, extend_lens_cpu=(W,) * B)
        idx = torch.arange(B, device=dev) * W + res.accept_len                    # (B,)
        return self.drafter.extend_window(batch, hidden.reshape(B * W, -1), idx)

    def _count(self, accepted: list[int]) -> None:
        """Engine-wide counters of a step's committed requests, one accepted count each (each
        request's own are counted when its result is committed)."""
        st = self.stats
        if accepted:
            mean = 1 + sum(accepted) / len(accepted)
            self.step_tokens = (mean if self.step_tokens is None
                                else self.step_tokens + 0.1 * (mean - self.step_tokens))
        st.verify_steps += len(accepted)
        st.draft_tokens += (self.N - 1) * len(accepted)
        st.accepted_tokens += sum(accepted)
        hist = st.accept_histogram
        for a, c in Counter(accepted).items():
            hist[a + 1] = hist.get(a + 1, 0) + c
