"""KV slots of one EAGLE step: the draft's temporary slots and the verify window. The whole
geometry of a speculative step lives here: the req_to_token columns it needs past the
context (`extra_columns`), the kv_indices width (guard 2) and a request's peak pages.

Draft slots follow DESIGN.md "Draft KV indices": ps == 1 or K == 1, branch t's draft token s
sits at position L_b + t*S + s of the request's req_to_token row; ps > 1 with K > 1, every
branch owns page-aligned pages, branches t >= 1 starting with a copy of the prefix's partial
last page. They live only for the draft phase. The verify window takes N slots at positions
L_b .. L_b + N - 1; after acceptance the accepted ones stay, the rest go back:

    req_to_token[row_b]:  [ prefix (L_b) | v0 v1 ... v_{N-1} ]      verify window, node j at v_j
    after accept (a = 2): [ prefix (L_b) | v0 v1 v2 ] + v3.. freed   accepted K/V moved to
                          depth order first (move_kv: slot of depth j <- slot of path node j)

The kv_indices buffer is sized once, from the largest batch the config allows (guard 2:
`draft_kv_indices_buffer_width` raises if its int32 offsets could overflow).
"""

from __future__ import annotations

import torch

from eaglekv.kernels.draft_kv_indices import (assign_draft_cache_locs, check_draft_kv_indices_fit,
                                              draft_kv_indices_buffer_width,
                                              draft_kv_indices_used_len, draft_region_extra,
                                              generate_draft_decode_kv_indices)


def extra_columns(spec, page_size: int) -> int:
    """req_to_token columns past max_context_len for the draft regions and the verify window."""
    return max(draft_region_extra(spec.topk, spec.num_steps, page_size),
               spec.num_draft_tokens) + page_size + spec.num_steps


def kv_indices_width(spec, max_running_requests: int, max_context_len: int) -> int:
    """Guard 2, evaluated for the largest batch the config allows: every request at the
    longest context its draft can reach (max_context_len + num_steps)."""
    return draft_kv_indices_buffer_width(max_running_requests, spec.topk,
                                         max_context_len + spec.num_steps)


