"""EAGLE-3 and multi-layer EAGLE inside the engine (CPU, fp32, tiny random targets): lossless
greedy output, exact scripted accept lengths, every draft pool's KV equal to a fresh prefill
after every step, the allocator back to full, guard 3 at construction, and the sampling
distribution kept (chi-square, as in test_spec_sampling)."""

from __future__ import annotations

import pytest
import torch

from eaglekv import SamplingParams
from eaglekv.core import ForwardBatch
from eaglekv.errors import ConfigError
from eaglekv.speculative.drafter import ScriptedDrafter
from helpers import PROMPTS, expected_accepts, fresh_kv, oracle, spec, tiny_engine
import sampling_helpers as sampling


FAMILIES = [("eagle3", 3, 1, 4), ("eagle3", 3, 2, 6), ("eagle3", 5, 4, 12),
            ("multi_layer_eagle", 1, 1, 2), ("multi_layer_eagle", 3, 1, 4),
            ("multi_layer_eagle", 5, 1, 6)]


@pytest.fixture(scope="module")
def deep_reference(deep_dir):
    eng = tiny_engine(deep_dir, max_running_requests=4)
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=64,
                                                                      ignore_eos=True))]


@pytest.mark.parametrize("alg,S,K,N", FAMILIES)
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_lossless(deep_dir, deep_reference, alg, S, K, N, ps, batch):
    eng = tiny_engine(deep_dir, page_size=ps, max_running_requests=batch,
                      speculative=spec(alg, S, K, N))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 17, 25, 9)]
    outs = eng.generate(PROMPTS, params)
    for o, r, p in zip(outs, deep_reference, params):
        assert o.token_ids == r[:p.max_new_tokens]
        assert o.spec.verify_steps > 0
    eng.check_memory()
    assert eng.allocator.is_full()


@pytest.mark.parametrize("alg", ["eagle3", "multi_layer_eagle"])
@pytest.mark.parametrize("case", ["full", "every3", "none"])
def test_scripted_accept_lengths(deep_dir, deep_reference, alg, case):
    wrong = {"full": lambda j: False, "every3": lambda j: j % 3 == 0,
             "none": lambda j: True}[case]
    S = 3
    drafter = ScriptedDrafter(oracle(PROMPTS[:1], deep_reference[:1], wrong), 256)
    eng = tiny_engine(deep_dir, max_running_requests=1, drafter=drafter,
                      speculative=spec(alg, S, draft="scripted"))
    out = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    assert out.token_ids == deep_reference[0][:30]
    want = expected_accepts(64, S, wrong, 30)
    assert out.spec.verify_steps == len(want)
    assert out.spec.accepted_tokens == sum(want)
    eng.check_memory()


def _draft_pools(worker):
    d = worker.drafter
    return list(getattr(d, "pools", [d.kv_pool]))


@pytest.mark.parametrize("alg,K,N,ps", [("eagle3", 2, 6, 4), ("eagle3", 1, 4, 1),
                                        ("multi_layer_eagle", 1, 4, 16),
                                        ("multi_layer_eagle", 1, 4, 1)])
