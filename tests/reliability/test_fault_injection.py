"""Fault injection at every path that turns an index into an address (issue 16), on CPU with
a tiny random model: one corrupt index per case (negative, equal to the limit, huge, a valid
slot of another request) must end in KVIndexError naming the path and the value, with the
canary rows around every pool and every request's committed K/V unchanged, and the engine
serving the next request exactly; each path on two to four engine configurations (plain,
EAGLE chain and tree, page sizes 1 and 4, multi-layer EAGLE, the Triton backend's host side,
DecodeGraphs' static buffers).
The cases live in eaglekv/testing/faults.py; with
EAGLEKV_FAULT_TABLE=1 this module also writes bench/results/fault_table_cpu.{md,json}."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eaglekv import SamplingParams
from eaglekv.testing.faults import KINDS, PATHS, run_case, write_table
from helpers import spec, tiny_engine

PROMPTS = [[5, 17, 42, 8], list(range(1, 12)), [9] * 7]
NEXT = [3, 1, 4, 1, 5]
SP = SamplingParams(max_new_tokens=8, ignore_eos=True)
OUTCOMES = []
CONFIGS = {   # engine options of each configuration a path is tried on
    "plain": {}, "plain_ps4": {"page_size": 4},
    "graphs": {"attention_backend": "triton"},
    "graphs_ps4": {"attention_backend": "triton", "page_size": 4},
    "eagle_chain": {"speculative": spec("eagle", 3, 1, 4)},
    "eagle_tree": {"speculative": spec("eagle", 3, 2, 5)},
    "eagle_tree_ps4": {"speculative": spec("eagle", 3, 2, 5), "page_size": 4},
    "multi_layer": {"speculative": spec("multi_layer_eagle", 3)},
    # the Triton backend's host side (its kernels' PyTorch references on CPU)
    "plain_triton": {"attention_backend": "triton"},
    "eagle_tree_triton": {"speculative": spec("eagle", 3, 2, 5),
                          "attention_backend": "triton"},
}
TREE = ["eagle_tree", "eagle_tree_ps4", "eagle_chain", "eagle_tree_triton"]
VARIANTS = {
    "store_cache": ["plain", "plain_ps4", "eagle_tree", "eagle_tree_triton"],
    "move_kv": ["eagle_chain", "eagle_tree_ps4", "multi_layer", "eagle_tree_triton"],
    "req_to_token": ["plain", "plain_ps4", "eagle_tree", "plain_triton"],
    "draft_out_cache_loc": TREE,
    "draft_kv_indices": TREE,
    "draft_kv_indptr": TREE,
    "tree_retrieve": ["eagle_tree", "eagle_chain", "multi_layer", "eagle_tree_triton"],
    "graph_padded_rows": ["graphs", "graphs_ps4"],
}
assert set(VARIANTS) == set(PATHS)
CASES = [(p, k, c) for p in PATHS for k in KINDS for c in VARIANTS[p]]


def make_engine(tiny_dir, config):
    eng = tiny_engine(tiny_dir, max_running_requests=4, max_total_tokens=256,
                      **CONFIGS[config])
    if config.startswith("graphs"):      # DecodeGraphs' static buffers, replayed eagerly
        from eaglekv.cuda_graph import DecodeGraphs
        eng.runner.graphs = DecodeGraphs(eng.model, eng.backend, 4, eng.max_context_len,
                                         progress=False, capture=False)
    return eng


@pytest.fixture(scope="module")
def refs(tiny_dir):
    eng = tiny_engine(tiny_dir, max_running_requests=4)
    return [o.token_ids for o in eng.generate(PROMPTS + [NEXT], SP)]


@pytest.fixture(scope="module")
def engines(tiny_dir, canaries):
    made = {}

    def get(config):
        if config not in made:
            made[config] = make_engine(tiny_dir, config)
        return made[config]
    get.made = made
    yield get
    if os.environ.get("EAGLEKV_FAULT_TABLE") == "1" and OUTCOMES:
        out = Path(__file__).resolve().parents[2] / "bench" / "results"
        write_table(OUTCOMES, out / "fault_table_cpu.md", out / "fault_table_cpu.json",
                    "EAGLEKV_FAULT_TABLE=1 .venv/bin/python -m pytest -q -p no:cacheprovider "
                    "tests/reliability/test_fault_injection.py", "CPU")


@pytest.mark.parametrize("path,kind,config", CASES)
def test_fault(engines, refs, path, kind, config):
    outcome = run_case(engines(config), path, kind, PROMPTS, refs[:-1], NEXT, refs[-1], SP)
    outcome.config = config
    OUTCOMES.append(outcome)
    if not outcome.serving:      # the next case on this configuration starts afresh
        engines.made.pop(config)
    assert outcome.ok, outcome.as_dict()
