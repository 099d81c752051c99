"""EAGLE on the default SmolLM2 model (CPU, fp32): speculative greedy output is token-identical
to plain greedy, with a random draft head (topk 1 chain and a topk 2 tree, page sizes 1 and
16) and, when it ships, the trained default draft."""

from __future__ import annotations

import pytest

from eaglekv import Engine, EngineConfig, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def plain(smol_engine):
    ids = [smol_engine.encode(p) for p in PROMPTS]
    outs = smol_engine.generate(ids, SamplingParams(max_new_tokens=32, ignore_eos=True))
    return ids, [o.token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("S,K,N,ps", [(3, 1, 4, 1), (2, 2, 4, 16)])
def test_smollm2_spec_greedy_equals_plain(plain, S, K, N, ps):
    ids, ref = plain
    eng = Engine(EngineConfig(model="default", max_total_tokens=1024, max_running_requests=2,
                              page_size=ps, speculative=dict(
                                  algorithm="eagle", draft_model="random", num_steps=S, topk=K,
                                  num_draft_tokens=N)))
    outs = eng.generate(ids, SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    assert all(o.spec.verify_steps > 0 for o in outs)
    eng.check_memory()
    assert eng.allocator.is_full()


@pytest.mark.slow
def test_smollm2_default_draft_stop_string_and_stream(smol_engine):
    """The shipped draft accepts multi-token runs; a stop string inside a run truncates the
    output exactly where plain decoding does, and streaming yields the same text."""
    eng = Engine(EngineConfig(model="default", max_total_tokens=1024, max_running_requests=1,
                              speculative=dict(algorithm="eagle", draft_model="default",
                                                   num_steps=3)))
    ids = smol_engine.encode("def fibonacci(n):")
    free = smol_engine.generate([ids], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2:][:4]       # a string from the middle of the output
    sp = SamplingParams(max_new_tokens=40, stop=(stop,))
    want = smol_engine.generate([ids], sp)[0]
    got = eng.generate([ids], sp)[0]
    assert got.text == want.text and got.finish_reason == want.finish_reason == "stop"
    assert got.token_ids == want.token_ids
    assert got.spec.accept_length_mean > 1.2
    assert "".join(d.text for d in eng.stream(ids, sp)) == want.text
    eng.check_memory()
    assert eng.allocator.is_full()


@pytest.mark.slow
@pytest.mark.parametrize("S,K,N", [(5, 1, 6), (4, 2, 8)])
def test_smollm2_shipped_eagle3_head_is_lossless_and_accepted(plain, S, K, N):
    """`algorithm="eagle3", draft_model="default"`: the EAGLE-3 head trained by `eaglekv
    train-draft` (eaglekv/drafts/smollm2-135m-instruct-eagle3) loads with its 16384-token draft
    vocabulary, greedy output equals plain greedy, and its drafts get accepted."""
    ids, ref = plain
    eng = Engine(EngineConfig(model="default", max_total_tokens=1024, max_running_requests=2,
                              speculative=dict(algorithm="eagle3", draft_model="default",
                                               num_steps=S, topk=K, num_draft_tokens=N)))
    assert eng.runner.drafter.model.cfg.draft_vocab_size == 16384
    outs = eng.generate(ids, SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    assert sum(o.spec.accepted_tokens for o in outs) / sum(o.spec.verify_steps for o in outs) > 0.5
    eng.check_memory()
    assert eng.allocator.is_full()
