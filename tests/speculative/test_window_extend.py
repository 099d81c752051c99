"""The draft extend over the whole verify window, before the step's sync (`window_extend`,
on by default with CUDA graphs): the same greedy tokens as plain decoding, and the same accept
counts as the draft extend over the accepted tokens after the sync, for chains and trees,
EAGLE and EAGLE-3, page sizes 1 and 16 (CPU, fp32)."""

from __future__ import annotations

import pytest

from eaglekv import SamplingParams
from helpers import PROMPTS, spec, tiny_engine

PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 13, 20, 9)]


@pytest.fixture(scope="module")
def reference(deep_dir):
    eng = tiny_engine(deep_dir, max_running_requests=4)
    return [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("alg,S,K,N", [("eagle", 3, 1, 4), ("eagle", 3, 2, 6),
                                       ("eagle", 5, 4, 12), ("eagle3", 3, 1, 4),
                                       ("eagle3", 3, 2, 6)])
@pytest.mark.parametrize("ps", [1, 16])
def test_window_extend_equals_extend_after_sync(deep_dir, reference, alg, S, K, N, ps):
    runs = {}
    for window in (False, True):
        eng = tiny_engine(deep_dir, page_size=ps, max_running_requests=4,
                          speculative=spec(alg, S, K, N))
        assert eng.runner.window_extend is False          # CPU default: after the sync
        eng.runner.window_extend = window
        outs = eng.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == reference
        runs[window] = [(o.spec.verify_steps, o.spec.accepted_tokens) for o in outs]
        eng.check_memory()
        assert eng.allocator.is_full()
    assert runs[True] == runs[False]
