"""The engine: continuous batching of requests over one model on the paged KV cache.

Every step extends each running request by its pending tokens (a whole prompt for a new
request, the last sampled token otherwise) in one forward, so prefill and decode are the
same operation: "extend by n on a cached prefix".
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from collections import Counter, deque
from collections.abc import Hashable, Iterator, Sequence

import torch

from eaglekv.attention import TorchAttentionBackend
from eaglekv.config import EngineConfig, SamplingParams
from eaglekv.core import ForwardBatch, Output, SpecStats, StreamDelta
from eaglekv.engine.fairness import next_to_admit, prefill_shares
from eaglekv.engine.memory_plan import plan_kv_size
from eaglekv.engine.request import Req
from eaglekv.sampling import apply_penalties, batch_logprobs, sample_next
from eaglekv.kernels.guard import kv_guard
from eaglekv.errors import ConfigError, KVIndexError, OutOfKVMemoryError, RequestError
from eaglekv.memory import KVPool, ReqToTokenPool, SlotAllocator
from eaglekv.model import LlamaForCausalLM
from eaglekv.model.llama import cpu_blas_threads
from eaglekv.model.loader import load_checkpoint
from eaglekv.speculative.slots import kv_indices_width
from eaglekv.speculative.factory import build_worker, draft_bytes_per_slot, extra_columns, load_draft

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
        # 1. model and weights
        ckpt = load_checkpoint(cfg.model)
        self.model_config = mc = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.max_context_len = cfg.max_context_len or mc.max_position_embeddings
        spec = cfg.speculative
        if drafter is not None and not spec.enabled:
            raise ConfigError("a drafter was passed but speculative.algorithm is 'none'")
        if spec.enabled:  # guard 2 before anything is allocated
            kv_indices_width(spec, cfg.max_running_requests, self.max_context_len)
        # verify positions reach L + num_steps, past the last committed one
        self.model = LlamaForCausalLM(mc, ckpt.state_dict, cfg.torch_dtype, self.device,
                                      max_positions=self.max_context_len
                                      + (spec.num_steps + 1 if spec.enabled else 0))
        del ckpt
        eos = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        # 2. the draft's checkpoint (its KV shares the slots, so it counts in the sizing)
        draft_ckpt = (load_draft(spec, mc, cfg.seed) if spec.enabled and drafter is None
                      else None)
        # 3. memory sizing, KV cache, request table
        size = plan_kv_size(cfg, mc, self.max_context_len,
                            draft_bytes_per_slot(draft_ckpt, cfg.torch_dtype))
        self.req_to_token = ReqToTokenPool(
            cfg.max_running_requests, self.max_context_len,
            extra=extra_columns(spec, cfg.page_size) if spec.enabled else 0, device=self.device)
        self.allocator = SlotAllocator(size, cfg.page_size)
        self.kv_pool = KVPool(size, cfg.page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim,
                              cfg.torch_dtype, self.device)
        # 4. attention backend, speculative worker
        self.backend = TorchAttentionBackend(self.kv_pool, self.req_to_token)
        self.worker = build_worker(self, spec, draft_ckpt, drafter) if spec.enabled else None
        # 5. scheduler state
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._rids = itertools.count()
        self._seeds = torch.Generator().manual_seed(cfg.seed)
        self.num_preemptions = 0

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
        pages = self.allocator.pages_needed(0, need - 1)
        if self.worker is not None:  # the draft and verify window of the last step
            pages += self.worker.pages_needed_at(need - 1)
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
        self.waiting.append(req)
        return req

    def abort(self, req: Req) -> None:
        """Stop a request between steps (a client went away) and free its KV and row."""
        if req.finished:
            return
        req.finish_reason = "abort"
        if req in self.waiting:
            self.waiting.remove(req)
            self._release(req)     # a preempted request holds nothing; a fresh one neither
        elif req in self.running:
            self._finish(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ----------------------------------------------------------------------------
    def _admit(self) -> None:
        """Fill free rows from `waiting` in the fairness order (fairness.py); stop at the first
        request chosen that does not fit in the KV pool beside the running ones' next steps."""
        ps = self.config.page_size
        per_group = Counter(r.group for r in self.running)
        while self.waiting and self.req_to_token.free_rows:
            i = next_to_admit(self.waiting, per_group)
            req = self.waiting[i]
            need = self.allocator.pages_needed(0, len(req.pending_ids)) * ps
            # room for each running request's next step: one token, or a speculative step
            headroom = ps * sum(self._step_pages(r) for r in self.running)
            if self.running and self.allocator.available_slots() < need + headroom:
                return
            del self.waiting[i]
            req.preempted = False
            req.row = self.req_to_token.alloc()
            self.running.append(req)
            per_group[req.group] += 1

    def _step_pages(self, req: Req) -> int:
        return 1 if self.worker is None else self.worker.pages_needed(req)

    def spec_stats(self):
        """Engine-wide speculation counters (None without speculation)."""
        return None if self.worker is None else self.worker.stats

    def _release(self, req: Req, after_error: bool = False) -> None:
        req.draft_state = None
        if req.kv_len:
            slots = self.req_to_token.req_to_token[req.row, :req.kv_len].to(torch.int64)
            if after_error:  # a corrupted entry was never handed out: free only real slots
                lo, hi = self.config.page_size, self.allocator.size + self.config.page_size
                slots = slots[(slots >= lo) & (slots < hi)]
            self.allocator.free(slots)
        if req.row:
            self.req_to_token.free(req.row)
        req.row, req.kv_len, req.last_slot = 0, 0, -1

    def _preempt(self, victim: Req) -> None:
        """Free a request's KV and queue it first; it is recomputed when it comes back."""
        self._release(victim)
        self.running.remove(victim)
        victim.preempted = True
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def _alloc_extend(self, req: Req, n: int) -> torch.Tensor:
        while True:
            try:
                return self.allocator.alloc(n, req.kv_len, req.last_slot)
            except OutOfKVMemoryError:
                victims = [r for r in self.running if r is not req]
                if not victims:
                    raise
                self._preempt(victims[-1])

    # ---- one step ------------------------------------------------------------------------------
    def _chunk(self, reqs: list[Req]) -> list[tuple[Req, int]]:
        """How many of its pending tokens each request extends by this step. Chunked prefill:
        every decode (one pending token) goes in, then the prefills share what is left of
        `chunked_prefill_size` tokens max-min fairly (fairness.prefill_shares); a prompt
        longer than its share is prefilled over several steps, the decodes keep running."""
        limit = self.config.chunked_prefill_size
        pending = [len(r.pending_ids) for r in reqs]
        if limit is None:
            return list(zip(reqs, pending))
        prefills = [i for i, n in enumerate(pending) if n > 1]
        shares = prefill_shares([pending[i] for i in prefills],
                                limit - (len(reqs) - len(prefills)))
        for i, n in zip(prefills, shares):
            pending[i] = n
        return [(r, n) for r, n in zip(reqs, pending) if n]

    def _plan_extend(self, takes: list[tuple[Req, int]]
                     ) -> list[tuple[Req, list[int], int, torch.Tensor]]:
        """Slots for each request's next `n` pending tokens, written into req_to_token; returns
        (req, ids, prefix, slots) for those still running (allocation may preempt). A request
        has all its tokens in the cache (and samples) when `req.kv_len == len(req.all_ids)`."""
        planned = []
        for req, n in takes:
            if req not in self.running:  # preempted to make room for an earlier one
                continue
            ids, prefix = req.pending_ids[:n], req.kv_len
            s = self._alloc_extend(req, len(ids))
            self.req_to_token.req_to_token[req.row, prefix:prefix + len(ids)] = s.to(
                self.device, torch.int32)
            req.kv_len, req.last_slot = prefix + len(ids), int(s[-1])  # owned from here on
            planned.append((req, ids, prefix, s))
        return [p for p in planned if p[0] in self.running]

    def _run_guarded(self, reqs: list[Req], fn) -> None:
        """Run one step's work; a KV index error fails only these requests, then re-raises.
        On CUDA the device-side error buffer is read after the step's own sync."""
        guard = kv_guard(self.device) if self.device.type == "cuda" else None
        try:
            with guard.step() if guard else nullcontext():
                fn()
            if guard:
                guard.raise_if_error()
        except KVIndexError:
            for r in reqs:  # only this batch fails; the engine keeps serving
                r.finish_reason = "error"
                self._finish(r, after_error=True)
            self._reclaim_orphans()
            raise
        for r in reqs:
            if r.finished and r in self.running:
                self._finish(r)

    def step(self) -> list[Req]:
        """Admit, extend every running request in one forward, sample; returns those requests."""
        self._admit()
        if self.worker is not None:
            return self.worker.step()
        planned = self._plan_extend(self._chunk(list(self.running)))
        if not planned:
            return []
        batch_reqs = [p[0] for p in planned]
        batch = ForwardBatch.build([p[1] for p in planned], [p[2] for p in planned],
                                   [r.row for r in batch_reqs], torch.cat([p[3] for p in planned]),
                                   self.device)
        done = [i for i, r in enumerate(batch_reqs) if r.kv_len == len(r.all_ids)]

        def run():
            out = self.model.forward(batch, self.backend,
                                     logits_indices=batch.last_token_indices[done])
            if not done:   # every request of the batch is mid-prefill
                return
            reqs = [batch_reqs[i] for i in done]
            params = [r.params for r in reqs]
            logits = apply_penalties(out.logits, params, [r.output_ids for r in reqs],
                                     [r.all_ids for r in reqs])
            tokens = sample_next(logits, params,
                                 [r.generator for r in reqs])        # the step's host sync
            for r, t, lp in zip(reqs, tokens, batch_logprobs(out.logits, tokens, params)):
                if t is None:     # not a usable distribution: it fails alone, freed below
                    r.fail_sampling()
                else:
                    r.append_tokens([t], lp)
        self._run_guarded(batch_reqs, run)
        return batch_reqs

    def _reclaim_orphans(self) -> None:
        """After a corrupted batch: free every slot in use that no live request references
        (a slot whose req_to_token entry was overwritten would otherwise leak)."""
        used = self.allocator.used_slots()
        live = [self.req_to_token.req_to_token[r.row, :r.kv_len].to(torch.int64).cpu()
                for r in self.running]
        referenced = torch.cat(live) if live else used[:0]
        orphans = used[~torch.isin(used, referenced)]
        self.allocator.free(orphans)

    def _finish(self, req: Req, after_error: bool = False) -> None:
        self._release(req, after_error)
        if req in self.running:
            self.running.remove(req)

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

    def check_memory(self) -> None:
        """Raise unless the books balance; with no request left, everything must be free."""
        self.allocator.check_integrity()
        self.req_to_token.check_integrity()
        if not self.has_unfinished() and not self.allocator.is_full():
            raise AssertionError(f"KV leak: {self.allocator.num_used()} slots still in use "
                                 f"with no request left")
