"""The engine: continuous batching of requests over one model on the paged KV cache.

One step, one direction: the scheduler plans it (engine/scheduler.py), a runner runs it on
the device (runner.py for plain decoding, speculative/eagle_worker.py for EAGLE), the
scheduler commits the result. A plain step extends each running request by its pending tokens
(a prompt chunk, or the last sampled token) in one forward: prefill and decode are the same
operation, "extend by n on a cached prefix".
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Hashable, Iterator, Sequence

import torch

from eaglekv.attention import TorchAttentionBackend
from eaglekv.config import EngineConfig, SamplingParams
from eaglekv.core import Output, SpecStats, StreamDelta
from eaglekv.engine.memory_plan import plan_kv_size
from eaglekv.engine.request import Req
from eaglekv.engine.scheduler import Scheduler
from eaglekv.errors import ConfigError, RequestError
from eaglekv.memory import KVPool, ReqToTokenPool, SlotAllocator
from eaglekv.model import LlamaForCausalLM
from eaglekv.model import cpu_blas
from eaglekv.model.llama import cpu_blas_threads, linear_weights
from eaglekv.model.loader import load_checkpoint
from eaglekv.runner import ModelRunner, RunnerResources
from eaglekv.speculative.factory import (build_runner, draft_bytes_per_slot,
                                        feature_bytes_per_slot, load_draft)
from eaglekv.speculative.slots import extra_columns, kv_indices_width

Prompt = str | Sequence[int]


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, drafter=None, **options):
        """`drafter` overrides the configured draft model (tests pass a scripted drafter)."""
        if config is None:
            config = EngineConfig.from_dict(options)
        elif options:
            raise ConfigError(f"pass either an EngineConfig or options, not both ({sorted(options)})")
        self.config = cfg = config
        self.device = torch.device(cfg.device)
        if self.device.type == "cpu" and cpu_blas_threads():  # see model/llama.py
            torch.set_num_threads(cpu_blas_threads())
        # 1. model and weights (fused, memory-mapped from the weight cache after the first load)
        ckpt = load_checkpoint(cfg.model, dtype=cfg.torch_dtype)
        self.load_times = ckpt.load_times      # stage -> seconds, for the CLI
        self.model_config = mc = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.max_context_len = cfg.max_context_len or mc.max_position_embeddings
        spec = cfg.speculative
        if drafter is not None and not spec.enabled:
            raise ConfigError("a drafter was passed but speculative.algorithm is 'none'")
        # every candidate shape fits (one for a fixed config; adaptive chooses among several)
        hull = spec.hull(self.device.type) if spec.enabled else None
        if spec.enabled:  # guard 2 before anything is allocated
            kv_indices_width(hull, cfg.max_running_requests, self.max_context_len)
        # verify positions reach L + num_steps, past the last committed one
        t0 = time.perf_counter()
        self.model = LlamaForCausalLM.from_fused(mc, ckpt.state_dict, self.device,
                                                 max_positions=self.max_context_len
                                                 + (hull.num_steps + 1 if spec.enabled else 0))
        del ckpt
        self.load_times["model build"] = time.perf_counter() - t0
        eos = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        # 2. the draft's checkpoint (its KV shares the slots, so it counts in the sizing)
        draft_ckpt = (load_draft(spec, mc, cfg.seed) if spec.enabled and drafter is None
                      else None)
        # 3. memory sizing, KV cache, request table
        size = plan_kv_size(cfg, mc, self.max_context_len,
                            draft_bytes_per_slot(draft_ckpt, cfg.torch_dtype)
                            + (feature_bytes_per_slot(spec, mc, cfg.torch_dtype)
                               if spec.enabled else 0),
                            reserved_bytes=self._prepack_bytes(spec, draft_ckpt))
        self.req_to_token = ReqToTokenPool(
            cfg.max_running_requests, self.max_context_len,
            extra=extra_columns(hull, cfg.page_size) if spec.enabled else 0, device=self.device)
        self.allocator = SlotAllocator(size, cfg.page_size)
        self.kv_pool = KVPool(size, cfg.page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim,
                              cfg.torch_dtype, self.device)
        # 4. attention backend, runner (plain, or the speculative family's), scheduler
        backend_cls = TorchAttentionBackend
        if cfg.triton_attention:   # imported only where it runs
            from eaglekv.attention.triton_backend import TritonAttentionBackend as backend_cls
        self.backend = backend_cls(self.kv_pool, self.req_to_token)
        res = RunnerResources(self.model, self.backend, self.kv_pool, self.allocator,
                              self.req_to_token, self.device, cfg.torch_dtype, cfg.page_size,
                              cfg.max_running_requests, self.max_context_len, mc.num_layers,
                              cuda_graph_max_bs=min(cfg.cuda_graph_max_bs
                                                    or cfg.max_running_requests,
                                                    cfg.max_running_requests)
                              if cfg.cuda_graphs else 0,
                              cuda_graph_prefill_tokens=min(cfg.prefill_graph_tokens,
                                                            self.max_context_len))
        self.runner = (build_runner(res, spec, draft_ckpt, drafter, cfg.decode_steps)
                       if spec.enabled
                       else ModelRunner(res, self._decode_graphs(res), cfg.decode_steps,
                                        self._prefill_graphs(res)))
        if self.device.type == "cpu" and spec.enabled:   # every verify multiplies 2+ rows
            t0 = time.perf_counter()
            drafter = getattr(self.runner, "drafter", None)
            if cpu_blas.prepack(linear_weights(self.model)
                                + linear_weights(getattr(drafter, "model", None))):
                self.load_times["weights prepacked"] = time.perf_counter() - t0
        self.scheduler = Scheduler(cfg, self.allocator, self.req_to_token, self.runner,
                                   self.device)
        self._rids = itertools.count()
        self._seeds = torch.Generator().manual_seed(cfg.seed)
        self.owners = None        # the ownership checked mode (check_ownership), off
        if os.environ.get("EAGLEKV_CHECK_OWNERSHIP") == "1":
            self.check_ownership()

    def _prepack_bytes(self, spec, draft_ckpt) -> int:
        """What the oneDNN copies of the weights will take (a CPU speculative engine makes
        them once its runner is built; cpu_blas.prepack): the target's linear weights and
        every 2-D tensor of the draft's checkpoint (an upper bound)."""
        if self.device.type != "cpu" or not spec.enabled or not cpu_blas.packs():
            return 0
        sd = getattr(draft_ckpt, "state_dict", None) or {}
        return sum(w.numel() * 4 for w in linear_weights(self.model)
                   + [t for t in sd.values() if isinstance(t, torch.Tensor) and t.dim() == 2])

    def _decode_graphs(self, res: RunnerResources):
        """The plain runner's captured decode steps (CUDA, unless disabled), else None."""
        if not res.cuda_graph_max_bs:
            return None
        from eaglekv.cuda_graph import DecodeGraphs
        return DecodeGraphs(self.model, self.backend, res.cuda_graph_max_bs,
                            self.max_context_len, chain_steps=self.config.decode_steps)

    def _prefill_graphs(self, res: RunnerResources):
        """The plain runner's captured one-request prefills (`cuda_graph_prefill_tokens`,
        CUDA graphs on), else None."""
        n = res.cuda_graph_prefill_tokens
        if not res.cuda_graph_max_bs or n < 2:
            return None
        from eaglekv.cuda_graph import PrefillGraphs
        return PrefillGraphs(self.model, self.backend, n, self.max_context_len)

    # the scheduler's books and the speculative runner, under their old names
    running = property(lambda self: self.scheduler.running)
    waiting = property(lambda self: self.scheduler.waiting)
    num_preemptions = property(lambda self: self.scheduler.num_preemptions)
    worker = property(lambda self: self.runner if self.runner.separate_decode else None)

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    group: Hashable = None) -> Req:
        """Queue a request. `group` names the call it came from (e.g. one HTTP request's n
        choices): admission gives each group a fair turn (fairness.py); default: its own."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        vocab = self.model_config.vocab_size
        if not ids:
            raise RequestError("empty prompt: at least one token is needed")
        if params.stop and self.tokenizer is None:
            raise RequestError(f"stop strings {params.stop} need a tokenizer; this model has none")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} outside the vocabulary [0, {vocab})")
        need = len(ids) + params.max_new_tokens
        if need > self.max_context_len:
            raise RequestError(f"prompt of {len(ids)} tokens + max_new_tokens="
                               f"{params.max_new_tokens} = {need} exceeds max_context_len="
                               f"{self.max_context_len}")
        # its tokens, and the draft and verify window of its last step when speculative
        pages = self.allocator.pages_needed(0, need - 1) + self.runner.window_pages(need - 1)
        if pages > self.allocator.num_pages:
            raise RequestError(f"request needs {need - 1} KV slots ({pages} pages) but the KV "
                               f"pool holds {self.allocator.size} slots; raise max_total_tokens")
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seeds))
        gen = torch.Generator(device=self.device).manual_seed(seed)
        rid = next(self._rids)
        req = Req(rid=rid, prompt_ids=ids, params=params, generator=gen,
                  eos_ids=self.eos_ids, tokenizer=self.tokenizer,
                  group=("rid", rid) if group is None else group,
                  spec_stats=SpecStats(accept_histogram={}) if self.worker else None)
        self.scheduler.add(req)
        return req

    def abort(self, req: Req) -> None:
        """Stop a request between steps (a client went away) and free its KV and row."""
        self.scheduler.abort(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def spec_stats(self):
        """Engine-wide speculation counters (None without speculation)."""
        return None if self.worker is None else self.worker.stats

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Plan, run, commit; returns the step's requests. An error inside the runner (a
        KVIndexError, or anything else) fails only them: their KV and rows are freed, the
        slots the step took included, and the error is raised; the engine keeps serving."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.reqs:
            return []
        try:
            if self.owners is not None:   # checked mode: rows hold only their own slots
                self.owners.begin_step(self.running, plan)
            result = self.runner.run(plan)
        except Exception:
            if self.owners is not None:   # a release then frees only the request's own
                self.owners.scrub(plan.reqs)
            self.scheduler.fail(plan)
            raise
        done = self.scheduler.commit(plan, result)
        step_done = getattr(self.runner, "step_done", None)
        if step_done is not None:      # adaptive speculation costs the whole step
            step_done(time.perf_counter() - t0)
        return done

    # ---- public API ----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Output]:
        """Run the prompts to the end. A request that fails alone (RequestFailed: its sampling
        distribution was not finite) is raised once every other one has finished; to keep the
        others' outputs, drive add_request / step and read each `req.error`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while any(not r.finished for r in reqs):
            self.step()
        failed = [r for r in reqs if r.error is not None]
        if failed:
            raise failed[0].error
        return [r.to_output() for r in reqs]

    def apply_chat_template(self, conversation: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(self, conversations, params=None) -> list[Output]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.apply_chat_template(c) for c in conversations], params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        req = self.add_request(prompt, params)
        while not req.finished:
            self.step()
            if req.error is not None:
                raise req.error
            delta = req.stream_delta()
            if delta is not None:
                yield delta

    def check_ownership(self, on: bool = True) -> None:
        """The ownership checked mode (memory/ownership.py; EAGLEKV_CHECK_OWNERSHIP=1 at
        start): a step may write, move and free only slots handed out to it or committed to
        its own requests, else KVOwnershipError (a KVIndexError: the step fails alone).
        For tests and debugging; switch it between steps."""
        from eaglekv.memory.ownership import attach, kv_pools
        self.owners = attach(self.allocator, self.req_to_token,
                             kv_pools([self.kv_pool, self.runner]), self.kv_pool,
                             lenient_drafts=self.config.speculative.adaptive, on=on)

    def check_memory(self) -> None:
        """Raise unless the books balance (between steps): every slot in use is referenced by
        exactly one running request's req_to_token row, every referenced slot is in use; with
        no request left, everything must be free."""
        self.allocator.check_integrity()
        self.req_to_token.check_integrity()
        rows = [self.req_to_token.req_to_token[r.row, :r.kv_len] for r in self.running
                if r.kv_len]
        ref = (torch.cat(rows).to("cpu", torch.int64) if rows
               else torch.zeros(0, dtype=torch.int64))
        uniq, counts = ref.unique(return_counts=True)
        if (counts > 1).any():
            raise AssertionError(f"slot {int(uniq[counts > 1][0])} is in the req_to_token rows "
                                 f"of two requests (or twice in one)")
        used = self.allocator.used_slots()
        if not torch.equal(uniq, used):
            orphan = used[~torch.isin(used, uniq)]
            free = uniq[~torch.isin(uniq, used)]
            raise AssertionError(f"req_to_token and the allocator disagree: {orphan.numel()} "
                                 f"slots in use by no request {orphan[:5].tolist()}, "
                                 f"{free.numel()} referenced but free {free[:5].tolist()}")
        if not self.has_unfinished() and not self.allocator.is_full():
            raise AssertionError(f"KV leak: {self.allocator.num_used()} slots still in use "
                                 f"with no request left")
