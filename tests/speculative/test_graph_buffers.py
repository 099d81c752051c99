"""The static-buffer side of the CUDA graphs, checked on CPU: DecodeGraphs, VerifyGraphs and
DraftGraphs built with `capture=False` run their forwards eagerly over the same static buffers
a replay reads (bucket padding, the live-row flag, the copies in), under the Triton
interpreter. Greedy tokens equal the PyTorch backend's, and a padded decode row writes only
the padding page. (Capture and replay themselves run in the GPU tests.)"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton and the kernel modules are imported
pytest.importorskip("triton")

from eaglekv import SamplingParams  # noqa: E402
from eaglekv.cuda_graph import DecodeGraphs, VerifyGraphs  # noqa: E402
from eaglekv.speculative.graphs import DraftGraphs  # noqa: E402
from helpers import spec, tiny_engine  # noqa: E402

SP = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 42], list(range(1, 12)), [9] * 7]
pytestmark = [] if not ON_GPU else pytest.mark.skip("the GPU tests capture the real graphs")


@pytest.fixture(autouse=True)
def _interpret_only_here(monkeypatch):
    monkeypatch.setenv("EAGLEKV_TRITON_ON_CPU", "1")


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return [o.token_ids for o in tiny_engine(tiny_dir, max_running_requests=4).generate(
        PROMPTS, SP)]


def test_decode_buffers(tiny_dir, reference):
    engine = tiny_engine(tiny_dir, max_running_requests=4, attention_backend="triton")
    graphs = DecodeGraphs(engine.model, engine.backend, 4, engine.max_context_len,
                          progress=False, capture=False)
    engine.runner.graphs = graphs
    assert [o.token_ids for o in engine.generate(PROMPTS, SP)] == reference
    assert graphs.replays >= SP.max_new_tokens - 1
    # 3 requests in the 4-row bucket: the padding row writes the padding page (slot 0) only
    for b in engine.kv_pool.k_buffer + engine.kv_pool.v_buffer:
        b.zero_()                      # the first run left these very K/V in the same slots
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True))
            for p in PROMPTS]
    while any(len(r.output_ids) < 2 for r in reqs):
        engine.step()
    before = [b.clone() for b in engine.kv_pool.k_buffer + engine.kv_pool.v_buffer]
    engine.step()
    changed = set()
    for a, b in zip(before, engine.kv_pool.k_buffer + engine.kv_pool.v_buffer):
        changed |= set((a != b).flatten(1).any(1).nonzero().view(-1).tolist())
    assert changed - {0} == {r.last_slot for r in reqs}
    for r in reqs:
        engine.abort(r)
    engine.check_memory()


@pytest.mark.parametrize("S,K,N,ps", [(3, 1, 4, 1), (3, 2, 5, 4)])
def test_verify_and_draft_buffers(tiny_dir, reference, S, K, N, ps):
    engine = tiny_engine(tiny_dir, max_running_requests=4, attention_backend="triton",
                         page_size=ps, speculative=spec("eagle", S, K, N))
    w = engine.runner
    assert w.draft_graphable(w.drafter)
    w.verify_graphs = VerifyGraphs(w.res.model, w.res.backend, 4, N, progress=False,
                                   capture=False)
    w.draft_graphs = DraftGraphs(w, 4, progress=False, capture=False)
    w.window_extend = True
    assert [o.token_ids for o in engine.generate(PROMPTS, SP)] == reference
    assert w.verify_graphs.replays > 0 and w.draft_graphs.replays > 0
    engine.check_memory()
    assert engine.allocator.is_full()
