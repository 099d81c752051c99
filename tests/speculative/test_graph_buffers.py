"""The static-buffer side of the CUDA graphs, checked on CPU: DecodeGraphs, VerifyGraphs and
SpecStepGraphs built with `capture=False` run their forwards eagerly over the same static buffers
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
from eaglekv.speculative.graphs import SpecStepGraphs  # noqa: E402
from helpers import spec, tiny_engine  # noqa: E402

SP = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 42], list(range(1, 12)), [9] * 7]
pytestmark = [] if not ON_GPU else pytest.mark.skip("the GPU tests capture the real graphs")


@pytest.fixture(autouse=True)
def _interpret_only_here(monkeypatch):
    monkeypatch.setenv("EAGLEKV_TRITON_ON_CPU", "1")


# the engines on the Triton backend take a context of 64 (the prompts and their tokens fit):
# graph buffers size the split-K by the context limit, and the interpreter runs every split
@pytest.fixture(scope="module")
def reference(tiny_dir):
    return [o.token_ids for o in tiny_engine(tiny_dir, max_running_requests=4).generate(
        PROMPTS, SP)]


def test_decode_buffers(tiny_dir, reference):
    engine = tiny_engine(tiny_dir, max_running_requests=4, attention_backend="triton",
                         max_context_len=64)
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


@pytest.mark.parametrize("S,K,N", [(3, 1, 4), (3, 2, 5)])
def test_spec_step_buffers(tiny_dir, reference, S, K, N):
    """A greedy speculative step through SpecStepGraphs' buffers: 3 requests in the 4-row
    bucket, then 2 in the 2-row one as requests finish; the same tokens as plain decoding."""
    engine = tiny_engine(tiny_dir, max_running_requests=4, attention_backend="triton",
                         max_context_len=64, speculative=spec("eagle", S, K, N))
    w = engine.runner
    assert w.draft_graphable(w.drafter)
    w.slots.hold_both = True
    w.step_graphs = SpecStepGraphs(w, 4, progress=False, capture=False)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 3, 6)]
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [r[:p.max_new_tokens]
                                           for r, p in zip(reference, params)]
    assert w.step_graphs.replays > 0
    engine.check_memory()
    assert engine.allocator.is_full()


def test_sampled_step_replays_only_the_verify(tiny_dir):
    """A sampled batch drafts eagerly (each request's own generator) and verifies through
    VerifyGraphs' buffers: the same seeded tokens as with no graph objects at all."""
    sp = SamplingParams(max_new_tokens=5, temperature=0.8, seed=1, ignore_eos=True)
    outs = []
    for graphs in (False, True):
        engine = tiny_engine(tiny_dir, max_running_requests=4, attention_backend="triton",
                             max_context_len=64, speculative=spec("eagle", 3, 1, 4))
        w = engine.runner
        if graphs:
            w.slots.hold_both = True
            w.step_graphs = SpecStepGraphs(w, 4, progress=False, capture=False)
            w.verify_graphs = VerifyGraphs(w.res.model, w.res.backend, 4, w.N, progress=False,
                                           capture=False)
        outs.append([o.token_ids for o in engine.generate(PROMPTS, sp)])
        engine.check_memory()
    assert outs[0] == outs[1]
    assert w.step_graphs.replays == 0 and w.verify_graphs.replays > 0
