"""The scheduler: admission, chunked prefill, KV reservation and preemption, one StepPlan per
step, and the commit of the runner's StepResult. It never runs a model; the step geometry
(how many pages a request's next step may take) comes from the runner.

    schedule():  admit (fairness.next_to_admit) -> plain: extend every running request by its
                 share of the step (fairness.prefill_shares), slots allocated here;
                 speculative: a prefill (chunk) step for the requests the runner cannot decode
                 yet, alternating with decode steps for the others, whose pages are reserved
                 here (the newest preempted until they fit)
    commit():    free what the runner handed back, advance kv_len, append tokens (stop rules
                 fire), count spec stats, fail or finish requests and free their KV
"""

from __future__ import annotations

from collections import Counter, deque

import torch

from eaglekv.core import StepPlan, StepResult
from eaglekv.engine.fairness import next_to_admit, prefill_shares
from eaglekv.engine.request import Req
from eaglekv.errors import OutOfKVMemoryError


class Scheduler:
    def __init__(self, config, allocator, req_to_token, runner, device):
        self.config, self.allocator, self.req_to_token = config, allocator, req_to_token
        self.runner, self.device = runner, device
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_preemptions = 0
        self._prefilled_last = False   # speculative: the last step was a prefill
        self._held = 0                 # steps newcomers were held back (waiting_served_ratio)

    # ---- requests ------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, req: Req) -> None:
        """Stop a request between steps (a client went away) and free its KV and row."""
        if req.finished:
            return
        req.finish_reason = "abort"
        if req in self.waiting:
            self.waiting.remove(req)
            self.release(req)     # a preempted request holds nothing; a fresh one neither
        elif req in self.running:
            self.finish(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._admit()
        if not self.runner.separate_decode:
            return self._plan_extend(self._chunk(list(self.running)))
        can = self.runner.can_decode
        ready = [r for r in self.running if can(r)]
        if len(ready) < len(self.running) and not (ready and self._prefilled_last):
            self._prefilled_last = True    # prefill and decode steps alternate
            return self._plan_extend(self._chunk([r for r in self.running if not can(r)]))
        self._prefilled_last = False
        if self._reserve():                # preempted some: the ready list changed
            ready = [r for r in self.running if can(r)]
        return StepPlan("decode", ready)

    def commit(self, plan: StepPlan, result: StepResult) -> list[Req]:
        if result.free_slots is not None and result.free_slots.numel():
            self.allocator.free(result.free_slots)
        for i, r in enumerate(plan.reqs):
            if result.failed[i]:            # its distribution was unusable: it fails alone,
                if result.tokens[i]:        # after the tokens it made before (a decode chain)
                    r.append_tokens(result.tokens[i])
                if not r.finished:
                    r.fail_sampling()
                continue
            if result.kv_advance is not None:
                r.kv_len += result.kv_advance[i]
                r.last_slot = result.last_slots[i]
            kept = 0
            if result.tokens[i] is not None:
                kept = r.append_tokens(result.tokens[i], result.logprobs[i])
            if result.accepted is not None and result.accepted[i] is not None:
                dt = result.draft_tokens
                dt = dt[i] if isinstance(dt, list) else dt
                acc = result.accepted[i]
                if isinstance(acc, list):   # a chain of steps: those whose tokens were kept
                    start = 0
                    for a in acc:
                        if start >= kept:
                            break
                        self._count(r, a, dt)
                        start += a + 1
                else:
                    self._count(r, acc, dt)
        for r in plan.reqs:
            if r.finished and r in self.running:
                self.finish(r)
        return plan.reqs

    def fail(self, plan: StepPlan) -> None:
        """The step hit a KVIndexError: only its requests fail; the engine keeps serving."""
        for r in plan.reqs:
            r.finish_reason = "error"
            self.finish(r, after_error=True)
        self._reclaim_orphans()

    @staticmethod
    def _count(req: Req, accepted: int, draft_tokens: int) -> None:
        st = req.spec_stats
        st.verify_steps += 1
        st.draft_tokens += draft_tokens
        st.accepted_tokens += accepted
        st.accept_histogram[accepted + 1] = st.accept_histogram.get(accepted + 1, 0) + 1

    # ---- admission ------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Fill free rows from `waiting` in the fairness order (fairness.py); stop at the first
        request chosen that does not fit in the KV pool beside the running ones' next steps."""
        if not self.waiting or not self._admit_now():
            return
        ps = self.config.page_size
        per_group = Counter(r.group for r in self.running)
        while self.waiting and self.req_to_token.free_rows:
            i = next_to_admit(self.waiting, per_group)
            req = self.waiting[i]
            need = self.allocator.pages_needed(0, req.num_pending) * ps
            # room for each running request's next step: one token, or a speculative step
            headroom = ps * sum(self.runner.step_pages(r.kv_len) for r in self.running)
            if self.running and self.allocator.available_slots() < need + headroom:
                return
            del self.waiting[i]
            req.preempted = False
            req.row = self.req_to_token.alloc()
            self.running.append(req)
            per_group[req.group] += 1

    def _admit_now(self) -> bool:
        """TGI's admission rule (`waiting_served_ratio`, `max_waiting_steps`): while requests
        are running, the waiting ones are admitted once they are at least the ratio of the
        running ones or the oldest has been held `max_waiting_steps` steps, so that they are
        prefilled in one step rather than one prefill step each. Ratio 0: at once."""
        ratio = self.config.waiting_served_ratio
        if ratio <= 0 or not self.running:
            self._held = 0
            return True
        if (len(self.waiting) >= ratio * len(self.running)
                or self._held >= self.config.max_waiting_steps):
            self._held = 0
            return True
        self._held += 1
        return False

    # ---- extend plans ---------------------------------------------------------------------------
    def _chunk(self, reqs: list[Req]) -> list[tuple[Req, int]]:
        """How many of its pending tokens each request extends by this step. Chunked prefill:
        every decode (one pending token) goes in, then the prefills share what is left of
        `chunked_prefill_size` tokens max-min fairly (fairness.prefill_shares); a prompt
        longer than its share is prefilled over several steps, the decodes keep running."""
        limit = self.config.chunked_prefill_size
        pending = [r.num_pending for r in reqs]
        if limit is None:
            return list(zip(reqs, pending))
        prefills = [i for i, n in enumerate(pending) if n > 1]
        shares = prefill_shares([pending[i] for i in prefills],
                                limit - (len(reqs) - len(prefills)))
        for i, n in zip(prefills, shares):
            pending[i] = n
        return [(r, n) for r, n in zip(reqs, pending) if n]

    def _plan_extend(self, takes: list[tuple[Req, int]]) -> StepPlan:
        """Slots for each request's next `n` pending tokens, written into req_to_token; the
        plan holds those still running (allocation may preempt). A request has all its
        tokens in the cache (and samples) when `req.kv_len == req.num_ids`."""
        decode = self._plan_decodes([req for req, n in takes if n == 1])
        planned = []
        for req, n in takes:
            if id(req) in decode:    # one token: its slot taken and written with the others
                planned.append((req, *decode[id(req)]))
                continue
            if not any(r is req for r in self.running):  # preempted for an earlier one
                continue
            ids, prefix = req.pending_ids[:n], req.kv_len
            s = self._alloc_extend(req, len(ids))
            self.req_to_token.req_to_token[req.row, prefix:prefix + len(ids)] = s.to(
                self.device, torch.int32)
            req.kv_len, req.last_slot = prefix + len(ids), int(s[-1])  # owned from here on
            planned.append((req, ids, prefix, s))
        running = {id(r) for r in self.running}    # identity: a Req compares by value
        planned = [p for p in planned if id(p[0]) in running]
        return StepPlan("extend", [p[0] for p in planned], ids=[p[1] for p in planned],
                        prefix_lens=[p[2] for p in planned], slots=[p[3] for p in planned])

    def _plan_decodes(self, reqs: list[Req]) -> dict[int, tuple[list[int], int, torch.Tensor]]:
        """The requests that extend by one token, in one go: a slot each (one allocator call)
        and their req_to_token entries (one write), {id(req): (ids, prefix, slot [1])}. Empty
        when they do not all fit: the per-request path then allocates, preempting as needed."""
        if len(reqs) < 2:
            return {}
        try:
            slots = self.allocator.alloc_decode([r.kv_len for r in reqs],
                                                [r.last_slot for r in reqs])
        except OutOfKVMemoryError:
            return {}
        rows = torch.tensor([[r.row, r.kv_len] for r in reqs], dtype=torch.int64)  # (n, 2)
        where = torch.cat([rows, slots[:, None]], 1).to(self.device)               # one copy
        self.req_to_token.req_to_token[where[:, 0], where[:, 1]] = where[:, 2].to(torch.int32)
        out = {}
        for r, s in zip(reqs, slots.view(-1, 1)):
            out[id(r)] = (r.pending_ids[:1], r.kv_len, s)
            r.kv_len, r.last_slot = r.kv_len + 1, int(s)       # owned from here on
        return out

    def _alloc_extend(self, req: Req, n: int) -> torch.Tensor:
        while True:
            try:
                return self.allocator.alloc(n, req.kv_len, req.last_slot)
            except OutOfKVMemoryError:
                victims = [r for r in self.running if r is not req]
                if not victims:
                    raise
                self.preempt(victims[-1])

    def _reserve(self) -> bool:
        """Make sure every running request's decode step fits: preempt the newest until the
        free pages cover the sum of their peaks, so no allocation inside the step can fail.
        -> whether it preempted any."""
        preempted = False
        uniform = getattr(self.runner, "uniform_step_pages", None)
        each = uniform() if uniform is not None else None   # the same for every length
        while len(self.running) > 1 and ((each * len(self.running) if each is not None else
                                          sum(self.runner.step_pages(r.kv_len)
                                              for r in self.running))
                                         > self.allocator.free_pages):
            self.preempt(self.running[-1])
            preempted = True
        return preempted

    # ---- freeing ---------------------------------------------------------------------------------
    def release(self, req: Req, after_error: bool = False) -> None:
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

    def preempt(self, victim: Req) -> None:
        """Free a request's KV and queue it first; it is recomputed when it comes back."""
        self.release(victim)
        self.running.remove(victim)
        victim.preempted = True
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def finish(self, req: Req, after_error: bool = False) -> None:
        self.release(req, after_error)
        if req in self.running:
            self.running.remove(req)

    def _reclaim_orphans(self) -> None:
        """After a corrupted batch: free every slot in use that no live request references
        (a slot whose req_to_token entry was overwritten would otherwise leak)."""
        used = self.allocator.used_slots()
        live = [self.req_to_token.req_to_token[r.row, :r.kv_len].to(torch.int64).cpu()
                for r in self.running]
        referenced = torch.cat(live) if live else used[:0]
        orphans = used[~torch.isin(used, referenced)]
        self.allocator.free(orphans)
