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
from helpers import make_predictable, spec, tiny_engine  # noqa: E402

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


def _chain_engine(tiny_dir, S, K, N, chain):
    engine = tiny_engine(tiny_dir, max_running_requests=4, attention_backend="triton",
                         max_context_len=64, speculative=spec("eagle", S, K, N))
    make_predictable(engine)
    w = engine.runner
    w.slots.hold_both = True
    w.step_graphs = SpecStepGraphs(w, 4, progress=False, capture=False)
    w.chain_steps = chain
    w.budget_cut = False         # whole chains: budgets run out inside them (frozen rows)
    return engine


@pytest.mark.parametrize("S,K,N", [(3, 1, 4)])   # a tree (K = 2) chains in test_fault_graphs
def test_spec_step_chain_buffers(tiny_dir, S, K, N):
    """Chains of whole-step replays (`SpecStepGraphs.run_chain`: one sync for k steps, step
    j + 1's inputs made from step j's outputs on the device) give plain decoding's tokens and
    the same accept lengths step for step as one step a sync (per request and engine-wide,
    a request's steps counted up to its stop), books balanced after every engine step. The
    draft predicts the target's bigram part (`make_predictable`), so accept lengths vary
    from 0 to S; budgets of 11, 10 and 9 tokens run out inside chains (the request is
    frozen there on the device, `run_chain`), and a stop id ends one request inside a
    chain. After every engine step
    each request's draft root (logits and feature) equals the one-step run's at the same
    committed length (up to rounding)."""
    plain = tiny_engine(tiny_dir, max_running_requests=4)
    make_predictable(plain)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (11, 10, 9)]
    reference = [o.token_ids for o in plain.generate(PROMPTS, params)]
    # the second request stops at its 8th token's id (a stop inside a chain)
    params[1] = SamplingParams(max_new_tokens=10, ignore_eos=True,
                               stop_token_ids=(reference[1][7],))
    reference[1] = reference[1][:reference[1].index(reference[1][7]) + 1]
    runs = []
    for chain in (1, 3):
        engine = _chain_engine(tiny_dir, S, K, N, chain)
        w = engine.runner
        lens, frozen = [], []
        orig = w.chain_len
        w.chain_len = lambda *a: lens.append(orig(*a)) or lens[-1]  # noqa: B023
        result_of = w._chain_result

        def chain_result(reqs, vchain, host, window):
            res = result_of(reqs, vchain, host, window)
            frozen.extend(b for b, a in enumerate(res.accepted)     # noqa: B023
                          if a is not None and len(a) < vchain.shape[0])
            return res
        w._chain_result = chain_result
        drafts = {}                   # (row, committed length) -> the draft's pool scores
        loop_run, g = w.loop.run, w.step_graphs

        def recorded(*a, **kw):
            pool = loop_run(*a, **kw)
            L, rows, _, live, _, _ = g._views(pool.scores.shape[0], g.inputs)  # noqa: B023
            for i in live.nonzero().view(-1).tolist():
                drafts[int(rows[i]), int(L[i])] = pool.scores[i].clone()     # noqa: B023
            return pool
        w.loop.run = recorded
        reqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        roots = {}
        while engine.has_unfinished():
            engine.step()
            engine.check_memory()
            for i, r in enumerate(reqs):
                if not r.finished and r.draft_state is not None:
                    roots[i, r.kv_len] = (r.draft_state[0].clone(), r.draft_state[1].clone())
        if chain == 1:
            one_roots, one_drafts = roots, drafts
        else:
            # every draft the chains ran: the one-step run's, from the same roots (a stale
            # root feature or root token inside a chain would move these scores); a request
            # that stopped on its stop id runs on to its chain's end (drafts past it extra)
            common = drafts.keys() & one_drafts.keys()
            assert len(common) >= len(one_drafts) - 1 and len(drafts) - len(common) <= 2
            for key in common:
                torch.testing.assert_close(drafts[key], one_drafts[key], rtol=1e-4, atol=1e-5)
            assert len(roots) >= 4 and roots.keys() <= one_roots.keys()
            # equal up to rounding: a request frozen in a chain keeps its row in the bucket,
            # where the one-step run's batch has shrunk (other matmul shapes)
            for key, (logits, hidden) in roots.items():
                torch.testing.assert_close(logits, one_roots[key][0], rtol=1e-4, atol=1e-6)
                torch.testing.assert_close(hidden, one_roots[key][1], rtol=1e-4, atol=1e-6)
        assert [r.output_ids for r in reqs] == reference
        assert engine.allocator.is_full()
        # padded and frozen rows wrote only zeros into req_to_token's padding row
        assert not engine.req_to_token.req_to_token[0].any()
        if chain > 1:         # a request's budget ran out inside a chain: frozen there
            assert frozen
        runs.append((lens, [(r.spec_stats.verify_steps, r.spec_stats.accepted_tokens,
                             r.spec_stats.accept_histogram) for r in reqs],
                     (w.stats.verify_steps, w.stats.accepted_tokens, w.stats.accept_histogram)))
    (one, per_req1, eng1), (chained, per_req3, eng3) = runs
    assert set(one) == {1} and max(chained) == 3 and len(chained) < len(one)
    assert per_req3 == per_req1 and eng3 == eng1
    assert len(eng1[2]) >= 3            # accept lengths vary: the commit paths all ran


