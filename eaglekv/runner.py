"""The plain runner: "run this batch on the device". `ModelRunner.run(plan) -> StepResult`
is the one entry point the engine calls (SGLang's `forward_batch_generation`); the
speculative runner (speculative/eagle_worker.py) has the same signature and holds a
ModelRunner for its target. A runner never calls back into the scheduler or the engine: what
it needs is in `RunnerResources`, handed to it at construction, and what it decided goes back
in the StepResult, which the scheduler commits.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from eaglekv.core import ForwardBatch, StepPlan, StepResult
from eaglekv.kernels.guard import kv_guard
from eaglekv.sampling import sample_requests


@dataclass
class RunnerResources:
    """The device-side state a runner works on (owned by the engine, shared with the
    scheduler's books): the target model and its attention backend, the KV pool, the slot
    allocator and the request -> token table."""

    model: object                  # LlamaForCausalLM
    backend: object                # attention backend over kv_pool and req_to_token
    kv_pool: object
    allocator: object
    req_to_token: object
    device: torch.device
    dtype: torch.dtype
    page_size: int
    max_running_requests: int
    max_context_len: int
    num_target_layers: int
    cuda_graph_max_bs: int = 0     # largest batch captured in CUDA graphs; 0: run eagerly
    cuda_graph_prefill_tokens: int = 0   # one request's prefills below this replayed; 0: eager
    prefill_graphs: object = None  # the speculative workers' shared PrefillGraphs, once made


class ModelRunner:
    """Plain decoding: one target forward over the plan's extends, then the shared
    penalise -> sample -> logprobs block for the requests whose prompt is complete."""

    separate_decode = False        # a decode is an extend by one token

    def __init__(self, res: RunnerResources, graphs=None, decode_steps: int = 1,
                 prefill_graphs=None):
        """`graphs`: captured decode forwards (cuda_graph.DecodeGraphs), replayed for every
        step whose requests all extend by one token; None runs every step eagerly.
        `decode_steps` (EngineConfig.num_scheduler_steps): a greedy graph step decodes up to
        that many tokens per request in one engine step (`run_chain`). `prefill_graphs`
        (cuda_graph.PrefillGraphs): a step that extends one request by a bucket's worth of
        tokens replays one (EngineConfig.cuda_graph_prefill_tokens)."""
        self.res = res
        self.graphs = graphs
        self.decode_steps = decode_steps
        self.prefill_graphs = prefill_graphs

    def step_pages(self, kv_len: int) -> int:
        """Pages a running request may take in its next step: one token, at most one page."""
        return 1

    def window_pages(self, kv_len: int) -> int:
        """Pages past a request's last token that its last step may hold: none."""
        return 0

    def uniform_step_pages(self) -> int:
        """step_pages for every length (the scheduler's reserve check: one call a step)."""
        return 1

    def run(self, plan: StepPlan) -> StepResult:
        with guarded(self.res.device):
            if self.graphs is not None and self.graph_fits(plan):
                return self.run_graph(plan)
            if self.prefill_graphs is not None and self.prefill_fits(plan):
                return self.run_prefill_graph(plan)
            return self.run_extend(plan)[0]

    def prefill_fits(self, plan: StepPlan) -> bool:
        """An extend of at least one request by 2+ tokens (one token each is a decode step's)
        whose requests pack into the prefill graphs' replays (`PrefillGraphs.groups`)."""
        lens = [len(x) for x in plan.ids]
        return max(lens, default=0) > 1 and self.prefill_graphs.fits(lens)

    def replay_prefill(self, plan: StepPlan):
        """The plan's extends replayed (PrefillGraphs.run): the forward's output, its logits
        those of the requests that sample (`plan.sampling`, as `run_extend`'s: a request
        mid-way through a chunked prompt samples nothing, and its row is left out)."""
        out = self.prefill_graphs.run(plan.ids, plan.prefix_lens, [r.row for r in plan.reqs],
                                      [s.numpy() for s in plan.slots])
        done = plan.sampling
        if len(done) != len(plan.reqs):
            out = replace(out, logits=out.logits[done])
        return out

    def run_prefill_graph(self, plan: StepPlan) -> StepResult:
        """The plan's extends replayed (PrefillGraphs), then sampling as `run_extend`."""
        return self.sample(plan, plan.sampling, self.replay_prefill(plan).logits)

    def graph_fits(self, plan: StepPlan) -> bool:
        return (self.graphs.bucket(len(plan.reqs)) is not None
                and all(len(x) == 1 for x in plan.ids))

    def run_graph(self, plan: StepPlan, done: list[int] | None = None) -> StepResult:
        """A decode step (one token per request) as one replay of the captured forward; the
        requests of `done` sample (default: `plan.sampling`). A batch that picks greedily
        inside the graph decodes a chain of up to `decode_steps` tokens (`run_chain`)."""
        slots = torch.cat(plan.slots).numpy()
        done = plan.sampling if done is None else done
        in_graph = len(done) == len(plan.reqs) and all(
            r.params.greedy and not r.params.has_penalties and r.params.logprobs is None
            for r in plan.reqs)
        if in_graph and self.decode_steps > 1:
            chain = self.run_chain(plan, slots)
            if chain is not None:
                return chain
        logits, greedy = self.graphs.replay([x[0] for x in plan.ids], plan.prefix_lens,
                                            [r.row for r in plan.reqs], slots)
        if in_graph:              # picked inside the graph: the step's sync reads them
            result = StepResult.empty(len(plan.reqs))
            for i, (t, ok) in enumerate(greedy.tolist()):
                result.failed[i] = not ok
                result.tokens[i] = [t] if ok else None
            return result
        return self.sample(plan, done, logits if len(done) == len(plan.reqs) else logits[done])

    def run_chain(self, plan: StepPlan, slots) -> StepResult | None:
        """Multi-step decode (vLLM's multi-step scheduling): k greedy steps in one engine step,
        the graph replayed k times with each step's argmax fed to the next on the device and
        one sync at the end, so the host's per-step work (schedule, copies, commit) is paid
        once per k tokens. k is the smallest budget left in the batch (max_new_tokens, which
        also keeps every position inside max_context_len) capped at `decode_steps`, and
        shorter when the pool has fewer free slots. Lossless: each step is the same greedy
        replay as a single step; a request that stops (EOS, stop id or string) inside the
        chain keeps its tokens up to the stop (the scheduler's stop rules), the rest is
        dropped and its slots are freed with the request. None: a chain of one (no room or
        no budget), run as a plain step."""
        reqs = plan.reqs
        k = min(self.decode_steps,
                min(r.params.max_new_tokens - len(r.output_ids) for r in reqs))
        # (k-1, n) slots of steps 1 .. k-1 (fewer when the pool runs out: a chain never preempts)
        extra = self.res.allocator.alloc_decode_steps([r.kv_len for r in reqs],
                                                      [r.last_slot for r in reqs], k - 1)
        if not extra.shape[0]:
            return None
        k = 1 + extra.shape[0]
        n = len(reqs)
        chain_slots = torch.cat([torch.from_numpy(slots)[None], extra])             # (k, n)
        # req_to_token entries of positions kv_len .. kv_len + k - 2, in one copy
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64)
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        where = torch.stack([rows.repeat(k - 1),
                             (cols[None, :] + torch.arange(k - 1)[:, None]).reshape(-1),
                             chain_slots[1:].reshape(-1)]).to(self.res.device)      # (3, m)
        self.res.req_to_token.req_to_token[where[0], where[1]] = where[2].to(torch.int32)
        out = self.graphs.replay_chain([x[0] for x in plan.ids], plan.prefix_lens,
                                       rows.tolist(), chain_slots.numpy()).tolist()  # the sync
        result = StepResult(tokens=[None] * n, logprobs=[None] * n, failed=[False] * n,
                            kv_advance=[0] * n, last_slots=[-1] * n)
        free = []
        for i in range(n):
            toks = []
            for j in range(k):
                t, ok = out[j][i]
                if not ok:
                    break
                toks.append(t)
            result.tokens[i] = toks or None
            if len(toks) < k:   # step len(toks)'s logits were unusable: it fails alone after
                result.failed[i] = True          # the tokens before it; its chain slots go back
                free.append(chain_slots[1:, i])
            else:
                result.kv_advance[i], result.last_slots[i] = k - 1, int(chain_slots[-1, i])
        result.free_slots = torch.cat(free) if free else None
        return result

    def extend_batch(self, plan: StepPlan) -> ForwardBatch:
        return ForwardBatch.build(plan.ids, plan.prefix_lens, [r.row for r in plan.reqs],
                                  torch.cat(plan.slots), self.res.device)

    def run_extend(self, plan: StepPlan, **forward_kw) -> tuple[StepResult, object, ForwardBatch]:
        """The target forward over the plan, then sampling: (StepResult, the forward's
        output, its batch); the speculative prefill goes on from the last two."""
        batch = self.extend_batch(plan)
        done = plan.sampling
        out = self.res.model.forward(batch, self.res.backend,
                                     logits_indices=batch.last_token_indices[done],
                                     **forward_kw)
        return self.sample(plan, done, out.logits), out, batch

    @staticmethod
    def sample(plan: StepPlan, done: list[int], logits: torch.Tensor) -> StepResult:
        """The step's result: a token for each request of `done` (logits: (len(done), V))."""
        result = StepResult.empty(len(plan.reqs))
        if done:   # else every request of the batch is mid-prefill
            tokens, lps = sample_requests(logits, [plan.reqs[i] for i in done])
            for i, t, lp in zip(done, tokens, lps):
                result.failed[i] = t is None       # not a usable distribution: fails alone
                result.tokens[i] = None if t is None else [t]
                result.logprobs[i] = lp
        return result


class guarded:
    """On CUDA, the step's device-side index errors are read after its own sync and raised as
    KVIndexError; on CPU every guarded call raises at once anyway."""

    def __init__(self, device: torch.device):
        self.guard = kv_guard(device) if device.type == "cuda" else None
        self._ctx = self.guard.step() if self.guard else nullcontext()

    def __enter__(self):
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        suppressed = self._ctx.__exit__(*exc)
        if exc[0] is None and self.guard is not None:
            self.guard.raise_if_error()
        return suppressed
