"""Fault injection at every path that turns an index into an address (issue 16), on CPU with
a tiny random model: one corrupt index per case (negative, equal to the limit, huge, a valid
slot of another request) must end in KVIndexError naming the path and the value, with the
canary rows around every pool and every request's committed K/V unchanged, and the engine
serving the next request exactly. The cases live in eaglekv/testing/faults.py; with
EAGLEKV_FAULT_TABLE=1 this module also writes bench/results/fault_table_cpu.{md,json}."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eaglekv import SamplingParams
from eaglekv.memory import KVPool
from eaglekv.testing.faults import KINDS, PATHS, SPECULATIVE_PATHS, run_case, write_table
from helpers import spec, tiny_engine

PROMPTS = [[5, 17, 42, 8], list(range(1, 12)), [9] * 7]
NEXT = [3, 1, 4, 1, 5]
SP = SamplingParams(max_new_tokens=8, ignore_eos=True)
OUTCOMES = []


def engine_for(tiny_dir, path):
    opts = dict(max_running_requests=4, max_total_tokens=256)
    if path in SPECULATIVE_PATHS:
        opts["speculative"] = spec("eagle", 3, 1, 4) if path == "move_kv" else \
            spec("eagle", 3, 2, 5)
    if path == "graph_padded_rows":      # DecodeGraphs' static buffers, replayed eagerly
        from eaglekv.cuda_graph import DecodeGraphs
        eng = tiny_engine(tiny_dir, attention_backend="triton", **opts)
        eng.runner.graphs = DecodeGraphs(eng.model, eng.backend, 4, eng.max_context_len,
                                         progress=False, capture=False)
        return eng
    return tiny_engine(tiny_dir, **opts)


@pytest.fixture(scope="module")
def canaries():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVPool, "canary_rows", 4)
        yield


@pytest.fixture(scope="module")
def refs(tiny_dir):
    eng = tiny_engine(tiny_dir, max_running_requests=4)
    return [o.token_ids for o in eng.generate(PROMPTS + [NEXT], SP)]


@pytest.fixture(scope="module")
def engines(tiny_dir, canaries):
    made = {}

    def get(path):
        if path not in made:
            made[path] = engine_for(tiny_dir, path)
        return made[path]
    get.made = made
    yield get
    if os.environ.get("EAGLEKV_FAULT_TABLE") == "1" and OUTCOMES:
        out = Path(__file__).resolve().parents[2] / "bench" / "results"
        write_table(OUTCOMES, out / "fault_table_cpu.md", out / "fault_table_cpu.json",
                    "EAGLEKV_FAULT_TABLE=1 .venv/bin/python -m pytest -q -p no:cacheprovider "
                    "tests/reliability/test_fault_injection.py", "CPU")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_fault(engines, refs, path, kind):
    outcome = run_case(engines(path), path, kind, PROMPTS, refs[:-1], NEXT, refs[-1], SP)
    OUTCOMES.append(outcome)
    if not outcome.serving:      # the next case on this path starts on a fresh engine
        engines.made.pop(path)
    assert outcome.ok, outcome.as_dict()
