"""The EAGLE worker on the GPU: speculative greedy equals plain greedy (the Triton draft
kv-indices kernels, the tree verify and the commit moves on CUDA), and a corrupted slot read
by the draft fails only its batch, through the deferred device error buffer."""

from __future__ import annotations

import pytest
import torch

from eaglekv import KVIndexError, SamplingParams
from helpers import tiny_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 47))]


def spec(S, K, N):
    return dict(algorithm="eagle", draft_model="random", num_steps=S, topk=K, num_draft_tokens=N)


def _check_graphs(eng, graphs: bool) -> None:
    """With graphs on, the greedy steps were replays of the whole-step graph (EAGLE and
    EAGLE-3 at page_size 1), else their verify forwards were replays of the verify graph."""
    w = eng.runner
    if not graphs:
        assert w.verify_graphs is None and w.step_graphs is None
        return
    want_step = w.draft_graphable(w.drafter) and eng.config.page_size == 1
    assert (w.step_graphs is not None) == want_step
    done = w.step_graphs.replays if want_step else w.verify_graphs.replays
    assert done > 0


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("S,K,N,ps", [(3, 1, 4, 1), (3, 2, 6, 16), (5, 4, 12, 4)])
def test_gpu_spec_greedy_equals_plain(tiny_dir, S, K, N, ps, graphs):
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = [o.token_ids for o in tiny_engine(tiny_dir, device="cuda").generate(PROMPTS, sp)]
    eng = tiny_engine(tiny_dir, device="cuda", page_size=ps, max_running_requests=4,
                      speculative=spec(S, K, N), disable_cuda_graph=not graphs)
    assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == plain
    _check_graphs(eng, graphs)
    eng.check_memory()
    assert eng.allocator.is_full()


def test_gpu_spec_sampling_runs_seeded(tiny_dir):
    sp = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    outs = []
    for _ in range(2):
        eng = tiny_engine(tiny_dir, device="cuda", speculative=spec(3, 1, 4))
        outs.append([o.token_ids for o in eng.generate(PROMPTS, sp)])
        eng.check_memory()
    assert outs[0] == outs[1]


def test_gpu_spec_bad_slot_fails_batch_then_serves(tiny_dir):
    eng = tiny_engine(tiny_dir, device="cuda", page_size=4, max_running_requests=2,
                      speculative=spec(3, 2, 6))
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = eng.generate([PROMPTS[1]], sp)[0].token_ids
    req = eng.add_request(PROMPTS[0], sp)
    for _ in range(2):
        eng.step()
    bad = eng.kv_pool.size_limit + 3
    eng.req_to_token.req_to_token[req.row, 1] = bad
    with pytest.raises(KVIndexError, match=str(bad)):
        while not req.finished:
            eng.step()
    assert req.finish_reason == "error"
    eng.check_memory()
    assert eng.allocator.is_full()
    assert eng.generate([PROMPTS[1]], sp)[0].token_ids == ref
    eng.check_memory()
    assert eng.allocator.is_full()


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("alg,S,K,N,ps", [("eagle3", 3, 1, 4, 1), ("eagle3", 3, 2, 6, 16),
                                          ("multi_layer_eagle", 3, 1, 4, 16)])
def test_gpu_families_greedy_equal_plain(deep_dir, alg, S, K, N, ps, graphs):
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = [o.token_ids for o in tiny_engine(deep_dir, device="cuda").generate(PROMPTS, sp)]
    eng = tiny_engine(deep_dir, device="cuda", page_size=ps, max_running_requests=4,
                      speculative=dict(spec(S, K, N), algorithm=alg),
                      disable_cuda_graph=not graphs)
    assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == plain
    _check_graphs(eng, graphs)
    eng.check_memory()
    assert eng.allocator.is_full()


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
def test_gpu_reduced_vocabulary_head_stays_lossless(tmp_path, tiny_dir, shape, graphs):
    """An EAGLE-1 head with draft_vocab.json (the shipped head's layout) on CUDA: the draft
    proposes only the listed ids, inside the step graphs and eagerly, and greedy speculation
    equals plain greedy token for token."""
    import json
    from eaglekv.model.draft_checkpoint import random_eagle_draft, save_eagle_draft
    from eaglekv.model.draft_io import DRAFT_VOCAB_FILE
    from helpers import spec as spec_of
    plain = tiny_engine(tiny_dir, device="cuda")
    cfg_dict, sd = random_eagle_draft(plain.model_config, seed=5, std=0.1)
    save_eagle_draft(tmp_path, cfg_dict, sd)
    ids = list(range(0, 200, 5))
    (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps({"target_ids": ids}))
    eng = tiny_engine(tiny_dir, device="cuda", max_running_requests=4,
                      speculative=spec_of("eagle", *shape, draft=str(tmp_path)),
                      disable_cuda_graph=not graphs)
    assert eng.runner.drafter.model.lm_head_t.shape[1] == len(ids)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert ([o.token_ids for o in eng.generate(PROMPTS, sp)]
            == [o.token_ids for o in plain.generate(PROMPTS, sp)])
    _check_graphs(eng, graphs)
    eng.check_memory()
    assert eng.allocator.is_full()


