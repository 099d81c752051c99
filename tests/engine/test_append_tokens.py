"""Req.append_tokens' list fast path (no stop strings, no logprobs) and Req.tokens_kept (the
same count without appending) against the token-by-token loop, over random token runs, stop
sets, limits and lengths so far."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglekv.config import SamplingParams
from eaglekv.engine.request import Req

TOK = st.integers(0, 12)


def req(params: SamplingParams, done: list[int]) -> Req:
    return Req(rid=0, prompt_ids=[1, 2], params=params, generator=torch.Generator(),
               eos_ids=frozenset({0, 3}), output_ids=list(done))


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(TOK, max_size=9), done=st.lists(TOK, max_size=6),
       max_new=st.integers(1, 12), stop_ids=st.lists(TOK, max_size=3), ignore_eos=st.booleans())
def test_fast_path_equals_the_token_loop(tokens, done, max_new, stop_ids, ignore_eos):
    p = SamplingParams(max_new_tokens=max_new, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    fast, loop = req(p, done), req(p, done)
    ahead = fast.tokens_kept(tokens)     # what a chain's stats count, nothing appended
    assert fast.output_ids == list(done) and fast.finish_reason is None
    kept = fast.append_tokens(tokens)
    want = loop.append_tokens(tokens, [None] * len(tokens))     # logprobs: the loop
    assert kept == want == ahead
    assert fast.output_ids == loop.output_ids
    assert fast.finish_reason == loop.finish_reason


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(TOK, min_size=1, max_size=7), done=st.lists(TOK, max_size=6),
       data=st.data())
def test_pending_ids_without_joining_the_sequence(prompt, done, data):
    """pending_ids / num_pending / num_ids (the scheduler's per-step reads, which no longer
    join prompt and output) equal their definitions over the whole sequence, at every
    cached length from an empty cache to all of it."""
    r = Req(rid=0, prompt_ids=list(prompt), params=SamplingParams(), generator=None,
            eos_ids=frozenset(), output_ids=list(done))
    r.kv_len = data.draw(st.integers(0, len(prompt) + len(done)))
    whole = list(prompt) + list(done)
    assert r.num_ids == len(whole)
    assert r.pending_ids == whole[r.kv_len:]
    assert r.num_pending == len(whole) - r.kv_len