@pytest.mark.parametrize("chunk", [None, 2])
def test_every_pool_equals_fresh_prefill_after_every_step(deep_dir, alg, K, N, ps, chunk):
    from eaglekv.attention import TorchAttentionBackend
    from eaglekv.memory import KVPool
    eng = tiny_engine(deep_dir, page_size=ps, max_running_requests=2,
                      speculative=spec(alg, 3, K, N), chunked_prefill_size=chunk)
    d = eng.worker.drafter
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
            if alg == "eagle3":  # the draft is fed the captured layers of a fresh prefill
                out = eng.model.forward(batch, TorchAttentionBackend(pool, r2t),
                                        capture_layers=d.capture_layers)
                hidden = torch.cat(out.aux_hidden, -1)
                # the target KV just written again is identical; only the draft's matters
            dbatch = ForwardBatch.build([r.all_ids[1:r.kv_len + 1]], [0], [1], fslots)
            for k, dpool_live in enumerate(_draft_pools(eng.worker)):
                dpool = KVPool(len(ids) + 1, 1, *d.model.kv_shape())
                dback = TorchAttentionBackend(dpool, r2t)
                meta = dback.init_forward_metadata(dbatch)
                if alg == "eagle3":
                    d.model.forward(dbatch.input_ids, dbatch.positions, hidden, dback, meta)
                else:
                    d.model.forward(k, dbatch.input_ids, dbatch.positions, hidden, dback, meta)
                torch.testing.assert_close(dpool_live.k_buffer[0][slots], dpool.k_buffer[0][fslots],
                                           atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(dpool_live.v_buffer[0][slots], dpool.v_buffer[0][fslots],
                                           atol=1e-4, rtol=1e-4)
    assert steps > 3
    eng.check_memory()
    assert eng.allocator.is_full()


class _Spec:  # a config SpecConfig itself would refuse, to reach the workers' own checks
    def __init__(self, S, K, N):
        self.num_steps, self.topk, self.num_draft_tokens = S, K, N
        self.algorithm, self.draft_model = "multi_layer_eagle", "random"


@pytest.mark.parametrize("S,K,N", [(3, 1, 5), (3, 1, 3), (2, 2, 3)])
def test_guard3_at_construction_before_buffers(deep_dir, monkeypatch, S, K, N):
    import eaglekv.speculative.eagle_worker as ew
    import eaglekv.speculative.multi_layer_eagle_worker as mw
    eng = tiny_engine(deep_dir, max_running_requests=1, speculative=spec("multi_layer_eagle", 3))
    made = []
    monkeypatch.setattr(mw, "KVPool", lambda *a, **k: made.append("pool"))
    monkeypatch.setattr(ew, "DraftSlots", lambda *a, **k: made.append("slots"))
    bad = _Spec(S, K, N)
    what = "num_draft_tokens" if N != S + 1 else "topk"
    with pytest.raises(ConfigError, match=what):
        mw.MultiLayerEagleWorker(eng.runner.res, eng.worker.drafter, bad)
    with pytest.raises(ConfigError, match=what):
        mw.MultiLayerEagleDraftWorker(eng.worker.drafter.model, bad, 64, 1, eng.req_to_token,
                                      torch.float32, "cpu")
    assert made == []
    with pytest.raises(ConfigError, match="topk"):  # and at config time already
        spec_cfg = spec("multi_layer_eagle", 3, 2, 6)
        tiny_engine(deep_dir, speculative=spec_cfg)


def exact_second_token(model, params) -> torch.Tensor:
    """(V,) the exact law of output token 1: sum over o0 of p(o0) p(o1 | o0)."""
    from eaglekv.sampling import target_probs
    p0 = target_probs(sampling.last_logits(model, [sampling.PROMPT]), params)[0]   # (V,)
    ctx = [sampling.PROMPT + [t] for t in range(p0.shape[0])]
    p1 = target_probs(sampling.last_logits(model, ctx), params)                    # (V, V)
    return p0 @ p1


@pytest.mark.parametrize("alg,S,K,N", [("eagle3", 2, 1, 3), ("eagle3", 2, 3, 6),
                                       ("multi_layer_eagle", 2, 1, 3)])
def test_sampling_keeps_the_target_distribution(tiny_dir, deep_dir, alg, S, K, N):
    """The families' real (random) draft heads, at a temperature where their proposals are
    often accepted: the law of the first speculative token equals the exact one (chi-square
    over the vocabulary, rare tokens pooled)."""
    target = deep_dir if alg == "eagle3" else tiny_dir
    params = SamplingParams(max_new_tokens=2, temperature=2.0, ignore_eos=True)
    want = exact_second_token(tiny_engine(target).model, params)
    eng = tiny_engine(target, max_running_requests=64, seed=5, speculative=spec(alg, S, K, N))
    n = 4000
    outs = eng.generate([sampling.PROMPT] * n, params)
    eng.check_memory()
    assert eng.allocator.is_full()
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=want.numel())
    expected = n * want
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum().double()[None]])
    exp = torch.cat([expected[big].double(), expected[~big].sum().double()[None]])
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum())
    dof = int(big.sum())
    assert stat < dof + 3.3 * (2 * dof) ** 0.5 + 4, (stat, dof)
    st = eng.spec_stats()
    # drafts really were accepted: sampled chains often; a random head's deterministic top-k
    # candidates only rarely at this temperature (the tree rule is exercised in depth by
    # test_spec_sampling's noisy self-draft)
    assert st.accepted_tokens > (0.1 * st.verify_steps if K == 1 else 0)


