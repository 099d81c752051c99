"""Seeded random schedules (CPU, fp32, tiny random target): requests arrive at random steps with
random prompt lengths and budgets, some are sampled, some are aborted while queued or
mid-step, some greedy ones stop at a stop id (a token their reference emits), the KV pool is
small enough that the engine preempts and recomputes, and prompts are prefilled whole or in
chunks of 3 or 16 tokens. Plain decoding, every speculative family and adaptive speculation,
page sizes 1 and 4.

Checked after every step: the allocator's and the row pool's books balance and agree with the
requests' req_to_token rows (each slot in use is one request's), and every greedy
request's output so far is a prefix of its plain greedy reference (so a request whose KV another
one overwrote shows up at the step it happens). At the end: every greedy request that was not
aborted equals its reference (cut after its stop id, finish_reason "stop"), sampled ones have
their full length, aborted ones hold a prefix of theirs, and every slot and row is free again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from eaglekv import SamplingParams
from helpers import spec, tiny_engine

MAX_NEW = 32
SEEDS = [0, 1, 2]
CONFIGS = {"plain": None, "eagle_chain": spec("eagle", 3, 1, 4),
           "eagle_tree": spec("eagle", 3, 2, 6), "eagle_wide": spec("eagle", 2, 4, 7),
           "eagle3_tree": spec("eagle3", 3, 2, 6), "multi_layer": spec("multi_layer_eagle", 3),
           # plain, speculative and split steps by the policy (fixed costs close to even)
           "adaptive": dict(algorithm="eagle", draft_model="random", adaptive=True,
                            shapes=((3, 1, 4), (2, 2, 4)))}


@dataclass
class Planned:
    prompt: list[int]
    max_new: int
    arrival: int                 # step at which it is added
    abort_at: int | None         # step at which it is aborted (None: never)
    sampled: bool
    stop_at: int | None = None   # greedy: its reference token at this index is a stop id


def plan(seed: int, n: int = 10) -> list[Planned]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        abort_at = rng.randrange(0, 25) if rng.random() < 0.25 else None
        max_new = rng.randint(1, MAX_NEW)
        out.append(Planned(prompt=[rng.randrange(256) for _ in range(rng.randint(1, 40))],
                           max_new=max_new, arrival=rng.randrange(0, 12),
                           abort_at=abort_at, sampled=rng.random() < 0.2,
                           stop_at=rng.randrange(max_new) if rng.random() < 0.3 else None))
    return out


@pytest.fixture(scope="module")
def references(deep_dir):  # noqa: F811
    """Plain greedy continuations of every planned prompt, on an engine with room to spare."""
    eng = tiny_engine(deep_dir, max_running_requests=8)
    refs = {}
    for seed in SEEDS:
        prompts = [p.prompt for p in plan(seed)]
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        refs[seed] = [o.token_ids for o in outs]
    return refs



@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_random_schedule(deep_dir, references, config, ps, seed):  # noqa: F811
    rng = random.Random(1000 + seed)
    planned, refs = plan(seed), references[seed]
    extra = {} if CONFIGS[config] is None else {"speculative": CONFIGS[config]}
    eng = tiny_engine(deep_dir, page_size=ps, max_running_requests=rng.choice([3, 4, 6]),
                      max_total_tokens=128, chunked_prefill_size=rng.choice([None, 3, 16]),
                      # admission held back (TGI's rule) in some schedules
                      waiting_served_ratio=rng.choice([0.0, 0.0, 0.5, 2.0]),
                      max_waiting_steps=rng.choice([1, 4]), **extra)
    if config == "adaptive":
        from eaglekv.speculative.adaptive import CostTable
        eng.runner.policy.costs = CostTable.fixed({"plain": 1.0, "S3K1N4": 1.5, "S2K2N4": 1.5})
    reqs: dict[int, object] = {}
    step = 0
    while step < 12 or eng.has_unfinished():
        for i, p in enumerate(planned):
            if p.arrival == step:
                stop = () if p.stop_at is None or p.sampled else (refs[i][p.stop_at],)
                params = (SamplingParams(max_new_tokens=p.max_new, temperature=0.8, seed=i,
                                         ignore_eos=True) if p.sampled else
                          SamplingParams(max_new_tokens=p.max_new, ignore_eos=True,
                                         stop_token_ids=stop))
                reqs[i] = eng.add_request(p.prompt, params)
            if p.abort_at == step and i in reqs:
                eng.abort(reqs[i])
        if eng.has_unfinished():
            eng.step()
        eng.check_memory()
        for i, r in reqs.items():
            if not planned[i].sampled:
                assert r.output_ids == refs[i][:len(r.output_ids)], \
                    f"request {i} diverged from its reference at step {step}"
        step += 1
        assert step < 2000, "the schedule does not finish"
    assert len(reqs) == len(planned)
    for i, r in reqs.items():
        p = planned[i]
        if r.finish_reason == "abort":
            assert p.abort_at is not None and len(r.output_ids) < p.max_new
            continue
        if p.sampled:
            assert r.finish_reason == "length" and len(r.output_ids) == p.max_new
            assert all(0 <= t < 256 for t in r.output_ids)
            continue
        want = refs[i][:p.max_new]
        if p.stop_at is not None:     # ends at the first occurrence of the stop id, kept
            want = want[:want.index(want[p.stop_at]) + 1]
        assert r.output_ids == want
        assert r.finish_reason == ("stop" if p.stop_at is not None else "length")
    assert eng.allocator.is_full()
    assert not eng.running and not eng.waiting
    eng.check_memory()
    if config == "adaptive":      # the schedule mixed the kinds of step
        counts = eng.spec_stats().choices
        assert counts.get("plain", 0) and sum(v for k, v in counts.items() if k != "plain"), \
            counts


def test_check_memory_sees_a_foreign_or_orphaned_slot(deep_dir):
    """The between-steps books (used by every schedule above): a request whose row points at
    another request's slot, and a slot in use by nobody, are both reported."""
    eng = tiny_engine(deep_dir, max_running_requests=2)
    a, b = (eng.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True))
            for p in ([1, 2, 3, 4], [5, 6, 7]))
    eng.step()
    eng.step()
    eng.check_memory()
    r2t = eng.req_to_token.req_to_token
    saved = r2t[b.row, 0].clone()
    r2t[b.row, 0] = r2t[a.row, 1]                    # b's first token "is" a's second slot
    with pytest.raises(AssertionError, match="two requests"):
        eng.check_memory()
    r2t[b.row, 0] = saved
    stray = eng.allocator.alloc(1)
    with pytest.raises(AssertionError, match="in use by no request"):
        eng.check_memory()
    eng.allocator.free(stray)
    eng.check_memory()


