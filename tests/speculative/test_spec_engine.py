"""The EAGLE worker inside the engine (CPU, fp32, tiny random target): lossless greedy output,
exact accept lengths with scripted drafts, KV after every step equal to a fresh prefill, the
allocator back to full."""

from __future__ import annotations

import pytest
import torch

from eaglekv import SamplingParams
from eaglekv.core import ForwardBatch
from eaglekv.speculative.drafter import ScriptedDrafter
from helpers import PROMPTS, expected_accepts, fresh_kv, oracle, tiny_engine


def spec_engine(tiny_dir, S=3, K=1, N=None, ps=1, drafter=None, **options):
    N = N or S + 1
    spec = dict(algorithm="eagle", draft_model="random" if drafter is None else "scripted",
                num_steps=S, topk=K, num_draft_tokens=N)
    return tiny_engine(tiny_dir, page_size=ps, speculative=spec, drafter=drafter, **options)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Plain greedy continuations, long enough for any script to look ahead."""
    eng = tiny_engine(tiny_dir, max_running_requests=4)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=64, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("S,K,N", [(1, 1, 2), (3, 1, 4), (5, 1, 6), (3, 2, 4), (3, 2, 6),
                                   (3, 4, 10), (5, 2, 8), (5, 4, 16), (1, 4, 3)])
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_greedy_lossless_random_draft(tiny_dir, reference, S, K, N, ps):
    eng = spec_engine(tiny_dir, S, K, N, ps, max_running_requests=4)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (33, 20, 40, 7)]
    outs = eng.generate(PROMPTS, params)
    for o, r, p in zip(outs, reference, params):
        assert o.token_ids == r[:p.max_new_tokens]
        assert o.finish_reason == "length"
    eng.check_memory()
    assert eng.allocator.is_full()


def test_batch1_and_staggered_arrivals(tiny_dir, reference):
    """Requests join while others decode and finish at different steps."""
    eng = spec_engine(tiny_dir, 3, 2, 6, ps=4, max_running_requests=3)
    first = eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    reqs = [first]
    for i in range(1, 4):
        for _ in range(2 * i):
            eng.step()
        reqs.append(eng.add_request(PROMPTS[i], SamplingParams(max_new_tokens=10 + 7 * i,
                                                               ignore_eos=True)))
    while eng.has_unfinished():
        eng.step()
    for r, ref in zip(reqs, reference):
        assert r.output_ids == ref[:r.params.max_new_tokens]
    eng.check_memory()
    assert eng.allocator.is_full()


@pytest.mark.parametrize("S", [1, 3, 5])
@pytest.mark.parametrize("case", ["full", "every3", "none"])
def test_scripted_chain_accept_lengths(tiny_dir, reference, S, case):
    wrong = {"full": lambda j: False, "every3": lambda j: j % 3 == 0,
             "none": lambda j: True}[case]
    drafter = ScriptedDrafter(oracle(PROMPTS[:1], reference[:1], wrong), 256)
    eng = spec_engine(tiny_dir, S, 1, drafter=drafter, max_running_requests=1)
    out = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    assert out.token_ids == reference[0][:30]
    want = expected_accepts(64, S, wrong, 30)
    hist: dict[int, int] = {}
    for a in want:
        hist[a + 1] = hist.get(a + 1, 0) + 1
    assert out.spec.accept_histogram == hist
    assert out.spec.verify_steps == len(want)
    assert out.spec.accepted_tokens == sum(want)
    assert out.spec.accept_length_mean == pytest.approx((sum(want) + len(want)) / len(want))
    eng.check_memory()


@pytest.mark.parametrize("K,N,ps", [(2, 4, 1), (4, 8, 4), (2, 6, 16)])
def test_scripted_tree_full_acceptance(tiny_dir, reference, K, N, ps):
    """The right token ranked first at every depth: the whole chain of S is accepted."""
    S = 3
    drafter = ScriptedDrafter(oracle(PROMPTS, reference, topk=K), 256)
    eng = spec_engine(tiny_dir, S, K, N, ps, drafter=drafter, max_running_requests=4)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=25, ignore_eos=True))
    for o, r in zip(outs, reference):
        assert o.token_ids == r[:25]
        # 1 token from prefill, then S + 1 per verify: 24 = 6 * 4
        assert o.spec.accept_histogram == {S + 1: 6}
    assert eng.spec_stats().verify_steps == 6 * len(PROMPTS)
    eng.check_memory()


@pytest.mark.parametrize("K,N,ps", [(1, 4, 1), (2, 6, 4), (4, 10, 16)])
@pytest.mark.parametrize("chunk", [None, 2])
def test_kv_equals_fresh_prefill_after_every_step(tiny_dir, K, N, ps, chunk):
    """After each step, the committed tokens' target and draft K/V equal a fresh prefill
    (with chunk=2 the prompts are prefilled 2 tokens a step, one request waiting its turn)."""
    from eaglekv.attention import TorchAttentionBackend
    from eaglekv.memory import KVPool
    eng = spec_engine(tiny_dir, 3, K, N, ps, max_running_requests=2, chunked_prefill_size=chunk)
    draft = eng.worker.drafter
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=14, ignore_eos=True))
            for p in PROMPTS[:2]]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        for r in reqs:
            if r.finished or not r.kv_len:   # done, or waiting for its prefill chunk
                continue
            ids = r.all_ids[:r.kv_len]
            slots = eng.req_to_token.req_to_token[r.row, :r.kv_len].to(torch.int64)
            pool, fslots, hidden, r2t, batch = fresh_kv(eng.model, ids)
            for layer in range(eng.model.cfg.num_layers):
                torch.testing.assert_close(eng.kv_pool.k_buffer[layer][slots],
                                           pool.k_buffer[layer][fslots], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(eng.kv_pool.v_buffer[layer][slots],
                                           pool.v_buffer[layer][fslots], atol=1e-4, rtol=1e-4)
            # the draft: an extend over the same positions, ids shifted left by one
            dpool = KVPool(len(ids) + 1, 1, *draft.model.kv_shape())
            dbatch = ForwardBatch.build([r.all_ids[1:r.kv_len + 1]], [0], [1], fslots)
            dback = TorchAttentionBackend(dpool, r2t)
            draft.model.forward(dbatch.input_ids, dbatch.positions, hidden, dback,
                                dback.init_forward_metadata(dbatch))
            torch.testing.assert_close(draft.kv_pool.k_buffer[0][slots], dpool.k_buffer[0][fslots],
                                       atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(draft.kv_pool.v_buffer[0][slots], dpool.v_buffer[0][fslots],
                                       atol=1e-4, rtol=1e-4)
    assert steps > 3
    eng.check_memory()
    assert eng.allocator.is_full()


def test_stop_inside_accepted_run_truncates(tiny_dir, reference):
    """A stop token inside an accepted run ends the output there, as plain decoding does."""
    stop_tok = reference[0][9]
    first = reference[0].index(stop_tok)
    drafter = ScriptedDrafter(oracle(PROMPTS[:1], reference[:1]), 256)
    eng = spec_engine(tiny_dir, 5, 1, drafter=drafter, max_running_requests=1)
    out = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=40, stop_token_ids=(stop_tok,),
                                                  ignore_eos=True))[0]
    assert out.token_ids == reference[0][:first + 1]
    assert out.finish_reason == "stop"
    eng.check_memory()


def test_preemption_under_memory_pressure(tiny_dir, reference):
    """A pool too small for every request's speculative step preempts and recomputes."""
    eng = spec_engine(tiny_dir, 3, 2, 6, ps=4, max_running_requests=4, max_total_tokens=128)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for o, r in zip(outs, reference):
        assert o.token_ids == r[:24]
    eng.check_memory()
    assert eng.allocator.is_full()


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("ps", [1, 4])
def test_uniform_step_pages_is_step_pages_at_every_length(tiny_dir, ps, adaptive):
    """The scheduler's reserve check multiplies one request's step pages by the batch when
    they do not depend on the length (one slot a page): that figure must be step_pages' at
    every length; with larger pages there is none (the check sums per request)."""
    sp = (dict(algorithm="eagle", draft_model="random", adaptive=True) if adaptive
          else dict(algorithm="eagle", draft_model="random", num_steps=3, topk=2,
                    num_draft_tokens=6))
    plain = tiny_engine(tiny_dir, page_size=ps).runner      # one token a step: any page size
    assert all(plain.step_pages(L) == plain.uniform_step_pages() for L in range(0, 300, 7))
    eng = tiny_engine(tiny_dir, page_size=ps, speculative=sp)
    each = eng.runner.uniform_step_pages()
    if ps > 1:
        assert each is None
        return
    assert each == max(eng.runner.step_pages(L) for L in range(0, 300, 7)) > 0
    assert all(eng.runner.step_pages(L) == each for L in range(0, 300, 7))


