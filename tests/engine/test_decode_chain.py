"""Multi-step decode (`num_scheduler_steps`): k greedy steps per engine step, the argmax fed
back on the device, one sync. Checked on CPU through DecodeGraphs' static buffers with
`capture=False` under the Triton interpreter (the GPU tests replay the real graphs): tokens
equal to single-step decoding, stops inside a chain, a short pool, a request whose logits
go bad mid-chain, a bad chain slot refused before anything is written, and the books
balanced after every step."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton and the kernel modules are imported
pytest.importorskip("triton")

from eaglekv import ConfigError, EngineConfig, KVIndexError, SamplingParams  # noqa: E402
from eaglekv.cuda_graph import DecodeGraphs  # noqa: E402
from helpers import tiny_engine  # noqa: E402

PROMPTS = [[5, 17, 42], list(range(1, 12)), [9] * 7]
pytestmark = [] if not ON_GPU else pytest.mark.skip("the GPU tests capture the real graphs")


@pytest.fixture(autouse=True)
def _interpret_only_here(monkeypatch):
    monkeypatch.setenv("EAGLEKV_TRITON_ON_CPU", "1")


def chain_engine(tiny_dir, steps: int, chain_graph: bool = False, **options):
    """A context of 64 (prompts and their 12 tokens fit): the graph's split-K follows the
    context limit, and under the Triton interpreter every split costs its program's time.
    `chain_graph`: a chain of `steps` runs as one forward of the whole chain (the chain graph
    of `cuda_graph.CHAIN_GRAPH_MAX_BATCH`) at every bucket."""
    options.setdefault("max_running_requests", 4)
    options.setdefault("max_context_len", 64)
    engine = tiny_engine(tiny_dir, attention_backend="triton", **options)
    engine.runner.graphs = DecodeGraphs(engine.model, engine.backend,
                                        engine.config.max_running_requests,
                                        engine.max_context_len, progress=False, capture=False,
                                        chain_steps=steps if chain_graph else 0,
                                        chain_graph_max_batch=64)
    engine.runner.decode_steps = steps
    return engine


def run_checked(engine, prompts, params):
    """generate(), checking the books between steps; -> (outputs, engine steps)."""
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    while engine.scheduler.has_unfinished():
        engine.step()
        engine.check_memory()
        steps += 1
    assert engine.allocator.is_full()
    return reqs, steps


@pytest.fixture(scope="module")
def reference(tiny_dir):
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    return [o.token_ids for o in tiny_engine(tiny_dir, max_running_requests=4).generate(
        PROMPTS, sp)]


def test_config():
    assert EngineConfig().decode_steps == 1                     # CPU: no graphs, no chains
    assert EngineConfig(num_scheduler_steps=4).decode_steps == 4
    with pytest.raises(ConfigError, match="num_scheduler_steps=0 must be an int >= 1"):
        EngineConfig(num_scheduler_steps=0)


@pytest.mark.parametrize("steps,page_size,fused,chain_graph",
                         [(8, 1, False, False), (3, 4, False, False), (8, 1, True, False),
                          (3, 4, False, True), (4, 1, False, True)])
def test_chain_equals_single_steps(tiny_dir, reference, steps, page_size, fused, chain_graph,
                                   monkeypatch):
    """Different budgets per request (the chain shrinks to the smallest left), batch 3 in
    the 4-row bucket, then fewer rows as requests finish: the same tokens, fewer steps.
    `fused`: the layers run the norm_matmul kernel (off by default). `chain_graph`: the
    chains of the full length run as one forward of the chain (the rest replay step by
    step): both kinds ran."""
    from eaglekv.kernels import fused as fused_ops
    monkeypatch.setattr(fused_ops, "FUSE_NORM_MATMUL", fused)
    engine = chain_engine(tiny_dir, steps, chain_graph, page_size=page_size)
    graphs = engine.runner.graphs
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 5, 9)]
    reqs, nsteps = run_checked(engine, PROMPTS, params)
    assert [r.output_ids for r in reqs] == [ref[:p.max_new_tokens]
                                            for ref, p in zip(reference, params)]
    assert [r.finish_reason for r in reqs] == ["length"] * 3
    assert nsteps < 12                     # one step a token: 12 (the prefill samples one)
    if chain_graph:
        assert graphs.chain_graph_replays >= 1
        assert graphs.replays > graphs.chain_graph_replays     # and shorter chains replayed
    else:
        assert graphs.chain_graph_replays == 0


def test_stop_inside_a_chain(tiny_dir, reference):
    """A stop id emitted mid-chain: the output ends at it (finish_reason stop), the tokens the
    chain decoded after it are dropped and their slots freed; the others go on."""
    stop = reference[1][5]
    first = reference[1].index(stop)
    engine = chain_engine(tiny_dir, 8)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop]),
              SamplingParams(max_new_tokens=12, ignore_eos=True)]
    reqs, _ = run_checked(engine, PROMPTS, params)
    assert reqs[1].output_ids == reference[1][:first + 1]
    assert reqs[1].finish_reason == "stop"
    assert [reqs[0].output_ids, reqs[2].output_ids] == [reference[0], reference[2]]


def test_short_pool_shortens_the_chain(tiny_dir, reference):
    """Fewer free slots than a whole chain needs: the chain takes what there is (it never
    preempts) and the output is unchanged."""
    engine = chain_engine(tiny_dir, 8, max_total_tokens=40, max_running_requests=3)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reqs, _ = run_checked(engine, PROMPTS, [sp] * 3)
    assert [r.output_ids for r in reqs] == reference


@pytest.mark.parametrize("chain_graph", [False, True])
def test_bad_logits_mid_chain_fail_one_request(tiny_dir, reference, chain_graph):
    """Request 1's argmax turns unusable at the 3rd step of a chain: it fails alone with the
    tokens it made before, its chain slots go back; the others are unchanged."""
    engine = chain_engine(tiny_dir, 4, chain_graph)
    graphs = engine.runner.graphs
    forward, calls = graphs._forward_on, []

    def poisoned(*inputs):
        logits, greedy = forward(*inputs)
        calls.append(inputs[0].shape[0])
        if len(calls) == 3:
            greedy[1, 1] = 0                     # "argmax not valid" for row 1
        return logits, greedy
    graphs._forward_on = poisoned
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reqs = [engine.add_request(p, sp) for p in PROMPTS]
    while not calls:                             # the prefill, then the first chain
        engine.step()
        engine.check_memory()
    assert reqs[1].finish_reason == "error"
    assert reqs[1].output_ids == reference[1][:3]   # prefill's token + 2 chain steps
    while engine.scheduler.has_unfinished():
        engine.step()
        engine.check_memory()
    assert [reqs[0].output_ids, reqs[2].output_ids] == [reference[0][:12], reference[2][:12]]
    assert engine.allocator.is_full()
    assert (graphs.chain_graph_replays >= 1) == chain_graph


@pytest.mark.parametrize("chain_graph", [False, True])
def test_bad_chain_slot_is_refused(tiny_dir, reference, chain_graph):
    """A chain step's slot past the pool: KVIndexError naming the chain's out_cache_loc and
    the value, raised before any replay (nothing written); the engine serves the next
    request exactly."""
    engine = chain_engine(tiny_dir, 4, chain_graph, max_total_tokens=256)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    reqs = [engine.add_request(p, sp) for p in PROMPTS[:2]]
    engine.step()                                           # the prefill
    limit = engine.kv_pool.size_limit
    real = engine.allocator.alloc_decode_steps

    def bad(seq_lens, last_slots, m):
        s = real(seq_lens, last_slots, m)                   # (m, n): the chain's steps 1..m
        engine.allocator.free(s[0, 1:])
        s[0, 1:] = limit + 3                                # the chain's second step
        return s
    engine.allocator.alloc_decode_steps = bad
    before = engine.kv_pool.kv.clone()
    replays = engine.runner.graphs.replays
    with pytest.raises(KVIndexError, match=rf"slot {limit + 3} out of range \[0, {limit}\) "
                                           r"in decode chain out_cache_loc"):
        engine.step()
    assert engine.runner.graphs.replays == replays          # refused before the first replay
    assert torch.equal(engine.kv_pool.kv, before)
    engine.allocator.alloc_decode_steps = real
    assert all(r.finished for r in reqs)
    assert engine.allocator.is_full()
    engine.check_memory()
    out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert out[0].token_ids == reference[0]


@pytest.mark.parametrize("horizon,explore", [(1, False), (3, False), (1, True)])
def test_adaptive_plain_chains_run_the_policy_horizon(tiny_dir, reference, horizon, explore):
    """An adaptive engine at batch 1 whose policy chooses plain decoding: each all-plain
    step decodes a chain as long as the policy's `plain_horizon` (1: a single step), not
    num_scheduler_steps, or, exploring the chain's cost, at least EXPLORE_CHAIN tokens (a
    one-token step would leave the chain cell unknown); greedy output equal to plain
    decoding, the books whole after."""
    from eaglekv.speculative.adaptive_worker import EXPLORE_CHAIN
    from eaglekv.speculative.adaptive import Choice
    engine = tiny_engine(tiny_dir, attention_backend="triton", max_running_requests=4,
                         max_context_len=64,
                         speculative=dict(algorithm="eagle", draft_model="random",
                                          adaptive=True, shapes=((3, 1, 4),)))
    w = engine.runner
    w.graphs = DecodeGraphs(engine.model, engine.backend, 4, engine.max_context_len,
                            progress=False, capture=False, features=w.drafter,
                            feature_table=w.feature_table,
                            req_to_token=engine.req_to_token.req_to_token)
    w.decode_steps = 8
    pol = w.policy
    pol.choose = lambda reqs, chain=False: pol._chosen(Choice(None, [], list(range(len(reqs))),
                                                              explore=explore))
    asked = []
    pol.plain_horizon = lambda reqs, longest: asked.append(longest) or horizon
    made = []
    observe = pol.observe_plain
    pol.observe_plain = lambda reqs, tokens=1: made.append(tokens) or observe(reqs, tokens)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reqs, _ = run_checked(engine, PROMPTS[:1], [sp])
    assert reqs[0].output_ids == reference[0]
    assert asked and set(asked) == {8}
    # 11 tokens after the prefill's: chains of `horizon` (the last one what the budget left)
    each = min(8, EXPLORE_CHAIN) if explore else horizon
    assert made[:-1] == [each] * (len(made) - 1) and sum(made) == 11, made
    engine.check_memory()


# ---- one request's prefill replayed (cuda_graph.PrefillGraphs) ---------------------------------
def prefill_engine(tiny_dir, max_tokens: int = 32, max_reqs: int = 16, max_groups: int = 4,
                   **options):
    from eaglekv.cuda_graph import PrefillGraphs
    options.setdefault("max_running_requests", 4)
    options.setdefault("max_context_len", 64)
    engine = tiny_engine(tiny_dir, attention_backend="triton", **options)
    engine.runner.prefill_graphs = PrefillGraphs(engine.model, engine.backend, max_tokens,
                                                 engine.max_context_len, progress=False,
                                                 capture=False, max_reqs=max_reqs,
                                                 max_groups=max_groups)
    return engine


def test_prefill_buckets():
    from eaglekv.cuda_graph import prefill_buckets
    assert prefill_buckets(100) == (16, 32, 64, 100)
    assert prefill_buckets(16) == (16,) and prefill_buckets(8) == (8,)
    with pytest.raises(ConfigError, match=r"cuda_graph_prefill_tokens=-1 must be an int in "
                                          r"\[0, 4096\]"):
        EngineConfig(cuda_graph_prefill_tokens=-1)
    with pytest.raises(ConfigError, match="cuda_graph_prefill_tokens=True"):
        EngineConfig(cuda_graph_prefill_tokens=True)


def test_prefill_graphs_default_follows_the_decode_graphs(monkeypatch):
    """cuda_graph_prefill_tokens=None (the default) replays prefills of up to 256 tokens
    where decode steps replay graphs (CUDA, Triton attention, not disabled), and none
    elsewhere; an explicit value is kept."""
    from eaglekv.config import DEFAULT_PREFILL_GRAPH_TOKENS
    assert EngineConfig().cuda_graph_prefill_tokens is None
    assert EngineConfig(device="cpu").prefill_graph_tokens == 0
    assert EngineConfig(device="cpu", cuda_graph_prefill_tokens=64).prefill_graph_tokens == 64
    monkeypatch.setattr(EngineConfig, "cuda_graphs", property(lambda self: True))
    assert EngineConfig().prefill_graph_tokens == DEFAULT_PREFILL_GRAPH_TOKENS == 256
    assert EngineConfig(cuda_graph_prefill_tokens=0).prefill_graph_tokens == 0


@pytest.mark.parametrize("chunk,page_size", [(None, 1), (4, 4)])
def test_prefill_graph_equals_the_eager_prefill(tiny_dir, reference, chunk, page_size):
    """Each prompt prefilled alone through the prefill graph (whole, or in chunks of 4 over
    its cached prefix in pages of 4, the last chunk sampling): the same tokens as plain
    decoding, the request's K/V equal to an eager prefill's, and no other slot but the
    padding page's written (the padding tokens write slot 0 only; earlier requests' K/V
    stay)."""
    engine = prefill_engine(tiny_dir, 16, chunked_prefill_size=chunk, page_size=page_size)
    eager = tiny_engine(tiny_dir, max_running_requests=4, max_context_len=64,
                        chunked_prefill_size=chunk, page_size=page_size)   # the torch path
    g = engine.runner.prefill_graphs
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    buffers = engine.kv_pool.k_buffer + engine.kv_pool.v_buffer
    for prompt, ref in zip(PROMPTS, reference):
        mine, theirs = engine.add_request(prompt, sp), eager.add_request(prompt, sp)
        before = [b.clone() for b in buffers]
        while not mine.output_ids:
            engine.step()
        while not theirs.output_ids:
            eager.step()
        a = engine.req_to_token.req_to_token[mine.row, :mine.kv_len].long()
        b = eager.req_to_token.req_to_token[theirs.row, :theirs.kv_len].long()
        for x, y in zip(buffers, eager.kv_pool.k_buffer + eager.kv_pool.v_buffer):
            torch.testing.assert_close(x[a], y[b], rtol=1e-5, atol=1e-5)
        others = torch.ones(buffers[0].shape[0], dtype=torch.bool)
        others[a] = False
        others[0] = False                                 # the padding page
        assert all(torch.equal(x[others], y[others]) for x, y in zip(before, buffers))
        while not mine.finished:
            engine.step()
        assert mine.output_ids == ref[:4]
        engine.check_memory()
    assert g.replays == (3 if chunk is None else 6)  # prompts of 3, 11, 7: [3] [4 4 3] [4 3]
    assert engine.allocator.is_full()


def test_prefill_graph_groups(tiny_dir, monkeypatch):
    """A step's extends packed into replays: runs of consecutive requests of at most
    max_reqs requests and one token fewer than the largest bucket; none for an empty or
    too long request, or past PREFILL_GRAPH_MAX_GROUPS replays (then the step runs eagerly)."""
    from eaglekv import cuda_graph
    from eaglekv.cuda_graph import PREFILL_GRAPH_MAX_GROUPS, PrefillGraphs
    engine = tiny_engine(tiny_dir, attention_backend="triton", max_context_len=64)
    make = lambda **kw: PrefillGraphs(engine.model, engine.backend, 16, 64,  # noqa: E731
                                      progress=False, capture=False, **kw)
    # packing on by default (2026-12-08); off: one request a replay, one replay a step
    on = make()
    assert (on.max_reqs, on.max_groups) == (16, PREFILL_GRAPH_MAX_GROUPS)
    monkeypatch.setattr(cuda_graph, "PREFILL_GRAPH_PACK", False)
    off = make()
    assert (off.max_reqs, off.max_groups) == (1, 1)
    assert off.groups([3]) == [range(0, 1)] and off.groups([3, 4]) is None
    monkeypatch.setattr(cuda_graph, "PREFILL_GRAPH_PACK", True)
    assert on.groups([3, 4]) == [range(0, 2)]
    g = make(max_reqs=2)
    assert g.groups([3, 11, 7]) == [range(0, 2), range(2, 3)]     # 3 + 11 <= 15 < 3 + 11 + 7
    assert g.groups([3, 1, 1]) == [range(0, 2), range(2, 3)]      # two requests a replay
    assert g.groups([15]) == [range(0, 1)] and g.groups([1]) == [range(0, 1)]
    assert g.groups([16]) is None and g.groups([3, 0]) is None and g.groups([]) is None
    assert len(g.groups([15] * PREFILL_GRAPH_MAX_GROUPS)) == PREFILL_GRAPH_MAX_GROUPS
    assert g.groups([15] * (PREFILL_GRAPH_MAX_GROUPS + 1)) is None
    assert g.fits([8, 7]) and not g.fits([8, 8, 8, 8, 8, 8, 8, 8, 8])
    with pytest.raises(ValueError, match=r"prefill graphs: 1 requests of 16 tokens do not fit"):
        g.run([[1] * 16], [0], [1], [torch.zeros(16, dtype=torch.int64).numpy()])


@pytest.mark.parametrize("max_tokens,max_reqs,replays", [(32, 16, 1), (16, 16, 2), (32, 2, 2)])
def test_prefill_graph_packs_several_requests(tiny_dir, reference, max_tokens, max_reqs,
                                              replays):
    """The three prompts admitted together (3 + 11 + 7 tokens) prefill in one replay of three
    packed requests (buckets up to 32), or in two (a largest bucket of 16: 3 + 11, then 7;
    or two requests a replay): each request's K/V equal to an eager prefill's, no other slot
    written but the padding page's, the first tokens of all three sampled from the replay,
    and the same tokens as plain decoding to the end."""
    engine = prefill_engine(tiny_dir, max_tokens, max_reqs=max_reqs)
    eager = tiny_engine(tiny_dir, max_running_requests=4, max_context_len=64)
    g = engine.runner.prefill_graphs
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    buffers = engine.kv_pool.k_buffer + engine.kv_pool.v_buffer
    before = [b.clone() for b in buffers]
    mine = [engine.add_request(p, sp) for p in PROMPTS]
    theirs = [eager.add_request(p, sp) for p in PROMPTS]
    engine.step()
    eager.step()
    assert g.replays == replays
    assert all(len(r.output_ids) == 1 for r in mine + theirs)
    assert [r.output_ids for r in mine] == [r[:1] for r in reference]
    others = torch.ones(buffers[0].shape[0], dtype=torch.bool)
    others[0] = False                                     # the padding page
    for x, y in zip(mine, theirs):
        a = engine.req_to_token.req_to_token[x.row, :x.kv_len].long()
        b = eager.req_to_token.req_to_token[y.row, :y.kv_len].long()
        others[a] = False
        for u, v in zip(buffers, eager.kv_pool.k_buffer + eager.kv_pool.v_buffer):
            torch.testing.assert_close(u[a], v[b], rtol=1e-5, atol=1e-5)
    assert all(torch.equal(x[others], y[others]) for x, y in zip(before, buffers))
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in mine] == [r[:4] for r in reference]
    engine.check_memory()
    assert engine.allocator.is_full()


def test_packed_chunked_prefills_sample_only_finished_prompts(tiny_dir, reference):
    """Chunked prefill (8 tokens a step) with the prompts' chunks packed into replays: a
    step where a request mid-way through its prompt comes before one whose prompt completes
    samples each finished request from its own row (the replay has a row for every request,
    the sampler only for those that sample: a found bug fed the mid-prompt row to the next
    request). The same tokens as plain decoding; the speculative prefill uses the same rows
    (`replay_prefill`)."""
    engine = prefill_engine(tiny_dir, 32, chunked_prefill_size=8)
    g = engine.runner.prefill_graphs
    orders = []
    real = engine.runner.replay_prefill

    def watch(plan):
        orders.append([i in plan.sampling for i in range(len(plan.reqs))])
        return real(plan)
    engine.runner.replay_prefill = watch
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    fourth = [30, 31, 32, 33]                 # 4 prompts: the 8-token budget shared 2 each
    reqs = [engine.add_request(p, sp) for p in PROMPTS + [fourth]]
    while engine.has_unfinished():
        engine.step()
    plain = tiny_engine(tiny_dir, max_running_requests=4).generate([fourth], sp)[0].token_ids
    assert [r.output_ids for r in reqs] == reference + [plain]
    # the case: a request that samples after one that does not, in one replay
    assert any(not o[j] and o[i] for o in orders
               for j in range(len(o)) for i in range(j + 1, len(o))), orders
    assert g.replays == len(orders)
    engine.check_memory()
    assert engine.allocator.is_full()


def test_bad_slot_in_a_packed_prefill_is_refused(tiny_dir, reference):
    """A slot past the pool in the second of three prefills packed into one replay:
    KVIndexError at the step's sync naming the slot, the limit and the store; the slot is
    not written, no slot outside the step's own is, the step's requests fail and give their
    slots back, and the engine serves the next request exactly."""
    engine = prefill_engine(tiny_dir, 32)
    limit = engine.kv_pool.size_limit
    real = engine.runner.replay_prefill
    own = []

    def bad(plan):
        own.extend(s.clone() for s in plan.slots)
        plan.slots[1] = plan.slots[1].clone()
        plan.slots[1][2] = limit + 3
        return real(plan)
    engine.runner.replay_prefill = bad
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    buffers = engine.kv_pool.k_buffer + engine.kv_pool.v_buffer
    before = [b.clone() for b in buffers]
    reqs = [engine.add_request(p, sp) for p in PROMPTS]
    with pytest.raises(KVIndexError, match=rf"slot {limit + 3} out of range \[0, {limit}\) "
                                           r"in store_cache \(layer 0"):
        engine.step()
    assert engine.runner.prefill_graphs.replays == 1
    outside = torch.ones(buffers[0].shape[0], dtype=torch.bool)
    outside[torch.cat(own)] = False
    outside[0] = False                                    # the padding page
    assert all(torch.equal(x[outside], y[outside]) for x, y in zip(before, buffers))
    assert all(r.finished for r in reqs)
    engine.runner.replay_prefill = real
    assert engine.allocator.is_full()
    engine.check_memory()
    out = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert out[0].token_ids == reference[1]


def test_prefill_graph_takes_a_mixed_step(tiny_dir, reference):
    """A plain engine's step that decodes one request and prefills another (continuous
    batching: a prompt admitted while a request decodes) is one replay of both, the decode
    token a one-token request beside the prompt: the same tokens as plain decoding."""
    engine = prefill_engine(tiny_dir, 32)
    g = engine.runner.prefill_graphs
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    first = engine.add_request(PROMPTS[0], sp)
    engine.step()
    assert g.replays == 1 and len(first.output_ids) == 1
    second = engine.add_request(PROMPTS[1], sp)
    engine.step()
    assert g.replays == 2, "the mixed step did not replay"
    assert len(first.output_ids) == 2 and len(second.output_ids) == 1
    while engine.has_unfinished():
        engine.step()
    assert first.output_ids == reference[0][:6] and second.output_ids == reference[1][:6]
    engine.check_memory()
    assert engine.allocator.is_full()


@pytest.mark.parametrize("together", [False, True])
def test_speculative_prefill_graph_is_lossless(deep_dir, together):
    """A speculative engine's prefills replayed with their hidden states and EAGLE-3's
    captured layers: the draft extends over them as after an eager prefill. An 11-token
    prompt alone, in chunks of 4 over its cached prefix, or two prompts (3 + 11 tokens)
    admitted together in one replay: speculative greedy equals plain greedy, token for
    token, the draft's K/V equal to the eager engine's, the books whole. (Under the
    interpreter a speculative step is slow; the GPU tests run EAGLE-1 and EAGLE-3, whole
    and chunked.)"""
    from eaglekv.cuda_graph import PrefillGraphs
    d, alg = deep_dir, "eagle3"
    chunk, prompts, replays = (None, PROMPTS[:2], 1) if together else (4, PROMPTS[1:2], 3)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    opts = dict(attention_backend="triton", max_running_requests=4, max_context_len=64,
                chunked_prefill_size=chunk,
                speculative=dict(algorithm=alg, draft_model="random", num_steps=3, topk=1,
                                 num_draft_tokens=4))
    plain = [o.token_ids for o in tiny_engine(d, max_running_requests=4).generate(prompts, sp)]
    engine = tiny_engine(d, **opts)
    eager = tiny_engine(d, **{**opts, "attention_backend": "torch"})     # the reference path
    w = engine.runner
    w.target.prefill_graphs = PrefillGraphs(engine.model, engine.backend, 32, 64,
                                            progress=False, capture=False, hidden=True,
                                            capture_layers=w.drafter.capture_layers,
                                            max_reqs=16, max_groups=4)
    pools = w.drafter.kv_pool.k_buffer + w.drafter.kv_pool.v_buffer
    eager_pools = eager.runner.drafter.kv_pool.k_buffer + eager.runner.drafter.kv_pool.v_buffer
    mine = [engine.add_request(p, sp) for p in prompts]
    theirs = [eager.add_request(p, sp) for p in prompts]
    while not all(r.output_ids for r in mine):
        engine.step()
    while not all(r.output_ids for r in theirs):
        eager.step()
    assert w.target.prefill_graphs.replays == replays
    for x, y in zip(mine, theirs):
        a = engine.req_to_token.req_to_token[x.row, :x.kv_len].long()
        b = eager.req_to_token.req_to_token[y.row, :y.kv_len].long()
        for u, v in zip(pools, eager_pools):
            torch.testing.assert_close(u[a], v[b], rtol=1e-5, atol=1e-5)
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in mine] == plain
    engine.check_memory()
    assert engine.allocator.is_full()