def _predictable_plain(model_dir, alg, params) -> list[list[int]]:
    """Plain greedy tokens of PROMPTS on CUDA; for EAGLE the near-bigram target its draft
    predicts (`make_predictable`; EAGLE-3's head takes captured layers, left random)."""
    from helpers import make_predictable
    eng = tiny_engine(model_dir, device="cuda")
    if alg == "eagle":
        make_predictable(eng)
    return [o.token_ids for o in eng.generate(PROMPTS, params)]


def _run_predictable(eng, alg, params) -> list:
    """PROMPTS through `eng` step by step (made predictable as `_predictable_plain`), the
    books checked after every step; -> the requests."""
    from helpers import make_predictable
    if alg == "eagle":
        make_predictable(eng)
    reqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    while eng.has_unfinished():
        eng.step()
        eng.check_memory()
    return reqs


@pytest.mark.parametrize("S,K,N", [(3, 1, 4), (3, 2, 5), (5, 1, 6)])
@pytest.mark.parametrize("alg", ["eagle", "eagle3"])
def test_gpu_spec_chains_equal_one_step_and_plain(tiny_dir, deep_dir, alg, S, K, N):
    """Captured whole-step graphs replayed in chains (the default under CUDA graphs) and one
    replay a sync (num_scheduler_steps=1): greedy equal to plain in fp32, the same accept
    lengths per request, chains of more than one replay ran, budgets run out inside chains,
    books balanced. The draft predicts a near-bigram target (`make_predictable`, EAGLE only:
    EAGLE-3's head takes captured layers), so accept lengths vary."""
    model_dir = tiny_dir if alg == "eagle" else deep_dir
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (40, 23, 31)]
    plain = _predictable_plain(model_dir, alg, params)
    runs = []
    for steps in (None, 1):
        eng = tiny_engine(model_dir, device="cuda", num_scheduler_steps=steps,
                          speculative=dict(algorithm=alg, draft_model="random", num_steps=S,
                                           topk=K, num_draft_tokens=N))
        reqs = _run_predictable(eng, alg, params)
        assert [r.output_ids for r in reqs] == plain
        g = eng.runner.step_graphs
        assert g is not None and g.capture and (g.chains > 0) == (steps is None)
        assert eng.allocator.is_full()
        runs.append([(r.spec_stats.verify_steps, r.spec_stats.accept_histogram) for r in reqs])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("ps", [1, 4], ids=["step-graph", "verify-graph"])
@pytest.mark.parametrize("alg", ["eagle", "eagle3"])
def test_gpu_chain_verify_through_the_decode_kernel(tiny_dir, deep_dir, monkeypatch, alg, ps):
    """A chain's verify as decode queries (`CHAIN_VERIFY_DECODE_MAX_TOKENS`), captured in the
    whole-step graphs (page_size 1) or the verify graphs (page_size 4): greedy equal to plain
    in fp32 with the same accept lengths as the extend kernel's route, books balanced."""
    from eaglekv.attention import triton_backend
    model_dir = tiny_dir if alg == "eagle" else deep_dir
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 17, 20)]
    plain = _predictable_plain(model_dir, alg, params)
    runs = []
    for limit in (0, 64):
        monkeypatch.setattr(triton_backend, "CHAIN_VERIFY_DECODE_MAX_TOKENS", limit)
        eng = tiny_engine(model_dir, device="cuda", page_size=ps, max_running_requests=4,
                          speculative=dict(algorithm=alg, draft_model="random", num_steps=5,
                                           topk=1, num_draft_tokens=6))
        reqs = _run_predictable(eng, alg, params)
        assert [r.output_ids for r in reqs] == plain
        _check_graphs(eng, True)
        assert eng.allocator.is_full()
        runs.append([(r.spec_stats.verify_steps, r.spec_stats.accept_histogram) for r in reqs])
    assert runs[0] == runs[1]
