"""CUDA graphs for the target's forwards: captured at start-up, one per batch bucket,
replayed by the runners (SGLang's CudaGraphRunner, in small).

A decode step of a small model is bound by the host: ~600 kernel launches from Python take
50-80 ms on the H200's host for ~1.2 ms of device work. A graph replays them in one call.

`DecodeGraphs` captures the plain decode forward (one token per request -> logits):
embed -> layers (add+RMSNorm, QKV matmul, RoPE + guarded K/V store, Triton decode attention,
O matmul, add+RMSNorm, gate/up matmul, SiLU*mul, down matmul) -> final norm -> LM head.
`VerifyGraphs` captures the speculative verify forward (N tree nodes per request under the
tree mask -> logits and hidden states). `PrefillGraphs` captures one request's extend of up
to a few hundred tokens (a prompt, or a chunk of one) per token bucket, causal over its
cached prefix -> the logits of its last token (`cuda_graph_prefill_tokens`: 256 by default
under decode graphs); with PREFILL_GRAPH_PACK (the default) the extends of up to 16 requests
packed into one replay (prompts, chunks, or a plain step's decode tokens beside a prompt). Both run over static device buffers that each replay fills. Padded
rows (bucket > batch) point at req_to_token's padding row 0 and write their K/V into slot 0,
the padding page, so a replay never reads or writes a real request's KV.

The guards stay on inside the graphs: every guarded kernel was registered with the KVGuard at
capture time under a call id of the graph kind's own range (`KVGuard.capturing`; the id is
baked into the graph); a replay hands the guard those calls (`KVGuard.replaying`), whose
index tensors are the static buffers holding this replay's values, so an out-of-range slot
is raised as KVIndexError at the step's one host sync, naming the op, the layer and the
slot, exactly as without graphs, and after any eager guarded call of the same step.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager

import numpy as np
import torch

from eaglekv.attention.triton_backend import TritonAttnMetadata
from eaglekv.errors import KVIndexError
from eaglekv.kernels.greedy import greedy_pick
from eaglekv.kernels.guard import kv_guard
from eaglekv.model.llama import ModelOutput

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# Decode chains of the full length as ONE graph (`DecodeGraphs.chain_graphs`) for batch buckets
# up to this (0: off, the default until timed on a GPU; EAGLEKV_CHAIN_GRAPH_MAX_BS). A chain of
# k replays pays a graph launch and three small copies a token; at batch 1 on the H200 a
# 32-token chain's 31 graph-to-graph transitions took ~0.3 ms of its ~18 ms (2026-12-06
# profile, the 2-100 us gaps). The captured chain runs the same forward k times with each
# step's argmax read in place by the next, so its tokens equal the replayed chain's.
CHAIN_GRAPH_MAX_BATCH = int(os.environ.get("EAGLEKV_CHAIN_GRAPH_MAX_BS", "0"))


def store_features(table: torch.Tensor, slots: torch.Tensor, feats: torch.Tensor) -> None:
    """table[slots] = feats, a slot outside the table redirected to row 0 (the padding page:
    the K/V store of the same step refuses that slot and fails the step with KVIndexError,
    so a bad slot never writes past the table nor into another request's row)."""
    ok = (slots >= 0) & (slots < table.shape[0])
    table.index_copy_(0, torch.where(ok, slots, torch.zeros_like(slots)), feats.to(table.dtype))


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ..., 64, then every 64 up to `max_batch`, and `max_batch` itself."""
    out = [b for b in DEFAULT_BUCKETS if b < max_batch]
    out += list(range(128, max_batch, 64))
    return tuple(sorted(set(out) | {max_batch}))


class CapturedForwards:
    """One captured forward per batch bucket over static buffers; subclasses say what the
    forward is (`_forward(b)`) and how a batch fills the buffers."""

    name = "forward"
    first_call_id = 1 << 20     # this kind's guard call ids (the step's eager ones count from 0)

    def __init__(self, model, backend, max_batch: int, capture: bool = True):
        """`capture=False` runs each "replay" as the eager forward over the same static
        buffers (no graph): the CPU tests check the buffer logic (padding, copies) that way."""
        self.model, self.backend = model, backend
        self.device = model.device
        self.buckets = batch_buckets(max_batch)
        self.capture = capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, list]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0

    def _forward(self, b: int):
        raise NotImplementedError

    def capture_all(self, progress: bool) -> None:
        if not self.capture:
            return
        order = sorted(self.buckets, reverse=True)      # the largest first: its pool is reused
        if progress:
            from tqdm import tqdm
            order = tqdm(order, desc=f"capturing CUDA graphs ({self.name})", unit="graph")
        guard = kv_guard(self.device)
        with no_gc(), torch.inference_mode(), guard.step():
            for b in order:
                self.graphs[b] = self._capture(b, guard)
        guard.raise_if_error()    # the warm-ups wrote only the padding page

    def _capture(self, b: int, guard, forward=None, warmups: int = 2) -> tuple:
        """(graph, its outputs, its guarded calls) of `forward(b)` (default `_forward`)."""
        forward = forward or self._forward
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):                     # warm-up: Triton compiles, cuBLAS
            for _ in range(warmups):
                forward(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with guard.capturing(self.first_call_id) as calls, torch.cuda.graph(graph, pool=self.pool):
            out = forward(b)
        return graph, out, dict(calls)

    def bucket(self, n: int) -> int | None:
        """The smallest captured batch that holds n rows (None: n is past the largest)."""
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _replay(self, b: int, graphs: dict | None = None, forward=None):
        """Replay bucket b (its buffers filled) inside the step's `guarded` context; `graphs`
        and `forward`: another captured forward of the same buffers (default `_forward`)."""
        self.replays += 1
        if not self.capture:
            with torch.inference_mode():
                return (forward or self._forward)(b)
        graph, out, calls = (self.graphs if graphs is None else graphs)[b]
        kv_guard(self.device).replaying(calls)
        graph.replay()
        return out


@contextmanager
def no_gc():
    """No garbage collection while graphs are captured. torch.cuda.graph no longer collects
    before a capture (torch.compiler.config.force_cudagraph_gc is off), so a collection
    triggered by the capture's own Python allocations could free a dead engine's graphs
    inside ours: CUDAGraph.reset is not permitted while a stream captures, and the capture
    fails with "operation failed due to a previous error during capture" (seen on the H200
    when one test's engine died in a cycle before the next captured). So: collect once,
    then hold the collector off until the captures end (vLLM freezes it for the same reason)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class DecodeGraphs(CapturedForwards):
    """The target's decode forward (one token per request -> logits), captured per bucket."""

    name = "decode"
    # kv_start (row * req_to_token's width) and kv_len (position + 1) come from the host with
    # the rest: two device ops a step fewer in the graph (a mul and an add, ~1.4 us each a
    # token at batch 1 on the H100, 2026-12-05)
    FIELDS = ("ids", "positions", "rows", "slots", "kv_start", "kv_len")

    chain_call_id = 5 << 20       # the chain graphs' guard call ids

    def __init__(self, model, backend, max_batch: int, max_kv_len: int, progress: bool = True,
                 capture: bool = True, features=None, feature_table=None, req_to_token=None,
                 chain_steps: int = 0, chain_graph_max_batch: int | None = None):
        """The adaptive runner's plain steps: `features` (a drafter) and `feature_table`
        (slots, Hf): the forward also writes each token's draft feature at its slot, for the
        draft to catch up on later; `req_to_token` (rows, width) int32: it also writes each
        request's new slot into the table (one host copy a step does it all).
        `chain_steps` (the runner's longest decode chain, num_scheduler_steps): with 2 or more,
        a chain of exactly that many steps at a bucket up to `chain_graph_max_batch` (default
        CHAIN_GRAPH_MAX_BATCH; 0: none) replays one graph of the whole chain."""
        super().__init__(model, backend, max_batch, capture)
        self.max_kv_len = max_kv_len
        self.features, self.feature_table, self.req_to_token = (features, feature_table,
                                                                req_to_token)
        n = self.buckets[-1]
        # one pinned host block and its device twin: a replay is one copy of (6, n) int64;
        # every row starts as padding (row 0, position 0, slot 0, one key)
        self.host = torch.zeros(len(self.FIELDS), n, dtype=torch.int64)
        self.host[5] = 1
        if capture:
            self.host = self.host.pin_memory()
        self.host_np = self.host.numpy()
        self.dev = self.host.to(self.device, copy=True)
        self.chain = None         # replay_chain's buffers, made on its first use
        self.capture_all(progress)
        cap = CHAIN_GRAPH_MAX_BATCH if chain_graph_max_batch is None else chain_graph_max_batch
        self.chain_steps = chain_steps if chain_steps > 1 and cap > 0 else 0
        self.chain_graphs: dict[int, tuple] = {}
        self.chain_buckets = {b for b in self.buckets if b <= cap} if self.chain_steps else set()
        self.chain_graph_replays = 0
        if self.chain_buckets:
            self._chain_buffers(self.chain_steps)   # fixed addresses: the graphs read them
            self._capture_chains(progress)

    def _chain_buffers(self, k: int) -> tuple:
        """replay_chain's buffers for chains of up to k steps: the pinned host block (k, 6, n),
        its device twin and the (k, n, 2) picks of the replayed chain."""
        if self.chain is None or self.chain[0].shape[0] < k:
            if self.chain_steps and self.chain is not None:   # never past chain_steps
                raise ValueError(f"decode chain of {k} steps: the chain graphs hold "
                                 f"{self.chain_steps}")
            host = torch.zeros(k, *self.host.shape, dtype=torch.int64)
            host[:, 5] = 1                    # every row starts as padding, one key (capture)
            self.chain = (host.pin_memory() if self.capture else host,
                          host.to(self.device, copy=True),
                          torch.zeros(k, self.dev.shape[1], 2, dtype=torch.int64,
                                      device=self.device))
        return self.chain

    def _capture_chains(self, progress: bool) -> None:
        if not self.capture:
            return
        order = sorted(self.chain_buckets, reverse=True)
        if progress:
            from tqdm import tqdm
            order = tqdm(order, desc=f"capturing CUDA graphs (decode chains of "
                                     f"{self.chain_steps})", unit="graph")
        guard = kv_guard(self.device)
        saved, self.first_call_id = self.first_call_id, self.chain_call_id
        try:
            with no_gc(), torch.inference_mode(), guard.step():
                for b in order:
                    self.chain_graphs[b] = self._capture(b, guard, self._forward_chain, 1)
        finally:
            self.first_call_id = saved
        guard.raise_if_error()

    def _forward_chain(self, b: int) -> torch.Tensor:
        """A whole chain of `chain_steps` decode steps over the chain's device block: step j
        reads its positions, rows and slots from block j and its input token from step j - 1's
        pick in place (step 0's from the block) -> (chain_steps, b, 2) picks."""
        dev = self.chain[1]
        ids, picks = dev[0, 0, :b], []
        for j in range(self.chain_steps):
            _, greedy = self._forward_on(ids, *(dev[j, i, :b] for i in range(1, 6)))
            picks.append(greedy)
            ids = greedy[:, 0]
        return torch.stack(picks)

    def _forward(self, b: int) -> tuple:
        return self._forward_on(*(self.dev[i, :b] for i in range(len(self.FIELDS))))

    def _forward_on(self, ids, pos, rows, slots, kv_start, kv_len) -> tuple:
        """The decode forward over these (b,) inputs -> (logits (b, V), picks (b, 2))."""
        if self.req_to_token is not None:    # padding rows: row 0, position 0 <- slot 0
            self.req_to_token[rows, pos] = slots.to(torch.int32)
        meta = self.backend.decode_metadata(kv_start, kv_len, slots, self.max_kv_len,
                                            one_token=True)
        f = self.features
        out = self.model.forward_tokens(ids, pos, self.backend, meta, return_hidden=f is not None,
                                        capture_layers=() if f is None else f.capture_layers)
        logits = out.logits                                                       # (b, V)
        if f is not None:
            store_features(self.feature_table, slots, f.features(out))
        # the greedy pick and its validity (sampling.valid_argmax's rule), for an all-greedy
        # batch, in one launch (kernels/greedy.py)
        greedy = greedy_pick(logits)                                              # (b, 2)
        return logits, greedy

    def replay(self, ids: list[int], positions: list[int], rows: list[int],
               slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of n requests -> (n, V) logits and (n, 2) [argmax, argmax is
        valid] (views of the graph's outputs, valid until the next replay). Call inside the
        step's `guarded` context."""
        n = len(ids)
        b = self.bucket(n)
        h = self.host_np
        h[:, n:b] = 0                                     # padding rows: row 0, slot 0
        h[4, n:b] = 0                                     # and 1 key, the padding row's
        h[5, n:b] = 1
        h[0, :n], h[1, :n], h[2, :n], h[3, :n] = ids, positions, rows, slots
        h[4, :n] = h[2, :n] * self.backend.width
        h[5, :n] = h[1, :n] + 1
        # the host block is not written again before the step's sync: the copy is done then
        self.dev.copy_(self.host, non_blocking=True)
        logits, greedy = self._replay(b)
        return logits[:n], greedy[:n]

    def replay_chain(self, ids: list[int], positions: list[int], rows: list[int],
                     slots: np.ndarray) -> torch.Tensor:
        """k greedy decode steps of n requests back to back, no host work between them (the
        multi-step decode of `EngineConfig.num_scheduler_steps`): step j's input token is
        step j - 1's argmax, copied on the device; request i sits at positions[i] + j and
        writes slots[j, i] ((k, n), allocated and in req_to_token). One host copy of the
        whole block, then per step a device copy into the graph's inputs and a replay.
        -> (k, n, 2) [argmax, argmax is valid] of every step on the device, read at the
        step's one sync. Call inside the step's `guarded` context."""
        k, n = slots.shape
        b = self.bucket(n)
        host, dev, out = (x[:k] for x in self._chain_buffers(k))
        h = host.numpy()
        h[:, :, n:b] = 0                                  # padding rows: row 0, slot 0
        h[:, 5, n:b] = 1                                  # and 1 key, the padding row's
        h[:, 0, :n] = ids                                 # steps >= 1: overwritten below
        h[:, 1, :n] = np.asarray(positions)[None, :] + np.arange(k)[:, None]
        h[:, 2, :n] = rows
        h[:, 3, :n] = slots
        h[:, 4, :n] = h[:, 2, :n] * self.backend.width
        h[:, 5, :n] = h[:, 1, :n] + 1
        self._check_chain_slots(h[:, 3, :b])
        dev.copy_(host, non_blocking=True)
        if k == self.chain_steps and b in self.chain_buckets:      # the chain as one graph
            self.chain_graph_replays += 1
            return self._replay(b, self.chain_graphs, self._forward_chain)[:, :n]
        for j in range(k):
            self.dev.copy_(dev[j])
            if j:
                self.dev[0, :n].copy_(out[j - 1, :n, 0])
            _, greedy = self._replay(b)
            out[j, :b].copy_(greedy)
        return out[:, :n]

    def _check_chain_slots(self, slots: np.ndarray) -> None:
        """The graph's guarded store reports a bad slot by reading the input buffer at the
        sync, which after a chain holds its last step's slots only: so a chain's write slots
        are checked here, on the host, before any step runs (the guards stay on inside)."""
        limit = self.backend.kv_pool.size_limit
        bad = (slots < 0) | (slots >= limit)
        if bad.any():
            raise KVIndexError("decode chain out_cache_loc", int(slots[bad][0]), limit,
                               int(bad.sum()), slots.size)


class VerifyGraphs(CapturedForwards):
    """The target's verify forward: N tree nodes per request at positions prefix + depth
    under the tree mask -> logits (B*N, V) and hidden states (and EAGLE-3's captured layer
    outputs), captured per bucket."""

    name = "verify"
    first_call_id = 2 << 20

    def __init__(self, model, backend, max_batch: int, num_tokens: int,
                 capture_layers: tuple[int, ...] = (), progress: bool = True,
                 capture: bool = True, chain: bool = False):
        super().__init__(model, backend, max_batch, capture)
        N, n, dev = num_tokens, self.buckets[-1], self.device
        self.N, self.capture_layers = N, tuple(capture_layers)
        self.chain = chain       # every tree a chain (topk 1): backend.verify_metadata
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        self.ids, self.positions, self.out_cache_loc = z(n * N), z(n * N), z(n * N)
        self.rows, self.prefix = z(n), z(n)
        self.extend_len = torch.full((n,), N, dtype=torch.int64, device=dev)
        self.q_start = torch.arange(n, device=dev) * N
        self.eye = torch.eye(N, dtype=torch.bool, device=dev)
        self.mask = self.eye.expand(n, N, N).clone()     # padding rows: each node sees itself
        self.capture_all(progress)

    def _forward(self, b: int) -> ModelOutput:
        T = b * self.N
        meta = self.backend.verify_metadata(self.rows[:b] * self.backend.width,
                                            self.prefix[:b], self.extend_len[:b],
                                            self.q_start[:b], self.mask[:b], self.N,
                                            self.out_cache_loc[:T], chain=self.chain)
        return self.model.forward_tokens(self.ids[:T], self.positions[:T], self.backend, meta,
                                         return_hidden=True,
                                         capture_layers=self.capture_layers)

    def run(self, input_ids, positions, rows, prefix_lens, out_cache_loc,
            mask) -> ModelOutput:
        """input_ids, positions, out_cache_loc: (n*N,); rows, prefix_lens: (n,); mask
        (n, N, N) bool, all on the device -> the forward's output for the n requests (views
        of the graph's buffers, valid until the next replay)."""
        n, N = rows.shape[0], self.N
        b = self.bucket(n)
        T, Tb = n * N, b * N
        for dst, src in ((self.ids, input_ids), (self.positions, positions),
                         (self.out_cache_loc, out_cache_loc)):
            dst[:T].copy_(src)
            dst[T:Tb].zero_()                             # padding: position 0, slot 0
        self.rows[:n].copy_(rows)
        self.prefix[:n].copy_(prefix_lens)
        self.mask[:n].copy_(mask)
        if b > n:
            self.rows[n:b].zero_()                        # req_to_token's padding row
            self.prefix[n:b].zero_()
            self.mask[n:b].copy_(self.eye)
        out = self._replay(b)
        return ModelOutput(logits=out.logits[:T], hidden=out.hidden[:T],
                           aux_hidden=[a[:T] for a in out.aux_hidden]
                           if out.aux_hidden is not None else None)


PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token buckets of the prefill graphs: the powers of two from 16 below `max_tokens`,
    and `max_tokens` itself (the largest extend a graph takes is one token fewer: a graph
    always has a padding token, see PrefillGraphs)."""
    out = [b for b in PREFILL_BUCKETS if b < max_tokens]
    return tuple(out + [max_tokens])


# with packing on, the requests one prefill replay packs (a step's prompts after a wave of
# admissions); a step with more, or more tokens than the largest bucket, runs as up to
# PREFILL_GRAPH_MAX_GROUPS replays of packed groups, else eagerly (an eager prefill of 8
# prompts was ~12 ms of ~600 launches on an H100 at batch 8, 2026-12-07). On by default since
# 2026-12-08: on an H100 (random model, refilled batches) a wave's prefill step took 2.1-2.4 ms
# instead of 13 at batch 4 and plain ran 1.03-1.06x, S7 1.02-1.03x; its GPU tests passed but
# for chunked prefill, a bug of the sampled rows (fixed in runner.replay_prefill, reproduced
# and tested on the CPU; the GPU re-run is pending). EAGLEKV_PREFILL_PACK=0 (the bench's
# `_nopack` modes) turns it off: one request a replay, a step of several prefills eager
PREFILL_GRAPH_PACK = os.environ.get("EAGLEKV_PREFILL_PACK", "1") != "0"
PREFILL_GRAPH_MAX_REQS = 16
PREFILL_GRAPH_MAX_GROUPS = 4


class PrefillGraphs(CapturedForwards):
    """Up to `max_reqs` requests' extends (one unless PREFILL_GRAPH_PACK), T tokens in all,
    each after its cached prefix (a prompt, or a chunk of one) -> the logits of each
    request's last token, captured per token bucket Tb > T.

    At batch 1 an eager prefill is ~600 kernel launches from Python (16-24 ms on the H100's
    host for a 40-token prompt of SmolLM2, most of the time to first token); replayed, one
    call. The requests are packed in order (request i's queries follow request i - 1's);
    the graph has `max_reqs` request entries and one more, last, for the padding request.
    An entry no request uses has no tokens (its attention programs exit at once), and the
    Tb - T tokens past the requests' form the padding request: req_to_token's padding row 0,
    prefix 0, positions 0 .., every K/V written to slot 0 (the padding page), causal among
    themselves, so no real request sees them and they read or write no real request's KV.
    A bucket always holds at least one padding token. The extend attention's grid is
    captured for Tb queries a request and its key bound for the whole context
    (`max_keys`): a replay holds any prefix. A step whose requests do not fit one replay
    runs as several (`groups`), each one's outputs copied out before the next."""

    name = "prefill"
    first_call_id = 3 << 20

    def __init__(self, model, backend, max_tokens: int, max_kv_len: int,
                 progress: bool = True, capture: bool = True, hidden: bool = False,
                 capture_layers: tuple[int, ...] = (), max_reqs: int | None = None,
                 max_groups: int | None = None):
        """`hidden`: the forward also returns every token's hidden state (and the outputs of
        `capture_layers`, EAGLE-3's): a speculative prefill feeds them to the draft.
        `max_reqs` and `max_groups` (None: PREFILL_GRAPH_MAX_REQS and _MAX_GROUPS where
        PREFILL_GRAPH_PACK, else 1 each) are read here, when the graphs are made."""
        super().__init__(model, backend, 1, capture)
        self.buckets = prefill_buckets(max_tokens)
        self.max_kv_len = max_kv_len
        pack = PREFILL_GRAPH_PACK
        if max_reqs is None:
            max_reqs = PREFILL_GRAPH_MAX_REQS if pack else 1
        if max_groups is None:
            max_groups = PREFILL_GRAPH_MAX_GROUPS if pack else 1
        self.max_reqs = R = max(1, int(max_reqs))
        self.max_groups = max(1, int(max_groups))
        self.hidden, self.capture_layers = hidden, tuple(capture_layers)
        n, dev = self.buckets[-1], self.device
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        self.ids, self.positions, self.out_cache_loc = z(n), z(n), z(n)
        # R request entries and the padding request's (last): rows, prefixes, lengths, first
        # queries; each request entry's last token
        self.rows, self.prefix, self.extend_len, self.q_start = (z(R + 1) for _ in range(4))
        self.last = z(R)
        # one pinned host block for the whole fill: ids, positions, slots | rows, prefix,
        # extend_len, q_start (R + 1 each), last (R)
        self.host = torch.zeros(3 * n + 5 * R + 4, dtype=torch.int64)
        if capture:
            self.host = self.host.pin_memory()
        self.host_np = self.host.numpy()
        self.dev = z(3 * n + 5 * R + 4)
        self.capture_all(progress)

    def groups(self, extend_lens) -> list[range] | None:
        """The step's requests (their extend lengths, in order) packed into replays: runs of
        consecutive requests, each of at most `max_reqs` requests and one token fewer than
        the largest bucket; None if a request has no token or does not fit alone, or more
        than `max_groups` replays would be needed (eager is cheaper then)."""
        cap, R = self.buckets[-1] - 1, self.max_reqs
        out, start, tokens = [], 0, 0
        for i, e in enumerate(extend_lens):
            if not 0 < e <= cap:
                return None
            if i > start and (tokens + e > cap or i - start == R):
                out.append(range(start, i))
                start, tokens = i, 0
            tokens += e
        if len(extend_lens):
            out.append(range(start, len(extend_lens)))
        return out if 0 < len(out) <= self.max_groups else None

    def fits(self, extend_lens) -> bool:
        """The requests extending by `extend_lens` tokens (in order) replay (`groups`)."""
        return self.groups(extend_lens) is not None

    def bucket(self, n: int) -> int | None:
        return super().bucket(n + 1)              # at least one padding token

    def _forward(self, b: int):
        meta = TritonAttnMetadata(kv_start=self.rows * self.backend.width,
                                  out_cache_loc=self.out_cache_loc[:b], kv_len=None,
                                  prefix_len=self.prefix, extend_len=self.extend_len,
                                  q_start=self.q_start, mask=None, max_extend=b,
                                  max_keys=self.max_kv_len)
        return self.model.forward_tokens(self.ids[:b], self.positions[:b], self.backend, meta,
                                         logits_indices=self.last, return_hidden=self.hidden,
                                         capture_layers=self.capture_layers)

    def _capture(self, b: int, guard) -> tuple:
        self._fill([[1] * (b - 1)], [0], [0], [np.zeros(b - 1, dtype=np.int64)], b)  # padding
        return super()._capture(b, guard)

    def _fill(self, ids, prefix, rows, slots, b: int) -> None:
        """Request i < k: ids[i] at positions prefix[i] .. into slots[i], req_to_token row
        rows[i]; then the padding request of b - T tokens."""
        k, R, n = len(ids), self.max_reqs, self.buckets[-1]
        lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=k)
        ends = np.cumsum(lens)
        T = int(ends[-1])
        h = self.host_np
        h[:] = 0
        h[:T] = np.concatenate([np.asarray(x, dtype=np.int64) for x in ids])
        h[n:n + T] = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix, lens)])
        h[n + T:n + b] = np.arange(b - T)                      # the padding request's positions
        h[2 * n:2 * n + T] = np.concatenate(slots)             # padding tokens: slot 0
        tail, e = h[3 * n:], R + 1
        tail[:k] = rows                                        # unused entries: row 0, prefix 0,
        tail[e:e + k] = prefix                                 # no tokens
        tail[2 * e:2 * e + k] = lens
        tail[3 * e - 1] = b - T                                # the padding request (last entry)
        tail[3 * e:4 * e] = T                                  # unused and padding queries: at T
        tail[3 * e:3 * e + k] = ends - lens
        tail[4 * e:4 * e + R] = T - 1                          # an unused entry's logits: ignored
        tail[4 * e:4 * e + k] = ends - 1
        self.dev.copy_(self.host, non_blocking=True)
        for i, dst in enumerate((self.ids, self.positions, self.out_cache_loc)):
            dst.copy_(self.dev[i * n:(i + 1) * n])
        t = self.dev[3 * n:]
        for i, dst in enumerate((self.rows, self.prefix, self.extend_len, self.q_start)):
            dst.copy_(t[i * e:(i + 1) * e])
        self.last.copy_(t[4 * e:4 * e + R])

    def _run_one(self, ids, prefix, rows, slots) -> ModelOutput:
        k, T = len(ids), sum(map(len, ids))
        b = self.bucket(T)
        self._fill(ids, prefix, rows, slots, b)
        out = self._replay(b)
        return ModelOutput(logits=out.logits[:k],
                           hidden=None if out.hidden is None else out.hidden[:T],
                           aux_hidden=None if out.aux_hidden is None
                           else [a[:T] for a in out.aux_hidden])

    def run(self, ids, prefix, rows, slots) -> ModelOutput:
        """Extend request i (req_to_token row rows[i]) by ids[i] at positions prefix[i] ..
        (slots[i] allocated, written in req_to_token) -> the forward's output: (k, V) logits
        of each request's last token, and with `hidden` the (T, H) hidden states of their T
        tokens in order (views of the graph's buffers, valid until the next replay, where one
        replay ran). Call inside the step's `guarded` context."""
        parts = self.groups([len(x) for x in ids])
        if parts is None:
            raise ValueError(f"prefill graphs: {len(ids)} requests of {sum(map(len, ids))} "
                             f"tokens do not fit {self.max_groups} replays of at most "
                             f"{self.max_reqs} requests and {self.buckets[-1] - 1} tokens")
        if len(parts) == 1:
            return self._run_one(ids, prefix, rows, slots)
        outs = []
        for g in parts:
            o = self._run_one([ids[i] for i in g], [prefix[i] for i in g],
                              [rows[i] for i in g], [slots[i] for i in g])
            outs.append(ModelOutput(             # copied: the next replay overwrites them
                logits=o.logits.clone(), hidden=None if o.hidden is None else o.hidden.clone(),
                aux_hidden=None if o.aux_hidden is None else [a.clone() for a in o.aux_hidden]))
        return ModelOutput(
            logits=torch.cat([o.logits for o in outs]),
            hidden=None if outs[0].hidden is None else torch.cat([o.hidden for o in outs]),
            aux_hidden=None if outs[0].aux_hidden is None else
            [torch.cat(a) for a in zip(*[o.aux_hidden for o in outs])])
