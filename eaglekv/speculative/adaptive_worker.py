"""AdaptiveWorker: the speculative runner that chooses each step (speculative/adaptive.py).

It holds one EagleWorker per candidate shape (sharing the target, the drafter and its KV
pool) and runs, per decode step, the policy's choice: the speculative step of one shape for
the requests chosen to speculate, and a plain decode step (one token each, the target's
features kept) for the others. When the whole batch decodes plainly, is greedy without
penalties or logprobs and fits a decode graph, the plain step decodes a chain of up to
`EngineConfig.num_scheduler_steps` tokens in one engine step (ModelRunner.run_chain: the
graph replayed k times, one sync), as plain decoding does; the policy then costs it per token.
The chain is as long as the policy's `plain_horizon` (a dip in good requests' acceptance
costs a few plain tokens, not a whole chain).

A request that decodes plainly leaves its draft behind: its `draft_state` becomes a `Lag`
holding the draft inputs of the positions it decoded (token p + 1; the target feature of p is
kept by slot in the runner's feature table, written inside the decode graph by every replay
of a chain too, so a chain of k tokens just lengthens the Lag by k). Before
its next speculative step the draft extends over them in one forward (only the last
position's logits are computed), which writes the draft's K/V of those positions into their
slots (shared with the target's) and gives the root again. So a request that never
speculates again costs nothing beyond plain decoding but a feature row a step.

Under CUDA graphs the policy's host work does not stand between two replays: while a
whole-batch speculative step (or chain) runs on the device, the previous step's acceptance is
observed and the next step chosen for the same batch (`_while_device`, EagleWorker's
`before_sync` hook); the next engine step uses that choice if its batch is unchanged. The
choice is one step late, and the device is not idle for it.

What a step costs is its whole wall time, as the engine measures it from planning to commit
(`step_done`): the timers around the plain and speculative parts miss the draft catch-ups,
the packing around the replays and the scheduler's commit of the step's tokens, and those grow
with the batch and with the tokens a step makes. On the H200 at batch 64 they were a fifth of
a speculative step, and a policy costing only the timed parts chose S5 where plain decoding is
faster (issue 15's run of 2026-12-04). The part the timers missed is shared among the step's
parts in proportion to their timed seconds, so a split step's plain part, which shares the
plain cell with all-plain steps, is costed as those are. The draft's catch-up before a
speculative step is timed on its own and charged to the plain steps that made it necessary
(`CATCHUP`: seconds per lagging token, added to plain decoding's cost per token in the
choice): charged to the speculative step, it made a shape's cell read more than its step
after every plain stretch, and the policy then went plain more often.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field

import torch

from eaglekv.core import ForwardBatch, SpecStats, StepPlan, StepResult
from eaglekv.cuda_graph import store_features
from eaglekv.model import cpu_blas
from eaglekv.runner import ModelRunner, guarded
from eaglekv.speculative.adaptive import (CATCHUP, CHAIN, PLAIN, AdaptivePolicy, Choice,
                                          CostTable, Shape, cost_cache_path)
from eaglekv.speculative.eagle_worker import EagleWorker, spec_chain_steps

# the tokens a plain chain explored to measure its cost decodes at least (a horizon of 1 would
# measure a one-token step, and leave the chain cell unknown: on an H100 at batch 64 each run
# then began with a 17.5 ms exploring plain step, 2026-12-06)
EXPLORE_CHAIN = 8

# Where a shape's steps chain (CUDA graphs), its cost cell should read what a chain of it costs
# a step, since a held choice runs as one: a chain of k steps pays one launch and sync, ~0.6 ms
# at batch 1 on an H100. Two kinds of steps paid a whole sync for one or two steps and were
# averaged in: the exploring steps that seed a cell (single steps) and the chains a request's
# budget end cuts short. On an H100 at batch 1 (2026-12-06, the step traces of
# bench/results/gpu_bench_h100_20261206b_heldout_default.json) the S3 cell read 1.27 ms a step
# where S3's chains of 8 took 1.11 ms a step (S5's cell 1.57 against 1.46), so on a held-out
# prompt where the fixed S3 ran 1.30x plain the policy chose S5 and ran 1.10x. With
# CHAINED_COSTS an exploring step of a chaining shape runs as a whole chain, and a chain cut
# short is not observed once the cell is known. In the policy's replay with its costs learnt
# (`python -m eaglekv.testing.adaptive_sim --learn`, the H100's costs after the decode-kernel
# verify) it took held-out-like text from 0.875x to 0.958x the best fixed shape and text with
# long hard stretches from 0.847x to 0.934x, bench-like text unchanged (0.982x / 0.981x). On
# by default since 2026-12-06; on an H100 (15:25, `bench/h200_issue13.sh ccost`, one process,
# bench/results/gpu_bench_h100_20261206c_ccost_*.json) the first held-out prompt at batch 1
# ran 1.31x plain with it and 1.11x without (the fixed S3 1.29x), the first four 0.99x / 1.14x
# (one of three runs with a 1 s compile, below), the bench prompt 1.76x / 1.74x / 1.43x / 1.35x
# at batch 1 / 4 / 16 / 64 with it and 1.82x / 1.72x / 1.42x / 1.30x without. The bench's
# `_rawcost` modes and EAGLEKV_ADAPTIVE_CHAINED_COSTS=0 turn it off.
CHAINED_COSTS = os.environ.get("EAGLEKV_ADAPTIVE_CHAINED_COSTS", "1") != "0"

# The draft's catch-up (`_catch_up`: its extend over what requests decoded plainly) runs
# eagerly, where Triton kernels meet specialisations that start-up's captures and a prompt's
# prefill may never have launched: on an H100 (2026-12-06, the held-out prompts at batch 4) the
# first catch-up of a process took 1018 ms, an `_extend_kernel` compiled inside the step (the
# 01:29 bench of that day met `_decode_kernel` and `_merge_kernel` the same way). What varies:
# a catch-up of one token a request is a decode, whose split count (1-16, from the batch and
# the keys: `attention.default_num_splits`) is a constant of the compiled kernel, so each count
# a growing context reaches is a compile (the graphs capture one, at the context limit); a
# longer one is an extend whose tile depends on its length (16 / 32 queries, short up to 64)
# and whose split-K scratch (fp32, or the output itself unsplit) on its keys; the matmuls'
# row tile on the row count (1, 2, 4). So on a Triton device the worker runs the draft's
# extend at start-up once for each (requests, tokens a request, prefix) of
# `catch_up_warm_shapes`, on the padding row (its table all the padding page) with every K/V
# written to the padding page's first slot (`warm_catch_up`). EAGLEKV_WARM_CATCH_UP=0 skips it.
# (Since the same day the Triton backend sizes every CUDA decode's splits by the context limit,
# `triton_backend.FIXED_DECODE_SPLITS`, so the decodes here meet one split count; the extends
# and row tiles still vary.)
WARM_CATCH_UP = os.environ.get("EAGLEKV_WARM_CATCH_UP", "1") != "0"


def catch_up_warm_shapes(max_context: int) -> list[tuple[int, int, int]]:
    """(requests, tokens a request, prefix) for `warm_catch_up`: one-token decodes at every
    split count a context below `max_context` reaches, the row tiles, and extends of each
    tile, unsplit (prefix 0) and split (a prefix of 128)."""
    from eaglekv.kernels.attention import MAX_SPLITS, MIN_KEYS_PER_SPLIT
    out = [(1, 1, MIN_KEYS_PER_SPLIT * (s - 1)) for s in range(1, MAX_SPLITS + 1)]
    out += [(2, 1, 0), (3, 1, 0), (4, 1, 0)]
    for L in (2, 4, 16, 17, 64):
        out += [(1, L, 0), (1, L, 128)]
    out += [(1, 65, 0), (4, 16, 0), (4, 17, 0)]
    return [(B, L, P) for B, L, P in out if P + L < max_context]


def _is_subsequence(xs: list, ys) -> bool:
    """Whether `xs` is `ys` with some items left out (the order kept)."""
    it = iter(ys)
    return all(any(x == y for y in it) for x in xs)


@dataclass
class Lag:
    """Draft inputs not run yet: positions start, start + 1, ... (token p + 1; the feature of
    p is in the runner's feature table at p's slot)."""

    start: int
    tokens: list[int] = field(default_factory=list)


class AdaptiveWorker:
    separate_decode = True

    def __init__(self, res, drafter, spec, costs: CostTable | None = None,
                 decode_steps: int = 1):
        """`costs`: the cost table (tests fix one); None: this machine's, cached on disk.
        `decode_steps` (EngineConfig.num_scheduler_steps): the longest chain an all-plain
        step decodes (under decode graphs)."""
        self.res, self.drafter, self.spec = res, drafter, spec
        self.decode_steps = decode_steps
        self.chained_costs = CHAINED_COSTS       # read when built (the bench's `_rawcost` modes)
        shapes = [Shape(*s) for s in spec.candidate_shapes(res.device.type)]
        # each shape's greedy whole-step replays may chain a held choice's steps (`decode`)
        self.workers = {s: EagleWorker(res, drafter, spec.fixed(s.S, s.K, s.N),
                                       spec_chain_steps(decode_steps, s.S)) for s in shapes}
        self.first = self.workers[shapes[0]]
        mc = res.model.cfg
        width = mc.hidden_size * max(1, len(drafter.capture_layers))
        # the target feature of every plainly decoded token, by slot (factory.py sizes it)
        self.feature_table = torch.zeros(res.kv_pool.size_limit, width, dtype=res.dtype,
                                         device=res.device)
        self.graphs = None
        if res.cuda_graph_max_bs:    # the plain steps replay a captured decode, features kept
            from eaglekv.cuda_graph import DecodeGraphs
            self.graphs = DecodeGraphs(res.model, res.backend, res.cuda_graph_max_bs,
                                       res.max_context_len, features=drafter,
                                       feature_table=self.feature_table,
                                       req_to_token=res.req_to_token.req_to_token,
                                       chain_steps=decode_steps)
        if costs is None:
            costs = CostTable(cost_cache_path(self.identity()),
                              drop_first=res.device.type == "cuda")
        self.policy = AdaptivePolicy(shapes, costs)
        self.policy.gated_depth = spec.gated_depth(res.device.type)
        # where the shapes' steps chain (CUDA graphs), a choice holds as many steps as the
        # longest chain takes, so the held steps run as one chain (each worker cuts it to its
        # own: 6 steps of S5, 5 of S6; held only for the shortest, S5 ran chains of 5 beside
        # S6 trees, 0.92x the fixed S5 with the EAGLE-3 head on an H100 at batch 1, 2026-12-06)
        chains = max(w.chain_steps for w in self.workers.values())
        if chains > 1:
            self.policy.hold_spec = max(self.policy.hold_spec, chains - 1)
            # a choice runs for a chain (6 steps of S5 at batch 1): judged on longer averages
            # (AdaptivePolicy.CHAINED: each request's rates shrunk toward the engine's and
            # averaged over more steps, every choice held, the engine's averages taught by
            # requests past their first chain)
            for name, value in AdaptivePolicy.CHAINED.items():
                setattr(self.policy, name, value)
        self._pages_key, self._pages = None, 0
        self.reset_stats()
        if res.device.type == "cuda" and WARM_CATCH_UP:
            self.warm_catch_up()

    def warm_catch_up(self, shapes=None) -> None:
        """The draft's extend once for each (requests, tokens, prefix) of `shapes` (None:
        `catch_up_warm_shapes`), every request on the padding row (whose table is all the
        padding page's first slot) and every token's K/V written to that slot, features
        zero: the kernels a catch-up launches are compiled (or loaded) here and not inside a
        step. Nothing outside the padding page is written (tested)."""
        dev, width = self.res.device, self.feature_table.shape[1]
        if shapes is None:
            shapes = catch_up_warm_shapes(self.res.max_context_len)
        with guarded(dev):
            for B, L, P in shapes:
                ids = [[0] * L for _ in range(B)]
                batch = ForwardBatch.build(ids, [P] * B, [0] * B,
                                           torch.zeros(B * L, dtype=torch.int64), dev)
                hidden = torch.zeros(B * L, width, dtype=self.feature_table.dtype, device=dev)
                self.drafter.extend(batch, hidden, ids if self.drafter.needs_contexts else None)

    def identity(self) -> dict:
        """What the step costs depend on: device (on CPU: threads and matmul library),
        shapes, dtype, graphs, draft."""
        res, mc = self.res, self.res.model.cfg
        dev = (torch.cuda.get_device_name(res.device) if res.device.type == "cuda"
               else f"{platform.machine()} {platform.processor()} "
               f"{cpu_blas.describe()}")             # the CPU matmul library (cpu_blas.py)
        return {"device": dev, "torch": torch.__version__, "dtype": str(res.dtype),
                "model": [mc.vocab_size, mc.hidden_size, mc.intermediate_size, mc.num_layers,
                          mc.num_heads, mc.num_kv_heads, mc.head_dim],
                "draft": [self.spec.algorithm, type(self.drafter).__name__,
                          list(getattr(getattr(self.drafter, "model", None), "kv_shape",
                                       lambda: ())())],
                "graphs": res.cuda_graph_max_bs, "page_size": res.page_size,
                # cells measured the other way are not mixed in (nor a cache of before)
                "costs": "chained" if self.chained_costs else "raw"}

    # ---- stats (the sum over the shapes' workers, and the choices) ---------------------------------
    def reset_stats(self) -> None:
        for w in self.workers.values():
            w.reset_stats()
        self.policy.counts.clear()
        self.plain_seconds = 0.0
        self._pending = None      # the last decode's parts, costed when the engine reports
        # where a speculative step runs as a replay, the policy's work runs while the device
        # does (`_while_device`): the last step's acceptance is observed and the next choice
        # made one step late (`_deferred`: the observation waiting; `_ahead`: the choice made)
        self._deferred = getattr(self, "_deferred", None)
        self._flush()
        self._ahead = None

    @property
    def stats(self) -> SpecStats:
        out = SpecStats(accept_histogram={}, choices=dict(self.policy.counts))
        for w in self.workers.values():
            st = w.stats
            out.verify_steps += st.verify_steps
            out.draft_tokens += st.draft_tokens
            out.accepted_tokens += st.accepted_tokens
            for k, v in st.accept_histogram.items():
                out.accept_histogram[k] = out.accept_histogram.get(k, 0) + v
        return out

    @property
    def timings(self) -> dict[str, float]:
        out = {"plain": self.plain_seconds}
        for w in self.workers.values():
            for k, v in w.timings.items():
                out[k] = out.get(k, 0.0) + v
        return out

    # ---- step geometry: the largest of the shapes' ---------------------------------------------
    def step_pages(self, kv_len: int) -> int:
        if self.res.page_size == 1:     # the same for every length (the scheduler asks per
            return self._flat_pages()   # request each step: at batch 64, 0.3 ms of host here)
        return max(w.step_pages(kv_len) for w in self.workers.values())

    def window_pages(self, kv_len: int) -> int:
        if self.res.page_size == 1:
            return self._flat_pages()
        return max(w.window_pages(kv_len) for w in self.workers.values())

    def uniform_step_pages(self) -> int | None:
        """step_pages when it does not depend on the length (one slot a page), else None: the
        scheduler's reserve check then costs one call a step, not one a request."""
        return self._flat_pages() if self.res.page_size == 1 else None

    def _flat_pages(self) -> int:
        """With one slot a page a step's peak does not depend on the length: each shape's,
        kept until a shape's slots change how they hold the draft and verify slots."""
        key = tuple(w.slots.hold_both for w in self.workers.values())
        if key != self._pages_key:
            self._pages_key = key
            self._pages = max(max(w.step_pages(0), w.window_pages(0))
                              for w in self.workers.values())
        return self._pages

    can_decode = staticmethod(EagleWorker.can_decode)

    # ---- one step --------------------------------------------------------------------------------
    def run(self, plan: StepPlan) -> StepResult:
        with guarded(self.res.device):
            if plan.kind == "extend":
                return self.first.prefill(plan)
            return self.decode(plan.reqs)

    def decode(self, reqs) -> StepResult:
        B = len(reqs)
        self._charge(None)             # a step the engine did not report: its timed parts
        chain = self._can_chain(reqs)
        choice = self._take_ahead(reqs, chain)
        if choice is None:
            self._flush()
            choice = self.policy.choose(reqs, chain=chain)
        if not (choice.spec and not choice.plain):
            self._flush()              # only a whole-batch replay hides the policy's work
        if not choice.spec:            # the whole batch decodes plainly: no merging
            t = time.perf_counter()
            longest = self.policy.plain_horizon(reqs, self.decode_steps) if chain else 1
            if chain and choice.explore:   # measuring the chain cell: a chain, not a token
                longest = max(longest, min(self.decode_steps, EXPLORE_CHAIN))
            res, k = self._plain(reqs, chain and longest > 1, longest)
            dt = time.perf_counter() - t
            self.plain_seconds += dt
            self._pending = [(CHAIN if k > 1 else PLAIN, B, dt, k)]    # costed per token
            self.policy.observe_plain(reqs, k)
            res.draft_tokens = [0] * B
            return res
        self._pending = []
        if not choice.plain:           # the whole batch speculates: the worker's result as is;
            # a held choice's next steps (the policy's) run now, chained before one sync
            steps = 1 + self.policy.held_steps()
            if self.chained_costs and choice.explore:   # measured as it runs when chosen: a chain
                steps = max(steps, self.workers[choice.shape].chain_steps)
            res = self._speculate(reqs, choice.shape, steps, overlap=True)
            self.policy.last = choice      # this step's (the next one's may be made already)
            return res
        out = StepResult(tokens=[None] * B, logprobs=[None] * B, failed=[False] * B,
                         kv_advance=[0] * B, last_slots=[-1] * B, accepted=[None] * B,
                         draft_tokens=[0] * B)
        free = []
        for part, idx in (("plain", choice.plain), ("spec", choice.spec)):
            if not idx:
                continue
            sub = [reqs[i] for i in idx]
            if part == "plain":
                t = time.perf_counter()
                res, _ = self._plain(sub)
                dt = time.perf_counter() - t
                self.plain_seconds += dt
                self._pending.append((PLAIN, len(sub), dt, 1))
                self.policy.observe_plain(sub)
            else:
                res = self._speculate(sub, choice.shape)
            for j, i in enumerate(idx):
                out.tokens[i], out.logprobs[i], out.failed[i] = (res.tokens[j], res.logprobs[j],
                                                                 res.failed[j])
                out.kv_advance[i], out.last_slots[i] = res.kv_advance[j], res.last_slots[j]
                if part == "spec":
                    out.accepted[i], out.draft_tokens[i] = res.accepted[j], res.draft_tokens
            if res.free_slots is not None:
                free.append(res.free_slots)
        out.free_slots = torch.cat(free) if free else None
        return out

    def _speculate(self, sub, shape, max_chain: int = 1, overlap: bool = False) -> StepResult:
        """The speculative part of a step: the draft catches up on what `sub` decoded plainly,
        then one step of `shape`'s worker, or a chain of up to `max_chain` (the worker's
        `chain_len` decides); its parts timed (a chain's seconds per step) and its
        acceptance observed step by step, as if the steps had run one by one. `overlap`
        (the whole batch): if the step runs as a replay (CUDA graphs), the policy's work
        for the next step runs while the device works (`_while_device`), and this step's
        acceptance is observed during the next one's."""
        t = time.perf_counter()
        lag = self._catch_up(sub)
        if lag:         # (requests, tokens each): charged to the plain steps behind it
            self._pending.append((CATCHUP, lag[0], time.perf_counter() - t, lag[1]))
        t = time.perf_counter()
        worker = self.workers[shape]
        hid = []            # non-empty once the hook ran (the steps the replay ran)
        if overlap:
            worker.before_sync = lambda k: (hid.append(k), self._while_device(sub, max_chain))
        chains = self.chained_costs and worker._step_graph_fits(sub)   # (a greedy replay)
        try:
            res = worker.decode(sub, max_chain)
        finally:
            worker.before_sync = None
        acc = [None if f else a for f, a in zip(res.failed, res.accepted)]
        steps = [a for a in acc if isinstance(a, list)]
        # a chain's requests may keep different numbers of its steps (one whose budget runs
        # out inside the chain stops there): the chain ran as many as the longest kept
        k = max(map(len, steps)) if steps else 1
        part = (shape.label, len(sub), time.perf_counter() - t, k)
        if chains and k < min(worker.chain_steps, max_chain):
            part += (True,)     # cut short (a budget's end): one sync for fewer steps
        self._pending.append(part)
        if steps and not hid:   # (the hook consumed the held steps before choosing ahead)
            self.policy.consume_held(max_chain - 1)

        def observe():
            # a request released since (finished or preempted: row 0, the padding row) is not
            # observed: its row may be another request's by now
            got = [None if r.row == 0 else a for r, a in zip(sub, acc)]
            if not steps:
                return self.policy.observe_spec(sub, shape, got)
            # a request that stopped before step j is not observed there
            self.policy.observe_chain(sub, shape, [[a[j] if a is not None and j < len(a)
                                                    else None for a in got] for j in range(k)])
        if hid:
            self._deferred = observe
        else:
            self._flush()
            observe()
        return res

    # ---- the policy's work beside the device's -------------------------------------------------
    def _while_device(self, reqs, offered: int) -> None:
        """Run while a whole-batch replay is on the device (EagleWorker's `before_sync`; it
        was offered `offered` steps, the held ones consumed whether the worker's chain ran
        them all or was cut shorter): observe the previous step's acceptance (`_deferred`),
        then choose the next step for the same batch (`_ahead`, used if the batch is
        unchanged). On an H100 the policy's host work between two chains was 0.4 ms at batch 1
        and 0.9 ms at batch 4 with the device idle (2026-12-06: adaptive 9.9 / 10.9 ms a chain where the fixed S5
        took 9.5 / 10.0). The choice is then made from the acceptance of the steps before the
        one just replayed, still a function of the past only (lossless, adaptive.py)."""
        self._flush()
        self.policy.consume_held(offered - 1)
        chain = self._can_chain(reqs)
        choice = self.policy.choose(reqs, chain=chain)
        self._count(choice, -1)       # counted when a step runs it (`_take_ahead`)
        self._ahead = (tuple(r.rid for r in reqs), chain, choice)

    def _take_ahead(self, reqs, chain: bool):
        """The choice made during the last replay, if it was made for this batch (the same
        requests in the same order, the same chaining), or it was a whole-batch speculative
        choice and this batch is that one less the requests that finished since: else None.
        It is counted here, when a step runs it.

        The second case is the tail of a batch: on an H100 at batch 64 (2026-12-06) requests
        finished in almost every chain of the run's last third, and each such chain began
        with the deferred observation and a fresh choice with the device idle (~0.5 ms a
        chain on that host, where the next choice was the same shape again). The choice is
        then one chain staler for the smaller batch; the one made during this chain is for
        this batch."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        rids, was_chain, choice = ahead
        if was_chain == chain and len(rids) == len(reqs) and all(
                r.rid == x for r, x in zip(reqs, rids)):
            self._count(choice, +1)
            return choice
        if (was_chain == chain and choice.shape is not None and not choice.plain
                and len(reqs) < len(rids) and _is_subsequence([r.rid for r in reqs], rids)):
            choice = Choice(choice.shape, list(range(len(reqs))), [], explore=choice.explore)
            self._count(choice, +1)
            return choice
        self.policy._spec_key = self.policy._plain_key = None      # nothing held from it
        return None

    def _count(self, choice, n: int) -> None:
        """Add n to the policy's count of `choice` (SpecStats.choices, the Prometheus
        counter's source: the steps each choice ran)."""
        counts = self.policy.counts
        counts[choice.label] = counts.get(choice.label, 0) + n
        if not counts[choice.label]:
            del counts[choice.label]
        self.policy.explored += n * choice.explore

    def _flush(self) -> None:
        """Observe the deferred step's acceptance now (before a choice that needs it)."""
        observe, self._deferred = self._deferred, None
        if observe is not None:
            observe()

    # ---- what a step cost ----------------------------------------------------------------------
    def step_done(self, seconds: float) -> None:
        """The engine's wall time of the step just committed (planning, the run, the
        commit): the costs of the step's parts are observed with it (module docstring)."""
        self._charge(seconds)

    def _charge(self, wall: float | None) -> None:
        """Observe the pending step's parts: (label, requests, timed seconds, tokens each[,
        True: a chain cut short, not observed once its cell is known (CHAINED_COSTS)]).
        `wall`: the whole step's seconds, the untimed rest shared in proportion to the timed
        ones; None: the timed parts alone."""
        parts, self._pending = self._pending, None
        if not parts:
            return
        timed = sum(p[2] for p in parts)
        scale = 1.0 if wall is None or timed <= 0 else max(1.0, wall / timed)
        for label, n, sec, k, *short in parts:
            if short and self.policy.costs.known(label, n):      # (chained_costs)
                continue
            self.policy.costs.observe(label, n, sec * scale / k)

    # ---- plain steps and catching up ---------------------------------------------------------------
    def _can_chain(self, reqs) -> bool:
        """An all-plain step of `reqs` would decode a chain (ModelRunner.run_graph's rule:
        decode graphs, every request greedy without penalties or logprobs, 2+ tokens of
        budget left in each)."""
        return (self.graphs is not None and self.decode_steps > 1
                and self.graphs.bucket(len(reqs)) is not None
                and all(r.params.greedy and not r.params.has_penalties
                        and r.params.logprobs is None
                        and r.params.max_new_tokens - len(r.output_ids) > 1 for r in reqs))

    def _plain(self, reqs, chain: bool = False,
               longest: int | None = None) -> tuple[StepResult, int]:
        """One token per request (the root) at position kv_len: the target's forward, its
        sampling as in plain decoding, and each request's draft input of that position kept;
        `chain`: up to `longest` (default `decode_steps`) tokens per request
        (ModelRunner.run_chain), each one's draft input kept. -> (the result, the tokens
        decoded per request: k)."""
        res = self.res
        n = len(reqs)
        prefix = [r.kv_len for r in reqs]
        slots = (res.allocator.alloc(1, prefix[0], reqs[0].last_slot) if n == 1 else
                 res.allocator.alloc_decode(prefix, [r.last_slot for r in reqs]))  # (n,) cpu
        rows = [r.row for r in reqs]
        ids = [[r.output_ids[-1]] for r in reqs]
        plan = StepPlan("extend", list(reqs), ids=ids, prefix_lens=prefix,
                        slots=list(slots.view(-1, 1)))
        everyone = list(range(n))
        if self.graphs is not None and self.graphs.bucket(n) is not None:
            # the replay writes req_to_token and the features itself
            result = self._run_graph(plan, slots, chain, longest)
        else:
            where = torch.tensor([rows, prefix], dtype=torch.int64).to(res.device)
            res.req_to_token.req_to_token[where[0], where[1]] = slots.to(res.device,
                                                                         torch.int32)
            batch = ForwardBatch.build(ids, prefix, rows, slots, res.device)
            fwd = res.model.forward(batch, res.backend, logits_indices=batch.last_token_indices,
                                    return_hidden=True,
                                    capture_layers=self.drafter.capture_layers)
            store_features(self.feature_table, batch.out_cache_loc, self.drafter.features(fwd))
            result = ModelRunner.sample(plan, everyone, fwd.logits)
        # a chain's kv_advance counts its steps past the first (run_chain's contract)
        more = result.kv_advance or [0] * n
        last = result.last_slots or [-1] * n
        k = 1 + max(more)
        result.kv_advance, result.last_slots = [0] * n, [-1] * n
        result.accepted = [None] * n
        bad = [] if result.free_slots is None else [result.free_slots]   # failed chains' tails
        for i, r in enumerate(reqs):
            if result.failed[i]:     # fails alone after the tokens it made (a chain's)
                bad.append(slots[i:i + 1])
                continue
            result.kv_advance[i] = 1 + more[i]
            result.last_slots[i] = last[i] if more[i] else int(slots[i])
            lag = r.draft_state if isinstance(r.draft_state, Lag) else Lag(r.kv_len)
            lag.tokens.extend(result.tokens[i])      # token p + 1 of every position p decoded
            r.draft_state = lag
        result.free_slots = torch.cat(bad) if bad else None
        return result, k

    def _run_graph(self, plan: StepPlan, slots: torch.Tensor, chain: bool,
                   longest: int | None = None) -> StepResult:
        """ModelRunner.run_graph over the plan (a chain where it can run one). run_chain reads
        each request's kv_len and last slot as the scheduler leaves them after planning a
        plain decode (the step's first slot taken): so they are advanced by that slot for the
        call and put back after it; the books change only when the scheduler commits."""
        runner = ModelRunner(self.res, self.graphs,
                             (longest or self.decode_steps) if chain else 1)
        if not chain:
            return runner.run_graph(plan, list(range(len(plan.reqs))))
        books = [(r.kv_len, r.last_slot) for r in plan.reqs]
        for r, s in zip(plan.reqs, slots.tolist()):
            r.kv_len, r.last_slot = r.kv_len + 1, s
        try:
            return runner.run_graph(plan, list(range(len(plan.reqs))))
        finally:
            for r, (kv, last) in zip(plan.reqs, books):
                r.kv_len, r.last_slot = kv, last

    def _catch_up(self, reqs) -> tuple[int, float] | None:
        """The draft over every lagging request's kept inputs, in one extend -> (lagging
        requests, mean tokens each), or None when none lagged."""
        lag = [r for r in reqs if isinstance(r.draft_state, Lag)]
        if not lag:
            return None
        r2t = self.res.req_to_token.req_to_token
        ids, prefix, slots = [], [], []
        for r in lag:
            st = r.draft_state
            assert st.start + len(st.tokens) == r.kv_len, (st.start, len(st.tokens), r.kv_len)
            ids.append(st.tokens)
            prefix.append(st.start)
            slots.append(r2t[r.row, st.start:r.kv_len].to(torch.int64))
        slots = torch.cat(slots)
        # these slots are the requests' own committed ones; the draft's store checks them too
        hidden = self.feature_table[slots.clamp(0, self.feature_table.shape[0] - 1)]
        self.first._draft_extend(lag, ids, prefix, slots, hidden, [r.all_ids for r in lag])
        return len(lag), sum(len(t) for t in ids) / len(lag)

    def explain(self, batch: int = 1) -> str:
        """What the policy chose so far and why (the CLI prints it with the step counts)."""
        counts = ", ".join(f"{k} {v}" for k, v in sorted(self.policy.counts.items()))
        return f"steps per choice: {counts or 'none yet'}\n{self.policy.explain(batch)}"