def test_int32_budget_checked_at_startup(tiny_dir):
    """max_running_requests x topk x max context >= 2**31 fails before serving, with numbers."""
    from eaglekv.errors import ConfigError
    with pytest.raises(ConfigError, match="kv_indices flat offset would overflow int32"):
        spec_engine(tiny_dir, 3, 4, 8, max_running_requests=2**20, max_context_len=2**10)


def test_draft_must_match_target(tiny_dir, tmp_path):
    from eaglekv.errors import ModelLoadError
    from eaglekv.model.draft_checkpoint import random_eagle_draft, save_eagle_draft
    from helpers import make_tiny
    other = tmp_path / "wide"
    make_tiny(other, hidden_size=96)
    eng = tiny_engine(other)
    cfg, sd = random_eagle_draft(eng.model_config)
    save_eagle_draft(tmp_path / "draft", cfg, sd)
    spec = dict(algorithm="eagle", draft_model=str(tmp_path / "draft"), num_steps=2, topk=1,
                num_draft_tokens=3)
    with pytest.raises(ModelLoadError, match="hidden"):
        tiny_engine(tiny_dir, speculative=spec)


def test_bad_draft_slot_fails_only_its_batch(tiny_dir, reference):
    """A corrupted req_to_token entry reaches the draft kv-indices kernel: KVIndexError naming
    the slot and the limit, no K/V written by that step, and the engine serves the next
    request correctly with the allocator back to full."""
    from eaglekv.errors import KVIndexError
    eng = spec_engine(tiny_dir, 3, 2, 6, ps=4, max_running_requests=2)
    req = eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
    for _ in range(3):
        eng.step()
    bad = eng.kv_pool.size_limit + 7
    eng.req_to_token.req_to_token[req.row, 1] = bad
    before_t = [b.clone() for b in eng.kv_pool.k_buffer]
    before_d = eng.worker.drafter.kv_pool.k_buffer[0].clone()
    with pytest.raises(KVIndexError, match=str(bad)) as ei:
        eng.step()
    assert ei.value.limit == eng.kv_pool.size_limit
    assert req.finish_reason == "error"
    for a, b in zip(eng.kv_pool.k_buffer, before_t):
        assert torch.equal(a, b)
    assert torch.equal(eng.worker.drafter.kv_pool.k_buffer[0], before_d)
    eng.check_memory()
    assert eng.allocator.is_full()
    out = eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    assert out.token_ids == reference[1][:20]
    eng.check_memory()
    assert eng.allocator.is_full()