class DraftBatch:
    """The draft slots of one step and the per-step attention metadata over them."""

    def __init__(self, owner: "DraftSlots", slots: torch.Tensor, owned: list[torch.Tensor]):
        self.owner = owner
        self.slots = slots            # (B, K, S) int64 on the device: step i writes [:, :, i]
        self.owned = owned            # cpu slot tensors to free after drafting

    def decode_meta(self, step: int, kv_lens: tuple[int, ...] | None,
                    kv_len: torch.Tensor | None = None):
        o = self.owner
        return o.drafter.decode_metadata(step, o.kv_indptr[step], o.kv_indices[step], kv_lens,
                                         self.slots[:, :, step].reshape(-1), kv_len=kv_len)

    def reorder_kv(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.owner.drafter.kv_pool is not None:
            self.owner.drafter.kv_pool.move_kv(dst.reshape(-1), src.reshape(-1))


class DraftSlots:
    def __init__(self, res, drafter, spec):
        """`res`: the runner's RunnerResources (allocator, req_to_token, KV pool, sizes)."""
        self.res, self.drafter = res, drafter
        self.S, self.K, self.N = spec.num_steps, spec.topk, spec.num_draft_tokens
        self.ps = res.page_size
        R = res.max_running_requests
        width = kv_indices_width(spec, R, res.max_context_len)
        dev = res.device
        self.hold_both = False    # draft and verify slots held at once (a step graph)
        self.kv_indices = torch.zeros(self.S, width, dtype=torch.int32, device=dev)
        self.kv_indptr = torch.zeros(self.S, R * self.K + 1, dtype=torch.int32, device=dev)

    # ---- sizing ---------------------------------------------------------------------------------
    def _npp(self, L: int) -> int:
        """Pages per branch (ps > 1, K > 1): ceil((L % ps + S) / ps)."""
        return -(-(L % self.ps + self.S) // self.ps)

    def peak_pages(self, L: int) -> int:
        a = self.res.allocator
        S, K, ps = self.S, self.K, self.ps
        if ps == 1 or K == 1:
            draft = a.pages_needed(L, K * S)
        else:
            draft = a.pages_needed(L, S) + (K - 1) * self._npp(L)
        verify = a.pages_needed(L, self.N)
        return draft + verify if self.hold_both else max(draft, verify)

    # ---- draft phase ----------------------------------------------------------------------------
    def alloc_draft(self, reqs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Page size 1 or topk 1 (the step graph's case): (B, K, S) cpu draft write slots,
        request b's branch t at positions L_b + t*S + s, and the slots to free after the
        draft phase. Host work only: the step graph writes the tables itself."""
        alloc, S, K = self.res.allocator, self.S, self.K
        if self.ps == 1:
            slots = alloc.alloc_rows(len(reqs), K * S)                           # [t][s] order
            return slots.view(len(reqs), K, S), [slots.view(-1)]
        owned = [alloc.alloc(K * S, r.kv_len, r.last_slot) for r in reqs]
        return torch.stack(owned).view(len(reqs), K, S), owned

    def check_fit(self, seq_lens_sum: int, batch: int) -> None:
        """Guard 2 for one step: the draft kv lists of `batch` requests whose committed
        lengths sum to `seq_lens_sum` fit the kv_indices buffer (host ints, no sync)."""
        check_draft_kv_indices_fit(
            draft_kv_indices_used_len(seq_lens_sum, self.K, batch * self.K, self.S),
            self.kv_indices.shape[1])

    def write_draft_tables(self, rows: torch.Tensor, seq_lens: torch.Tensor,
                           slots: torch.Tensor, seq_lens_sum: int | None) -> None:
        """Device side of the draft phase (page size 1 or topk 1): the draft slots (B, K, S)
        into req_to_token, then the per-step kv lists; every slot the draft will read is
        checked here, before any K/V is written. `seq_lens_sum` None: summed from seq_lens
        (a host sync on CUDA; a step graph checks the fit on the host before its replay)."""
        res = self.res
        r2t = res.req_to_token.req_to_token
        assign_draft_cache_locs(r2t, rows, seq_lens, slots.reshape(-1), self.K, self.S,
                                self.ps, None)
        generate_draft_decode_kv_indices(r2t, rows, seq_lens, self.K, self.S, self.ps,
                                         self.kv_indices, self.kv_indptr,
                                         res.kv_pool.size_limit, seq_lens_sum=seq_lens_sum)

    def prepare_draft(self, reqs, rows: torch.Tensor, seq_lens: torch.Tensor) -> DraftBatch:
        res, S, K, ps = self.res, self.S, self.K, self.ps
        paged_tree = ps > 1 and K > 1
        if not paged_tree:
            slots, owned = self.alloc_draft(reqs)
            slots_dev = slots.to(res.device)
            self.write_draft_tables(rows, seq_lens, slots_dev,
                                    sum(r.kv_len for r in reqs))
            return DraftBatch(self, slots_dev, owned)
        alloc = res.allocator
        B = len(reqs)
        slots = torch.empty(B, K, S, dtype=torch.int64)                        # cpu
        owned, copy_src = [], []
        copy_locs = torch.zeros(B, K - 1, ps, dtype=torch.int64)
        for b, r in enumerate(reqs):
            L = r.kv_len
            s0 = alloc.alloc(S, L, r.last_slot)       # branch 0 continues the prefix's page
            slots[b, 0] = s0
            owned.append(s0)
            last = L % ps
            for t in range(1, K):
                pages = alloc.alloc(self._npp(L) * ps, 0)                       # fresh pages
                owned.append(pages)
                slots[b, t] = pages[last:last + S]
                copy_locs[b, t - 1, :last] = pages[:last]
            if last:
                copy_src.append((b, L - last, last))
        dev = res.device
        slots_dev = slots.to(dev)
        r2t = res.req_to_token.req_to_token
        assign_draft_cache_locs(r2t, rows, seq_lens, slots_dev.reshape(-1), K, S, ps,
                                copy_locs.to(dev))
        # every slot the draft will read is checked here, before any K/V is written
        generate_draft_decode_kv_indices(r2t, rows, seq_lens, K, S, ps, self.kv_indices,
                                         self.kv_indptr, res.kv_pool.size_limit,
                                         seq_lens_sum=sum(r.kv_len for r in reqs))
        pool = self.drafter.kv_pool
        if copy_src and pool is not None:
            # branches t >= 1 start with a copy of the prefix's partial last page
            dst, src = [], []
            for b, start, last in copy_src:
                prefix_slots = r2t[reqs[b].row, start:start + last].to(torch.int64)
                for t in range(K - 1):
                    dst.append(copy_locs[b, t, :last].to(dev))
                    src.append(prefix_slots)
            pool.move_kv(torch.cat(dst), torch.cat(src))
        return DraftBatch(self, slots_dev, owned)

    def release_draft(self, d: DraftBatch) -> None:
        self.res.allocator.free(torch.cat(d.owned))

    # ---- verify window --------------------------------------------------------------------------
    def alloc_verify_slots(self, reqs) -> torch.Tensor:
        """(B, N) cpu slots for positions L_b .. L_b + N - 1 (host work only)."""
        alloc, N = self.res.allocator, self.N
        if self.ps == 1:
            return alloc.alloc_rows(len(reqs), N)
        return torch.stack([alloc.alloc(N, r.kv_len, r.last_slot) for r in reqs])  # (B, N)

    def alloc_verify_chain(self, reqs, k: int) -> torch.Tensor:
        """Page size 1: (k, B, N) cpu slots, step j's verify window of each request (a chain
        of whole-step replays, `SpecStepGraphs.run_chain`), all or nothing."""
        B, N = len(reqs), self.N
        return self.res.allocator.alloc_rows(B, k * N).view(B, k, N).transpose(0, 1).contiguous()

    def write_verify_table(self, rows: torch.Tensor, seq_lens: torch.Tensor,
                           vslots: torch.Tensor) -> None:
        """req_to_token[row_b, L_b + j] = vslots[b, j] (device tensors; no host read). A
        padded graph row (row 0, req_to_token's padding row) writes the padding slot 0 only,
        whatever its slot buffer holds."""
        cols = seq_lens[:, None] + torch.arange(self.N, device=seq_lens.device)[None, :]
        vals = torch.where(rows[:, None] > 0, vslots, torch.zeros_like(vslots))
        self.res.req_to_token.req_to_token[rows[:, None], cols] = vals.to(torch.int32)

    def alloc_verify(self, reqs, rows: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """(B, N) cpu slots for positions L_b .. L_b + N - 1, written into req_to_token."""
        vslots = self.alloc_verify_slots(reqs)
        self.write_verify_table(rows, seq_lens, vslots.to(seq_lens.device))
        return vslots