@pytest.mark.parametrize("speculative", [None, spec("eagle", 3, 1, 4)], ids=["plain", "eagle"])
def test_waiting_served_ratio_holds_newcomers_then_prefills_them_together(deep_dir,  # noqa: F811
                                                                          speculative):
    """TGI's admission rule: with 4 requests decoding and waiting_served_ratio 0.5, one
    newcomer waits (1 < 0.5 * 4); a second makes two, and both are admitted at the next step
    and prefilled in one step; a lone newcomer is admitted after max_waiting_steps held steps.
    Greedy outputs equal an engine that admits at once."""
    extra = {} if speculative is None else {"speculative": speculative}
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = [[5, 17, 42], list(range(1, 12)), [9] * 7, [3, 1, 4, 1, 5], [8, 8, 2], [7, 6]]
    want = [o.token_ids for o in tiny_engine(deep_dir, max_running_requests=8, **extra)
            .generate(prompts, sp)]
    eng = tiny_engine(deep_dir, max_running_requests=8, waiting_served_ratio=0.5,
                      max_waiting_steps=3, **extra)
    reqs = [eng.add_request(p, sp) for p in prompts[:4]]
    while any(not r.output_ids for r in reqs):
        eng.step()
    late = eng.add_request(prompts[4], sp)
    eng.step()
    assert late in eng.waiting and not late.output_ids                # held: 1 < 0.5 * 4
    last = eng.add_request(prompts[5], sp)
    eng.step()                                                          # 2 >= 2: admitted
    assert late not in eng.waiting and last not in eng.waiting
    steps = 0
    while not (late.output_ids and last.output_ids):
        eng.step()
        steps += 1
    assert steps <= 2 and len(late.output_ids) == len(last.output_ids)  # one prefill step
    reqs += [late, last]
    while eng.has_unfinished():
        eng.step()
    assert [r.output_ids for r in reqs] == want
    lone = tiny_engine(deep_dir, max_running_requests=8, waiting_served_ratio=0.5,
                       max_waiting_steps=3, **extra)
    first = [lone.add_request(p, sp) for p in prompts[:4]]
    while any(not r.output_ids for r in first):
        lone.step()
    r = lone.add_request(prompts[4], sp)
    held = 0
    while r in lone.waiting:
        lone.step()
        held += 1
    assert held == 4                     # 3 steps held, admitted at the 4th
    while lone.has_unfinished():
        lone.step()
    assert r.output_ids == want[4]
    assert lone.allocator.is_full() and eng.allocator.is_full()


@pytest.mark.parametrize("bad", [dict(waiting_served_ratio=-0.5),
                                 dict(waiting_served_ratio=float("inf")),
                                 dict(max_waiting_steps=0)])
def test_waiting_served_ratio_bad_values_name_themselves(bad):
    from eaglekv.config import EngineConfig
    from eaglekv.errors import ConfigError
    name = next(iter(bad))
    with pytest.raises(ConfigError, match=name):
        EngineConfig(**bad)