@pytest.mark.parametrize("K,N", [(1, 4), (2, 6)])
def test_mixed_greedy_and_sampling_batch(tiny_dir, reference, K, N):
    """Greedy requests stay token-identical to plain greedy while sampled ones share the batch;
    a seeded sampled request gives the same tokens in two runs."""
    runs = []
    for _ in range(2):
        eng = spec_engine(tiny_dir, 3, K, N, max_running_requests=4)
        params = [SamplingParams(max_new_tokens=20, ignore_eos=True),
                  SamplingParams(max_new_tokens=20, temperature=0.9, seed=11, ignore_eos=True),
                  SamplingParams(max_new_tokens=20, ignore_eos=True),
                  SamplingParams(max_new_tokens=20, temperature=1.2, top_k=5, seed=3,
                                 ignore_eos=True)]
        outs = eng.generate(PROMPTS, params)
        assert outs[0].token_ids == reference[0][:20]
        assert outs[2].token_ids == reference[2][:20]
        runs.append([o.token_ids for o in outs])
        eng.check_memory()
    assert runs[0] == runs[1]


def test_context_edge_and_single_token(tiny_dir):
    """A request that ends exactly at max_context_len (the verify window reaches past it) and a
    request of one new token both work under speculation."""
    plain = tiny_engine(tiny_dir, max_context_len=40)
    eng = spec_engine(tiny_dir, 5, 2, 8, ps=4, max_context_len=40)
    prompt = list(range(3, 30))
    for n in (40 - len(prompt), 1):
        sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
        assert eng.generate(prompt, sp)[0].token_ids == plain.generate(prompt, sp)[0].token_ids
    eng.check_memory()
    assert eng.allocator.is_full()

