"""The ownership checked mode (memory/ownership.py): off by default; on, a free of another
request's committed slot is refused with nothing freed, a request's own release goes
through, and switching it on mid-run changes no output."""

from __future__ import annotations

import pytest
import torch

from eaglekv import SamplingParams
from eaglekv.errors import AllocatorError
from eaglekv.kernels.store_cache import WRITE_CHECKS
from helpers import tiny_engine

SP = SamplingParams(max_new_tokens=10, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], list(range(20, 40))]


def test_off_by_default(tiny_dir):
    eng = tiny_engine(tiny_dir, max_running_requests=4)
    assert eng.owners is None and eng.allocator.owners is None and eng.kv_pool.owners is None
    assert eng.kv_pool._full.untyped_storage().data_ptr() not in WRITE_CHECKS


def test_free_of_a_foreign_slot_is_refused(tiny_dir):
    eng = tiny_engine(tiny_dir, max_running_requests=4)
    eng.check_ownership()
    a, b = (eng.add_request(p, SP) for p in PROMPTS[:2])
    for _ in range(3):
        eng.step()
    r2t = eng.req_to_token.req_to_token
    used = eng.allocator.num_used()
    slot_of_b = r2t[b.row, 0].to(torch.int64).view(1)
    with pytest.raises(AllocatorError, match=f"committed to request row {b.row}"):
        eng.allocator.free(slot_of_b)                     # a stray free, not b's release
    assert eng.allocator.num_used() == used
    mixed = torch.cat([r2t[a.row, :a.kv_len].to(torch.int64), slot_of_b])
    with pytest.raises(AllocatorError, match="ownership"):
        eng.allocator.free(mixed)                         # a's release plus one of b's
    assert eng.allocator.num_used() == used
    eng.abort(a)                                          # a's own release goes through
    eng.check_memory()
    while eng.has_unfinished():
        eng.step()
        eng.check_memory()
    assert eng.allocator.is_full()


@pytest.mark.parametrize("opts", [{}, {"speculative": dict(algorithm="eagle", draft_model="random",
                                                           num_steps=3, topk=2,
                                                           num_draft_tokens=5), "page_size": 4}])
def test_switched_on_mid_run_changes_nothing(tiny_dir, opts):
    ref = [o.token_ids for o in tiny_engine(tiny_dir, max_running_requests=4).generate(
        PROMPTS, SP)]
    eng = tiny_engine(tiny_dir, max_running_requests=4, **opts)
    reqs = [eng.add_request(p, SP) for p in PROMPTS]
    for _ in range(3):
        eng.step()
    eng.check_ownership()
    while eng.has_unfinished():
        eng.step()
        eng.check_memory()
    assert [r.output_ids for r in reqs] == ref
    eng.check_ownership(False)
    assert eng.owners is None and eng.kv_pool.owners is None
