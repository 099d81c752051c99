"""The scheduler's fairness rule (eaglekv/engine/fairness.py), CPU, tiny random target:
max-min fair prefill shares (a short prompt beside a long one samples on its first step, the
long one is never starved), fair admission across groups (a single request behind a fan-out
gets the next free row), and outputs unchanged by the scheduling."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from eaglekv import SamplingParams
from eaglekv.engine.fairness import next_to_admit, prefill_shares
from helpers import tiny_engine

rng = random.Random(0)
LONG = [rng.randrange(256) for _ in range(200)]
SHORT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def alone(tiny_dir, prompts, params):
    """Greedy outputs of each prompt run by itself (no chunking, nothing beside it)."""
    eng = tiny_engine(tiny_dir, chunked_prefill_size=None)
    return [eng.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]


# ---- prefill shares ----------------------------------------------------------------------------
@pytest.mark.parametrize("demands,budget,want", [
    ([4000, 5, 300], 512, [254, 5, 253]),      # the docstring's example
    ([10, 20], 100, [10, 20]),                 # everything fits
    ([100, 100, 100], 10, [4, 3, 3]),          # even split, the odd token to the earliest
    ([100, 2, 100], 3, [1, 1, 1]),             # 2 > 3 / 3: everyone needs more than a share
    ([100, 100, 100, 100], 2, [1, 1, 0, 0]),   # less than a token each: the earliest first
    ([50, 60], 0, [0, 0]), ([50], -3, [0]), ([], 8, []),
])
def test_prefill_shares_examples(demands, budget, want):
    assert prefill_shares(demands, budget) == want


def test_prefill_shares_are_max_min_fair():
    r = random.Random(1)
    for _ in range(2000):
        demands = [r.randrange(2, 300) for _ in range(r.randrange(1, 8))]
        budget = r.randrange(-2, 600)
        s = prefill_shares(demands, budget)
        assert all(0 <= x <= d for x, d in zip(s, demands))
        assert sum(s) == min(max(budget, 0), sum(demands))        # the budget is used up
        # nobody short of its demand gets less than anybody else's share, minus one token
        for x, d in zip(s, demands):
            if x < d:
                assert x >= max(s) - 1


# ---- prefill in the engine ---------------------------------------------------------------------
def test_short_prompt_beside_a_long_one_samples_on_its_first_step(tiny_dir):
    """chunked_prefill_size=16: the long prompt (200 tokens) takes 13+ steps; a short one
    arriving together with it, and one arriving mid-prefill beside a decode, each sample their
    first token on the first step they are in; the long one advances every step."""
    eng = tiny_engine(tiny_dir, max_running_requests=4, chunked_prefill_size=16)
    long = eng.add_request(LONG, GREEDY)
    first = eng.add_request(SHORT, GREEDY)
    eng.step()
    assert len(first.output_ids) == 1 and long.kv_len == 16 - len(SHORT)
    for _ in range(2):
        eng.step()
    late = eng.add_request(SHORT[::-1], GREEDY)
    kv = long.kv_len
    eng.step()                        # first decodes, late prefills 5, long takes 16 - 1 - 5
    assert len(late.output_ids) == 1 and long.kv_len == kv + 10
    while eng.has_unfinished():
        kv = long.kv_len
        eng.step()
        assert long.kv_len > kv or long.output_ids       # never starved
    assert [r.output_ids for r in (long, first, late)] == alone(
        tiny_dir, [LONG, SHORT, SHORT[::-1]], [GREEDY] * 3)
    eng.check_memory()
    assert eng.allocator.is_full()


def test_long_prompt_finishes_under_a_stream_of_short_ones(tiny_dir):
    """A new short request every step for 40 steps: the long prompt still gets tokens every
    step and finishes its prefill well before the stream ends."""
    eng = tiny_engine(tiny_dir, max_running_requests=4, chunked_prefill_size=8)
    long = eng.add_request(LONG[:120], SamplingParams(max_new_tokens=2, ignore_eos=True))
    shorts = []
    for i in range(40):
        shorts.append(eng.add_request([i, i + 1, i + 2],
                                      SamplingParams(max_new_tokens=2, ignore_eos=True)))
        kv = long.kv_len
        eng.step()
        assert long.kv_len > kv or long.output_ids
    assert long.finished and all(len(s.output_ids) >= 1 for s in shorts[:-1])
    while eng.has_unfinished():
        eng.step()
    eng.check_memory()


def test_speculative_short_prompt_samples_in_its_first_prefill_step(tiny_dir):
    spec = dict(algorithm="eagle", draft_model="random", num_steps=3, topk=2,
                num_draft_tokens=6)
    eng = tiny_engine(tiny_dir, page_size=4, max_running_requests=4, chunked_prefill_size=16,
                      speculative=spec)
    long = eng.add_request(LONG, GREEDY)
    short = eng.add_request(SHORT, GREEDY)
    eng.step()
    assert len(short.output_ids) == 1 and long.kv_len == 11
    while eng.has_unfinished():
        eng.step()
    assert [long.output_ids, short.output_ids] == alone(tiny_dir, [LONG, SHORT], [GREEDY] * 2)
    eng.check_memory()
    assert eng.allocator.is_full()


# ---- admission ---------------------------------------------------------------------------------
def _req(group, preempted=False):
    return SimpleNamespace(group=group, preempted=preempted)


def test_next_to_admit_order():
    fan = [_req("fan") for _ in range(5)]
    solo, other = _req(("rid", 9)), _req("b")
    assert next_to_admit(fan + [solo], Counter(fan=2)) == 5          # fewest running
    assert next_to_admit(fan + [other, solo], Counter(fan=2, b=1)) == 6
    assert next_to_admit(fan + [other], Counter(fan=2, b=1)) == 5
    assert next_to_admit(fan + [other], Counter(fan=2, b=2)) == 0    # tie: earliest arrival
    assert next_to_admit([_req("fan", True)] + [solo], Counter(fan=3)) == 0   # preempted first


def test_single_request_is_admitted_before_the_rest_of_a_fan_out(tiny_dir):
    """max_running_requests=2, a fan-out of 6 in one group, then one request of its own: the
    first row that frees goes to it, not to the third member of the fan-out."""
    eng = tiny_engine(tiny_dir, max_running_requests=2)
    fan_params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 8, 4, 4, 4, 4)]
    prompts = [[10 + i, 20, 30 + i] for i in range(6)]
    fan = [eng.add_request(p, sp, group="call-1") for p, sp in zip(prompts, fan_params)]
    eng.step()                           # fan[0] and fan[1] take both rows
    solo = eng.add_request(SHORT, GREEDY)
    for _ in range(2):                   # fan[0] ends at step 3
        eng.step()
    assert fan[0].finished and not solo.output_ids
    eng.step()
    assert len(solo.output_ids) == 1                                  # admitted on step 4
    assert all(r.row == 0 and not r.output_ids for r in fan[2:])      # the rest still wait
    while eng.has_unfinished():
        eng.step()
    assert [r.output_ids for r in fan + [solo]] == alone(
        tiny_dir, prompts + [SHORT], fan_params + [GREEDY])
    eng.check_memory()
    assert eng.allocator.is_full()


def test_two_fan_outs_share_the_rows(tiny_dir):
    """Two groups of 6 behind 4 rows, b arriving after all of a: the rows alternate between
    them (2 and 2) at every step while both have requests waiting."""
    eng = tiny_engine(tiny_dir, max_running_requests=4)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    a = [eng.add_request([1, 2, i], sp, group="a") for i in range(6)]
    b = [eng.add_request([3, 4, i], sp, group="b") for i in range(6)]
    while any(r.row == 0 and not r.finished for r in a) \
            and any(r.row == 0 and not r.finished for r in b):
        assert Counter(r.group for r in eng.step()) == Counter(a=2, b=2)
    while eng.has_unfinished():
        eng.step()
    assert all(r.finish_reason == "length" for r in a + b)
    eng.check_memory()