def test_spec_chain_bad_step_and_short_pool(tiny_dir):
    """Request 1's verify logits turn unusable at the 2nd step of a chain: it fails alone
    with the tokens of its steps before, every verify slot of its chain goes back, the others
    decode plain decoding's tokens. Then a pool too small for whole chains: `chain_len` takes
    what the free slots hold (a chain never preempts), same tokens, books balanced."""
    plain = tiny_engine(tiny_dir, max_running_requests=4)
    make_predictable(plain)
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    reference = [o.token_ids for o in plain.generate(PROMPTS, sp)]
    engine = _chain_engine(tiny_dir, 3, 1, 4, 3)
    g = engine.runner.step_graphs
    forward, calls = g._forward, []

    def poisoned(b):
        host, window = forward(b)
        calls.append(b)
        if len(calls) == 2:
            host[1, 0] = 0                       # "not usable" for row 1, chain step 2
        return host, window
    g._forward = poisoned
    reqs = [engine.add_request(p, sp) for p in PROMPTS]
    while not calls:                             # the prefill, then the first chain
        engine.step()
        engine.check_memory()
    assert g.chains == 1 and len(calls) == 3
    assert reqs[1].finish_reason == "error"
    made = len(reqs[1].output_ids)               # the prefill's token + the first step's
    assert 2 <= made <= 1 + 4 and reqs[1].output_ids == reference[1][:made]
    while engine.has_unfinished():
        engine.step()
        engine.check_memory()
    assert [reqs[0].output_ids, reqs[2].output_ids] == [reference[0], reference[2]]
    assert engine.allocator.is_full()

    engine = tiny_engine(tiny_dir, max_running_requests=3, attention_backend="triton",
                         max_context_len=64, max_total_tokens=56,
                         speculative=spec("eagle", 3, 1, 4))
    make_predictable(engine)
    w = engine.runner
    w.slots.hold_both = True
    w.step_graphs = SpecStepGraphs(w, 3, progress=False, capture=False)
    w.chain_steps = 3
    lens = []
    orig = w.chain_len
    w.chain_len = lambda reqs, *a: lens.append(
        (orig(reqs, *a), len(reqs), engine.allocator.available_slots())) or lens[-1][0]
    sp = SamplingParams(max_new_tokens=14, ignore_eos=True)
    reqs = [engine.add_request(p, sp) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
        engine.check_memory()
    assert [r.output_ids for r in reqs] == [o.token_ids for o in plain.generate(PROMPTS, sp)]
    assert engine.allocator.is_full()
    # at least one chain was cut by the free slots alone (budget room for 3 steps)
    assert any(k < 3 and (free - n * 3) // (n * 4) == k for k, n, free in lens)


def test_a_chain_is_cut_to_what_the_budgets_need(tiny_dir):
    """`chain_len` cuts a chain to the steps the batch's longest remaining budget needs at the
    recent tokens a step (`step_tokens`, an average of the counted steps): replays past
    every budget would run frozen rows only. None until a step was counted (whole chains);
    `budget_cut=False` keeps whole chains; the pool's free slots still bound it."""
    from types import SimpleNamespace
    engine = _chain_engine(tiny_dir, 3, 1, 4, 6)
    w = engine.runner
    w.budget_cut = True

    def req(left):
        return SimpleNamespace(params=SimpleNamespace(max_new_tokens=100),
                               output_ids=[0] * (100 - left))
    assert w.step_tokens is None and w.chain_len([req(5)]) == 6
    w._count([3, 3])                                  # 4 tokens a step
    assert w.step_tokens == 4.0
    assert w.chain_len([req(5)]) == 2                 # ceil(5 / 4)
    assert w.chain_len([req(4)]) == 1
    assert w.chain_len([req(4), req(17)]) == 5        # the longest: ceil(17 / 4)
    assert w.chain_len([req(100)]) == 6 and w.chain_len([req(100)], 3) == 3
    w._count([0])                                     # 1 token: the average moves a tenth
    assert w.step_tokens == pytest.approx(3.7)
    assert w.chain_len([req(5)]) == 2
    w.budget_cut = False
    assert w.chain_len([req(5)]) == 6


@pytest.mark.parametrize("path", ["step", "verify"])
def test_chain_verify_through_the_decode_kernel(tiny_dir, monkeypatch, path):
    """`CHAIN_VERIFY_DECODE_MAX_TOKENS`: a chain's verify runs as one decode query per node
    (the decode kernel over prefix + i + 1 keys) instead of the extend kernel under the
    causal tree mask. Through SpecStepGraphs' buffers (greedy, accept lengths varying from 0
    to S: `make_predictable`) and VerifyGraphs' (sampled, seeded): the same tokens and the same
    acceptance as the extend kernel's, every verify on the decode route, books balanced. A
    tree (topk 2) keeps the extend kernel."""
    from eaglekv.attention import triton_backend as tb
    routes = []
    made = tb.TritonAttentionBackend.verify_metadata

    def spy(self, *a, **kw):
        meta = made(self, *a, **kw)
        routes.append((kw["chain"], meta.decode))
        return meta
    monkeypatch.setattr(tb.TritonAttentionBackend, "verify_metadata", spy)
    greedy = path == "step"
    sp = (SamplingParams(max_new_tokens=8, ignore_eos=True) if greedy else
          SamplingParams(max_new_tokens=6, temperature=0.8, seed=3, ignore_eos=True))
    runs = []
    for limit in (0, 64):
        monkeypatch.setattr(tb, "CHAIN_VERIFY_DECODE_MAX_TOKENS", limit)
        routes.clear()
        engine = tiny_engine(tiny_dir, max_running_requests=4, attention_backend="triton",
                             max_context_len=64, speculative=spec("eagle", 3, 1, 4))
        make_predictable(engine)
        w = engine.runner
        w.slots.hold_both = True
        if greedy:
            w.step_graphs = SpecStepGraphs(w, 4, progress=False, capture=False)
        w.verify_graphs = VerifyGraphs(w.res.model, w.res.backend, 4, w.N, progress=False,
                                       capture=False, chain=True)
        outs = [o.token_ids for o in engine.generate(PROMPTS, sp)]
        engine.check_memory()
        assert engine.allocator.is_full()
        assert routes and all(c for c, _ in routes)
        assert all(d == (limit > 0) for _, d in routes)      # 4 rows x 4 nodes <= 64
        runs.append((outs, w.stats.verify_steps, w.stats.accepted_tokens,
                     w.stats.accept_histogram))
    assert runs[0] == runs[1]
    assert len(runs[0][3]) >= 2 or not greedy                 # greedy: accept lengths varied
    # a tree is never a decode
    routes.clear()
    engine = tiny_engine(tiny_dir, max_running_requests=4, attention_backend="triton",
                         max_context_len=64, speculative=spec("eagle", 3, 2, 5))
    w = engine.runner
    w.slots.hold_both = True
    w.step_graphs = SpecStepGraphs(w, 4, progress=False, capture=False)
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert routes and not any(c or d for c, d in routes)


def test_spec_chain_x_scales_the_chains_and_stays_lossless(tiny_dir, monkeypatch):
    """`eagle_worker.SPEC_CHAIN_X` (EAGLEKV_SPEC_CHAIN_X) multiplies the steps a speculative
    chain replays (ceil(8 / 4) = 2 for S3 at num_scheduler_steps 8; x 3: 6), for the fixed
    shape and for every shape of the adaptive runner; a chain of 6 whole steps gives plain
    decoding's tokens with budgets that run out inside it; x <= 0 is refused by name."""
    from eaglekv.speculative import eagle_worker
    from eaglekv.speculative.eagle_worker import spec_chain_steps
    assert [spec_chain_steps(8, 3, x) for x in (1.0, 1.5, 2.0, 3.0)] == [2, 3, 4, 6]
    assert spec_chain_steps(32, 7, 2.0) == 8 and spec_chain_steps(1, 7, 3.0) == 1   # CPU: 1
    with pytest.raises(ValueError, match="x = 0.0.*EAGLEKV_SPEC_CHAIN_X"):
        spec_chain_steps(8, 3, 0.0)
    monkeypatch.setattr(eagle_worker, "SPEC_CHAIN_X", 3.0)
    fixed = tiny_engine(tiny_dir, max_running_requests=2, num_scheduler_steps=8,
                        speculative=spec("eagle", 3, 1, 4))
    assert fixed.runner.chain_steps == 6
    adaptive = tiny_engine(tiny_dir, max_running_requests=2, num_scheduler_steps=8,
                           speculative=dict(algorithm="eagle", draft_model="random",
                                            adaptive=True, shapes=((3, 1, 4), (1, 1, 2))))
    assert sorted(w.chain_steps for w in adaptive.runner.workers.values()) == [6, 12]

    plain = tiny_engine(tiny_dir, max_running_requests=4)
    make_predictable(plain)
    # two requests (a third of 9 tokens cost ~6 s under the interpreter and added no case):
    # whole chains of 6 steps (budget_cut off): the budget of 5 runs out inside the first
    # (6 steps give at least 6 tokens)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (13, 5)]
    reference = [o.token_ids for o in plain.generate(PROMPTS[:2], params)]
    engine = _chain_engine(tiny_dir, 3, 1, 4, spec_chain_steps(8, 3))
    assert engine.runner.chain_steps == 6
    assert [o.token_ids for o in engine.generate(PROMPTS[:2], params)] == reference
    engine.check_memory()
    assert engine.allocator.is_full()
    assert engine.runner.step_graphs.chains > 0
