"""Chunked prefill (CPU, fp32, tiny random targets): a prompt longer than
`chunked_prefill_size` is prefilled over several steps while the other requests keep decoding;
outputs, logprobs and the cached K/V are those of an unchunked prefill, for plain decoding and
every speculative family."""

from __future__ import annotations

import random

import pytest
import torch

from eaglekv import SamplingParams
from eaglekv.errors import ConfigError
from helpers import fresh_kv, spec, tiny_engine

rng = random.Random(0)
LONG = [[rng.randrange(256) for _ in range(n)] for n in (90, 3, 57, 130)]
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=1) for n in (12, 20, 9, 15)]


@pytest.fixture(scope="module")
def unchunked(deep_dir):  # noqa: F811
    eng = tiny_engine(deep_dir, max_running_requests=4, chunked_prefill_size=None)
    return eng.generate(LONG, PARAMS)


def assert_same(outs, refs):
    for o, r in zip(outs, refs):
        assert o.token_ids == r.token_ids
        assert [lp.logprob for lp in o.logprobs] == pytest.approx(
            [lp.logprob for lp in r.logprobs], abs=1e-4)


@pytest.mark.parametrize("chunk", [1, 7, 32, 256])
@pytest.mark.parametrize("ps", [1, 4])
def test_plain_chunked_equals_unchunked(deep_dir, unchunked, chunk, ps):  # noqa: F811
    eng = tiny_engine(deep_dir, page_size=ps, max_running_requests=4, chunked_prefill_size=chunk)
    assert_same(eng.generate(LONG, PARAMS), unchunked)
    eng.check_memory()
    assert eng.allocator.is_full()


@pytest.mark.parametrize("alg,S,K,N", [("eagle", 3, 1, 4), ("eagle", 3, 2, 6),
                                       ("eagle3", 3, 2, 6), ("multi_layer_eagle", 3, 1, 4)])
@pytest.mark.parametrize("chunk", [5, 64])
def test_speculative_chunked_equals_unchunked(deep_dir, unchunked, alg, S, K, N, chunk):  # noqa: F811
    eng = tiny_engine(deep_dir, page_size=4, max_running_requests=4, chunked_prefill_size=chunk,
                      speculative=spec(alg, S, K, N))
    assert_same(eng.generate(LONG, PARAMS), unchunked)
    eng.check_memory()
    assert eng.allocator.is_full()


def test_decodes_continue_during_a_long_prefill(deep_dir):  # noqa: F811
    """With 8 tokens a step, a 130-token prompt takes 19 steps to prefill (7 a step beside a
    decode); the decoding request gets a token every one of those steps, and the K/V of both
    equal a fresh prefill of what they hold at every step."""
    eng = tiny_engine(deep_dir, max_running_requests=2, chunked_prefill_size=8)
    a = eng.add_request(LONG[1], SamplingParams(max_new_tokens=40, ignore_eos=True))
    eng.step()
    assert a.output_ids and a.kv_len == len(LONG[1])
    b = eng.add_request(LONG[3], SamplingParams(max_new_tokens=4, ignore_eos=True))
    steps = 0
    while not b.output_ids:
        n_a, kv_b = len(a.output_ids), b.kv_len
        eng.step()
        steps += 1
        assert len(a.output_ids) == n_a + 1                 # a decoded this step
        assert b.kv_len - kv_b == min(7, len(LONG[3]) - kv_b)
        for r in (a, b):
            ids = r.all_ids[:r.kv_len]
            slots = eng.req_to_token.req_to_token[r.row, :r.kv_len].to(torch.int64)
            pool, fslots, *_ = fresh_kv(eng.model, ids)
            for layer in range(eng.model.cfg.num_layers):
                torch.testing.assert_close(eng.kv_pool.k_buffer[layer][slots],
                                           pool.k_buffer[layer][fslots], atol=1e-4, rtol=1e-4)
    assert steps == -(-len(LONG[3]) // 7)
    ref = tiny_engine(deep_dir).generate(LONG[3], SamplingParams(max_new_tokens=4,
                                                                 ignore_eos=True))[0]
    while eng.has_unfinished():
        eng.step()
    assert b.output_ids == ref.token_ids
    eng.check_memory()


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_chunk_size_refused(deep_dir, bad):  # noqa: F811
    with pytest.raises(ConfigError, match=rf"chunked_prefill_size={bad!r} must be an int >= 1"):
        tiny_engine(deep_dir, chunked_prefill_size=bad)


@pytest.mark.parametrize("alg", ["eagle", "multi_layer_eagle"])
def test_speculative_decodes_alternate_with_prefill_chunks(deep_dir, alg):  # noqa: F811
    """While a long prompt is prefilled chunk by chunk, the speculative worker alternates
    prefill and verify steps: the decoding request gets a verify step between every two
    chunks, and both stay lossless."""
    refs = tiny_engine(deep_dir, max_running_requests=2).generate(
        [LONG[1], LONG[3]], SamplingParams(max_new_tokens=30, ignore_eos=True))
    eng = tiny_engine(deep_dir, max_running_requests=2, chunked_prefill_size=8,
                      speculative=spec(alg, 3))
    p = SamplingParams(max_new_tokens=30, ignore_eos=True)
    a = eng.add_request(LONG[1], p)
    eng.step()
    b = eng.add_request(LONG[3], p)
    verify_before = a.spec_stats.verify_steps
    chunks = 0
    while not b.output_ids:
        kv_b = b.kv_len
        eng.step()
        chunks += b.kv_len > kv_b
    assert chunks == -(-len(LONG[3]) // 8)
    assert a.spec_stats.verify_steps - verify_before >= chunks - 1
    while eng.has_unfinished():
        eng.step()
    assert [a.output_ids, b.output_ids] == [r.token_ids for r in refs]
    eng.check_memory()
