"""Scheduler fuzzing (issue 16, hypothesis): random arrivals, prompt lengths, budgets, stop
ids, sampling and cancellations (abort, queued or running) on small KV pools (so the engine
preempts and recomputes; a request larger than the pool is refused with RequestError), plain
and EAGLE (chain, tree, multi-layer), page sizes 1 and 4, prefill whole or chunked. The
ownership checked mode is on. After every step the allocator's and the row pool's books
balance and agree with the requests' req_to_token rows (`Engine.check_memory`), and no step
writes, moves or frees a slot it does not own; every request ends (length, stop or abort) in
a bounded number of steps, and then every slot and row is free again."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaglekv import SamplingParams
from eaglekv.errors import RequestError
from helpers import spec, tiny_engine

EXAMPLES = 100
counts = {"cases": 0, "requests": 0, "refused": 0, "aborted": 0, "stopped": 0, "steps": 0,
          "preemptions": 0}

requests = st.lists(st.fixed_dictionaries({
    "arrival": st.integers(0, 10),
    "prompt": st.lists(st.integers(0, 255), min_size=1, max_size=40),
    "max_new": st.integers(1, 24),
    "stop": st.lists(st.integers(0, 255), max_size=12),     # stop ids: some hit, most not
    "abort_at": st.none() | st.integers(0, 30),
    "sampled": st.booleans(),
}), min_size=1, max_size=8)

engine_kinds = st.fixed_dictionaries({
    "spec": st.sampled_from([None, spec("eagle", 3, 1, 4), spec("eagle", 2, 2, 4),
                             spec("multi_layer_eagle", 2)]),
    "page_size": st.sampled_from([1, 4]),
    "max_running_requests": st.sampled_from([2, 3, 4]),
    "chunked_prefill_size": st.sampled_from([None, 3, 16]),
    "max_total_tokens": st.sampled_from([48, 64, 64, 128]),   # small: preemption
})

_engines: dict = {}


def engine_for(tiny_dir, kind: dict):
    """One engine per configuration, reused across examples: each example leaves it empty,
    so a leak or a stale book from an earlier example shows up in a later one."""
    key = repr(sorted(kind.items()))
    if key not in _engines:
        opts = {k: v for k, v in kind.items() if k != "spec"}
        if kind["spec"] is not None:
            opts["speculative"] = kind["spec"]
        eng = tiny_engine(tiny_dir, **opts)
        eng.check_ownership()
        _engines[key] = eng
    return _engines[key]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kind=engine_kinds, planned=requests)
def test_random_schedule_keeps_the_books(tiny_dir, kind, planned):
    eng = engine_for(tiny_dir, kind)
    preempted0 = eng.num_preemptions
    reqs = {}
    step = 0
    while step <= 10 or eng.has_unfinished():
        for i, p in enumerate(planned):
            if p["arrival"] == step:
                params = SamplingParams(max_new_tokens=p["max_new"], ignore_eos=True,
                                        stop_token_ids=tuple(p["stop"]),
                                        temperature=0.9 if p["sampled"] else 0.0, seed=i)
                try:
                    reqs[i] = eng.add_request(p["prompt"], params)
                except RequestError as e:      # more than the pool holds: refused, said why
                    assert "KV" in str(e) or "max_context_len" in str(e), e
                    counts["refused"] += 1
            if p["abort_at"] == step and i in reqs:
                eng.abort(reqs[i])
        if eng.has_unfinished():
            eng.step()
        eng.check_memory()
        step += 1
        assert step < 1500, "the schedule does not finish"
    for i, r in reqs.items():
        p = planned[i]
        assert r.finished and r.error is None, (r.finish_reason, r.error)
        if r.finish_reason == "abort":
            counts["aborted"] += 1
        elif r.finish_reason == "stop":
            assert r.output_ids[-1] in p["stop"]
            counts["stopped"] += 1
        else:
            assert r.finish_reason == "length" and len(r.output_ids) == p["max_new"]
    assert not eng.running and not eng.waiting and eng.allocator.is_full()
    assert eng.req_to_token.free_rows == eng.config.max_running_requests
    counts["cases"] += 1
    counts["requests"] += len(reqs)
    counts["steps"] += step
    counts["preemptions"] += eng.num_preemptions - preempted0


def test_the_fuzzer_ran_and_covered():
    """Runs after the fuzz test (file order): it ran its cases and hit every ending."""
    if not counts["cases"]:
        pytest.skip("the fuzz test did not run")
    print(f"scheduler fuzz: {counts}")
    assert counts["cases"] >= EXAMPLES * 0.9, counts
    assert counts["aborted"] and counts["stopped"] and counts["preemptions"], counts