def test_checkpoint_of_another_family_is_refused_at_engine_start(deep_dir, tmp_path):
    """An EAGLE-3 head configured as 'eagle' (SGLang would run it at accept length 1.0), an
    EAGLE-1 head as 'eagle3' or 'multi_layer_eagle': each refused, saying what it is."""
    from eaglekv.errors import ModelLoadError
    from eaglekv.model.draft_checkpoint import random_eagle_draft, save_eagle_draft
    from eaglekv.model.eagle3_checkpoint import random_eagle3_draft, save_eagle3_draft
    from eaglekv.model.multi_layer_eagle import random_multi_layer_draft, save_multi_layer_draft
    mc = tiny_engine(deep_dir).model_config
    save_eagle_draft(tmp_path / "e1", *random_eagle_draft(mc))
    save_eagle3_draft(tmp_path / "e3", *random_eagle3_draft(mc, draft_vocab_size=64),
                      fmt="safetensors")
    save_multi_layer_draft(tmp_path / "ml", *random_multi_layer_draft(mc, num_layers=3))
    cases = [("eagle", "e3", "eagle3"), ("eagle3", "e1", "algorithm='eagle'"),
             ("multi_layer_eagle", "e1", "algorithm='eagle'"),
             ("multi_layer_eagle", "e3", "eagle3"), ("eagle", "ml", "multi_layer_eagle")]
    for alg, name, says in cases:
        with pytest.raises(ModelLoadError, match=says):
            tiny_engine(deep_dir, speculative=spec(alg, 3, draft=str(tmp_path / name)))
    # and each loads under its own algorithm, lossless
    ref = tiny_engine(deep_dir).generate(PROMPTS[:1], SamplingParams(max_new_tokens=12))[0]
    for alg, name in [("eagle", "e1"), ("eagle3", "e3"), ("multi_layer_eagle", "ml")]:
        eng = tiny_engine(deep_dir, speculative=spec(alg, 3, draft=str(tmp_path / name)))
        out = eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=12))[0]
        assert out.token_ids == ref.token_ids
        eng.check_memory()


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "multi_layer_eagle"])
@pytest.mark.parametrize("ps", [1, 4])
def test_abort_mid_speculation_frees_everything(deep_dir, deep_reference, algorithm, ps):
    """A client that leaves between speculative steps (Engine.abort): its target and draft KV
    are freed, the other requests stay lossless, and the pool is back to full."""
    eng = tiny_engine(deep_dir, page_size=ps, speculative=spec(algorithm),
                      max_running_requests=2)
    p = SamplingParams(max_new_tokens=30, ignore_eos=True)
    reqs = [eng.add_request(ids, p) for ids in PROMPTS[:3]]   # the third waits for a row
    for _ in range(3):
        eng.step()
    assert reqs[0] in eng.running and reqs[2] in eng.waiting
    eng.abort(reqs[0])                                       # mid-speculation
    eng.abort(reqs[2])                                       # still queued
    while eng.has_unfinished():
        eng.step()
    assert reqs[0].finish_reason == reqs[2].finish_reason == "abort"
    assert reqs[1].output_ids == deep_reference[1][:30]
    eng.check_memory()
