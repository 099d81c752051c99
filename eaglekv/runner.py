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


class ModelRunner:
    """Plain decoding: one target forward over the plan's extends, then the shared
    penalise -> sample -> logprobs block for the requests whose prompt is complete."""

    separate_decode = False        # a decode is an extend by one token

    def __init__(self, res: RunnerResources):
        self.res = res

    def step_pages(self, kv_len: int) -> int:
        """Pages a running request may take in its next step: one token, at most one page."""
        return 1

    def window_pages(self, kv_len: int) -> int:
        """Pages past a request's last token that its last step may hold: none."""
        return 0

    def run(self, plan: StepPlan) -> StepResult:
        with guarded(self.res.device):
            return self.run_extend(plan)[0]

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
        result = StepResult.empty(len(plan.reqs))
        if done:   # else every request of the batch is mid-prefill
            tokens, lps = sample_requests(out.logits, [plan.reqs[i] for i in done])
            for i, t, lp in zip(done, tokens, lps):
                result.failed[i] = t is None       # not a usable distribution: fails alone
                result.tokens[i] = None if t is None else [t]
                result.logprobs[i] = lp
        return result, out, batch


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
