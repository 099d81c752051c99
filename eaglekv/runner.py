"""The plain runner: "run this batch on the device". `ModelRunner.run(plan) -> StepResult`
is the one entry point the engine calls (SGLang's `forward_batch_generation`); the
speculative runner (speculative/eagle_worker.py) has the same signature and holds a
ModelRunner for its target. A runner never calls back into the scheduler or the engine: what
it needs is in `RunnerResources`, handed to it at construction, and what it decided goes back
in the StepResult, which the scheduler commits.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

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


class ModelRunner:
    """Plain decoding: one target forward over the plan's extends, then the shared
    penalise -> sample -> logprobs block for the requests whose prompt is complete."""

    separate_decode = False        # a decode is an extend by one token

    def __init__(self, res: RunnerResources, graphs=None):
        """`graphs`: captured decode forwards (cuda_graph.DecodeGraphs), replayed for every
        step whose requests all extend by one token; None runs every step eagerly."""
        self.res = res
        self.graphs = graphs

    def step_pages(self, kv_len: int) -> int:
        """Pages a running request may take in its next step: one token, at most one page."""
        return 1

    def window_pages(self, kv_len: int) -> int:
        """Pages past a request's last token that its last step may hold: none."""
        return 0

    def run(self, plan: StepPlan) -> StepResult:
        with guarded(self.res.device):
            if self.graphs is not None and self.graph_fits(plan):
                return self.run_graph(plan)
            return self.run_extend(plan)[0]

    def graph_fits(self, plan: StepPlan) -> bool:
        return (self.graphs.bucket(len(plan.reqs)) is not None
                and all(len(x) == 1 for x in plan.ids))

    def run_graph(self, plan: StepPlan, done: list[int] | None = None) -> StepResult:
        """A decode step (one token per request) as one replay of the captured forward; the
        requests of `done` sample (default: `plan.sampling`)."""
        slots = torch.cat(plan.slots).numpy()
        logits, greedy = self.graphs.replay([x[0] for x in plan.ids], plan.prefix_lens,
                                            [r.row for r in plan.reqs], slots)
        done = plan.sampling if done is None else done
        if len(done) == len(plan.reqs) and all(
                r.params.greedy and not r.params.has_penalties and r.params.logprobs is None
                for r in plan.reqs):   # picked inside the graph: the step's sync reads them
            result = StepResult.empty(len(plan.reqs))
            for i, (t, ok) in enumerate(greedy.tolist()):
                result.failed[i] = not ok
                result.tokens[i] = [t] if ok else None
            return result
        return self.sample(plan, done, logits if len(done) == len(plan.reqs) else logits[done])

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
