"""`eaglekv bench`'s timed generation (eaglekv/bench/gpu.py): the same tokens as
`Engine.generate`, and a breakdown (prefill steps, decode steps, the rest) that accounts for
the whole timed wall."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eaglekv import SamplingParams
from eaglekv.bench.gpu import timed_generate
from helpers import spec, tiny_engine

PROMPTS = [[5, 17, 42], list(range(1, 12)), [9] * 7]


@pytest.mark.parametrize("kw", [{}, {"num_scheduler_steps": 4},
                                {"speculative": spec("eagle", 3, 1, 4)}],
                         ids=["plain", "chain", "eagle"])
def test_timed_generate_matches_generate_and_accounts_for_its_time(tiny_dir, kw):
    n = 9
    ref = tiny_engine(tiny_dir, **kw).generate(PROMPTS, SamplingParams(max_new_tokens=n,
                                                                   ignore_eos=True))
    e = tiny_engine(tiny_dir, **kw)
    tps, toks, ph = timed_generate(e, PROMPTS, n)
    assert toks == [o.token_ids for o in ref]
    assert ph["prefill_steps"] >= 1 and ph["decode_steps"] >= 1
    total_ms = 1e3 * len(PROMPTS) * n / tps
    parts = ph["prefill_ms"] + ph["decode_ms"] + ph["other_ms"]
    assert parts == pytest.approx(total_ms, rel=1e-6)
    assert 0 <= ph["decode_step_ms_p50"] <= ph["decode_step_ms_p90"] <= ph["decode_step_ms_max"]
    assert ph["decode_step_ms_max"] <= ph["decode_ms"] + 1e-9
    # the decode steps that began with all three requests decoding: at least the first; all
    # of them where every step makes the same tokens for every request (plain, chains)
    assert 1 <= ph["full_batch_steps"] <= ph["decode_steps"]
    assert 0 < ph["full_batch_ms"] <= ph["decode_ms"] + 1e-9
    assert ph["full_batch_steps"] <= ph["full_batch_tokens"] <= len(PROMPTS) * (n - 1)
    if "speculative" not in kw:
        assert ph["full_batch_steps"] == ph["decode_steps"]
        assert ph["full_batch_tokens"] == len(PROMPTS) * (n - 1)
    e.check_memory()


def test_step_profile_ranks_the_host_work(tiny_dir):
    """The bench's step profile (CUDA rows) also ranks where a step's host time goes: the
    engine's own functions appear, with their calls a step."""
    from eaglekv.bench.gpu import step_profile
    e = tiny_engine(tiny_dir, speculative=spec("eagle", 3, 1, 4), max_context_len=1024,
                    max_total_tokens=4096)
    prof = step_profile(e, PROMPTS, steps=3)
    top = prof["host_top"]
    assert 0 < len(top) <= 25
    assert all(r["self_ms_per_step"] >= 0 and r["calls_per_step"] > 0 for r in top)
    assert top == sorted(top, key=lambda r: -r["self_ms_per_step"])
    assert any("engine.py" in r["function"] or "speculative/" in r["function"] for r in top)
    assert prof["preemptions"] == 0
    # each part of the speculative step is marked (speculative/phases.py): on the CPU their
    # CPU time a step, the target's verify the largest; a plain engine reports none
    ph = prof["phase_ms_per_step"]
    assert set(ph) == {"draft", "verify", "accept", "extend", "rows_decoding"}, ph
    assert ph.pop("rows_decoding") == len(PROMPTS)
    assert all(v > 0 for v in ph.values()), ph
    assert ph["verify"] > ph["accept"]
    assert prof["timeline"] is None                    # no device timestamps on the CPU
    e.check_memory()
    assert e.allocator.is_full()
    plain = step_profile(tiny_engine(tiny_dir, max_context_len=1024), PROMPTS, steps=2)
    assert "phase_ms_per_step" not in plain


def test_phase_profile_runs_on_requests_that_still_decode(tiny_dir):
    """The parts of a step are profiled over requests of their own: a budget of 12 tokens,
    which the step profile's earlier steps use up (its first 3 tokens, then 3 x 3 steps of at
    least one), still has the row decoding in each profiled step, each part measured (the H200 table of
    2026-12-06 showed S5's parts as 0 at batch 1: its one request had finished)."""
    from eaglekv.bench.gpu import step_profile
    e = tiny_engine(tiny_dir, speculative=spec("eagle", 3, 1, 4), max_context_len=1024,
                    max_total_tokens=4096)
    prof = step_profile(e, PROMPTS[:1], steps=3, new_tokens=12)
    ph = prof["phase_ms_per_step"]
    assert all(ph[k] > 0 for k in ("draft", "verify", "accept", "extend")), ph
    assert ph["rows_decoding"] == 1
    e.check_memory()
    assert e.allocator.is_full()


def test_step_profile_reports_preemptions_of_a_small_pool(tiny_dir, monkeypatch):
    """A pool that cannot hold every profiled request's tokens preempts during the profile:
    the profile says so (its figures then include re-prefills), and the bench sizes its
    engines' pools for the profile's requests."""
    from eaglekv.bench import gpu
    e = tiny_engine(tiny_dir, max_context_len=1024, max_total_tokens=48)
    prof = gpu.step_profile(e, PROMPTS, steps=3, new_tokens=30)
    assert prof["preemptions"] > 0
    e.check_memory()
    assert e.allocator.is_full()

    seen = []
    monkeypatch.setattr(gpu, "Engine", seen.append)
    args = SimpleNamespace(new_tokens=256, model="m", dtype="float32", device="cpu",
                           disable_cuda_graph=True, draft="default")
    gpu._make_engine(args, "plain", 64)
    assert seen[0].max_total_tokens >= 64 * (gpu.PROFILE_NEW_TOKENS + 32)


def test_timed_generate_traces_an_adaptive_engine_step_by_step(tiny_dir):
    """An adaptive engine's timed run lists each step's choice, the tokens it made and its
    milliseconds (the tokens add up to every request's output, the times to the steps'), the
    drafts the engine's averages expect and the costs the policy read."""
    e = tiny_engine(tiny_dir, max_context_len=1024, max_total_tokens=4096,
                    speculative=dict(algorithm="eagle", draft_model="random", adaptive=True,
                                     shapes=((3, 1, 4),)))
    n = 9
    tps, toks, ph = timed_generate(e, PROMPTS, n)
    trace = ph["step_trace"]
    assert len(trace) == ph["prefill_steps"] + ph["decode_steps"]
    assert sum(t[1] for t in trace) == len(PROMPTS) * n
    assert sum(t[2] for t in trace) == pytest.approx(ph["prefill_ms"] + ph["decode_ms"],
                                                     abs=1e-3 * len(trace))
    assert all(len(t) == 6 and 0 <= t[3] <= 3 and 0 <= t[4] <= 3 for t in trace)   # S3: <= 3
    # the costs the policy read: a plain chain's ms a token and S3's ms a step (-1: unknown)
    assert all(len(t[5]) == 2 and all(c == -1 or c > 0 for c in t[5]) for t in trace)
    assert any(c > 0 for t in trace for c in t[5])
    labels = {t[0].rstrip("?") for t in trace[ph["prefill_steps"]:]}
    assert labels <= {"plain", "S3K1N4", "S3K1N4+plain"}, labels
    assert [w[:2] for w in ph["step_walls"]] == [t[1:3] for t in trace]
    # every engine, fixed shapes and plain too: each step's tokens and milliseconds
    _, _, plain_ph = timed_generate(tiny_engine(tiny_dir), PROMPTS, n)
    assert "step_trace" not in plain_ph
    walls = plain_ph["step_walls"]
    assert len(walls) == plain_ph["prefill_steps"] + plain_ph["decode_steps"]
    assert sum(w[0] for w in walls) == len(PROMPTS) * n
    assert sum(w[1] for w in walls) == pytest.approx(
        plain_ph["prefill_ms"] + plain_ph["decode_ms"], abs=1e-3 * len(walls))


def test_step_profile_leaves_the_adaptive_costs_alone(tiny_dir):
    """Steps under the profilers are not an adaptive engine's costs: its cost table is the
    same after the profile, and learns again afterwards."""
    from eaglekv.bench.gpu import step_profile
    e = tiny_engine(tiny_dir, max_context_len=1024, max_total_tokens=4096,
                    speculative=dict(algorithm="eagle", draft_model="random", adaptive=True,
                                     shapes=((3, 1, 4),)))
    e.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    costs = e.runner.policy.costs
    before = {k: list(v) for k, v in costs.cells.items()}
    assert before
    step_profile(e, PROMPTS, steps=3)
    assert {k: list(v) for k, v in costs.cells.items()} == before
    assert not costs.frozen
    e.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert {k: list(v) for k, v in costs.cells.items()} != before


@pytest.mark.parametrize("kw", [{}, {"speculative": spec("eagle", 3, 1, 4)}],
                         ids=["plain", "eagle"])
def test_timed_generate_keeps_a_concurrency(tiny_dir, kw):
    """`concurrency` (the bench's --waves): at most that many requests in flight, a new one
    added as one finishes, until every prompt ran; the same tokens as `Engine.generate`."""
    ps = PROMPTS + [[3, 1, 4, 1, 5], [2, 7, 1, 8]]
    n = 7
    ref = tiny_engine(tiny_dir, **kw).generate(ps, SamplingParams(max_new_tokens=n,
                                                                  ignore_eos=True))
    e = tiny_engine(tiny_dir, **kw)
    seen = []
    step = e.step
    e.step = lambda: (seen.append(len(e.scheduler.running) + len(e.scheduler.waiting)),
                      step())[1]
    tps, toks, ph = timed_generate(e, ps, n, concurrency=2)
    assert toks == [o.token_ids for o in ref]
    assert max(seen) == 2 and len(seen) >= len(ps) * n / 2 / 4
    # with the places refilled, the full-batch steps are all but the last wave's tail
    assert 1 <= ph["full_batch_steps"] <= ph["decode_steps"] and ph["full_batch_tokens"] > 0
    total_ms = 1e3 * len(ps) * n / tps
    assert ph["prefill_ms"] + ph["decode_ms"] + ph["other_ms"] == pytest.approx(total_ms,
                                                                              rel=1e-6)
    e.check_memory()
    assert e.allocator.is_full()


def test_kernel_top_sums_launches_and_time_by_name():
    """The step profile's kernel table: per kernel name, launches and device us a step,
    the most time first."""
    from types import SimpleNamespace as K

    from eaglekv.bench.gpu import kernel_top
    ks = [K(name="gemv", device_time=4.0), K(name="norm", device_time=1.0),
          K(name="gemv", device_time=6.0), K(name="attn", device_time=3.0)] * 2
    top = kernel_top(ks, steps=2)
    assert top == [{"kernel": "gemv", "launches_per_step": 2.0, "us_per_step": 10.0},
                   {"kernel": "attn", "launches_per_step": 1.0, "us_per_step": 3.0},
                   {"kernel": "norm", "launches_per_step": 1.0, "us_per_step": 1.0}]
    assert kernel_top(ks, steps=2, n=1) == top[:1]


def test_device_timeline_splits_the_idle_time_by_gap_size():
    """The step profile's timeline: the span of the profiled kernels, the time some kernel
    ran (overlapping kernels counted once) and the idle rest by gap class, per step; None
    where the events carry no timestamps."""
    from types import SimpleNamespace as K

    from eaglekv.bench.gpu import device_timeline

    def k(start, end):
        return K(time_range=K(start=start, end=end))
    # two steps: kernels [0, 10] [11, 20] (1 us boundary), [15, 18] inside, [50, 60] (30 us
    # late launch), then 500 us of host work, [560, 600] [600.5, 610] (0.5 us boundary)
    ks = [k(0, 10), k(15, 18), k(11, 20), k(50, 60), k(560, 600), k(600.5, 610)]
    t = device_timeline(ks, steps=2)
    assert t["span_ms_per_step"] == pytest.approx(610 / 1e3 / 2)
    assert t["busy_ms_per_step"] == pytest.approx((10 + 9 + 10 + 40 + 9.5) / 1e3 / 2)
    assert t["idle_ms_per_step"] == pytest.approx((1 + 30 + 500 + 0.5) / 1e3 / 2)
    assert t["gaps"] == {"under_2us": {"count_per_step": 1.0, "us_per_step": 0.75},
                         "2_to_100us": {"count_per_step": 0.5, "us_per_step": 15.0},
                         "over_100us": {"count_per_step": 0.5, "us_per_step": 250.0}}
    assert device_timeline([K(name="cpu-only")], steps=1) is None


def test_the_floor_runs_in_the_bench_process(tmp_path):
    """`eaglekv bench --floor graph_floor.py` runs the floor script in its own process and
    keeps each shape's figures (a stand-in script here: the real one needs CUDA); the table
    and the plot show its batch-1 figure."""
    from eaglekv.bench.gpu import floor_rows, plot, table
    script = tmp_path / "graph_floor.py"
    script.write_text('import json\nprint("warming up")\n'
                      'print("smollm2_shape", json.dumps({"compiled_graph_tok_s": 1191.5}))\n'
                      'print("llama8b_shape", json.dumps({"compiled_graph_ms": 4.54}))\n')
    rows = floor_rows(str(script))
    assert rows == {"smollm2_shape": {"compiled_graph_tok_s": 1191.5},
                    "llama8b_shape": {"compiled_graph_ms": 4.54}}
    result = {"modes": {"plain": {"rows": {1: {"tokens_per_s": 975.0}}}}, "floor": rows,
              "device": "test", "model_short": "m", "dtype": "bfloat16", "date": "2026-12-04"}
    assert "| floor: torch.compile + one CUDA graph (same process) | 1191.5 |" in table(result)
    plot(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
    bad = tmp_path / "bad.py"
    bad.write_text('print("nothing useful")\n')
    with pytest.raises(RuntimeError, match="printed no"):
        floor_rows(str(bad))
    # after the modes a failing floor is recorded, not raised: their figures are still written
    from eaglekv.bench.gpu import floor_or_error
    failed = floor_or_error(str(bad))
    assert failed["error"].startswith("RuntimeError:") and "printed no" in failed["error"]
    assert floor_or_error(str(script)) == rows
    result["floor"] = failed
    assert "floor:" not in table(result)


def test_modes_with_a_cpu_library_compare_within_their_library():
    """`name@lib` modes (the CPU matmul library): each is compared with plain decoding of
    the same library, adaptive with the best fixed shape of its library, and a mode run with
    two libraries with itself."""
    from eaglekv.bench.gpu import compare, mode_checks, split_mode
    from eaglekv.model import cpu_blas
    assert split_mode("eagle_chain_S5K1N6@numpy") == ("eagle_chain_S5K1N6", "numpy")
    assert split_mode("plain_unchecked") == ("plain_unchecked", None)

    def row(*tps):
        return {"rows": {1: {"tokens_per_s": tps[0]}, 4: {"tokens_per_s": tps[1]}}}
    result = {"modes": {"plain@numpy": row(10, 20), "plain@onednn": row(10, 40),
                        "eagle_chain_S5K1N6@numpy": row(15, 20),
                        "eagle_chain_S5K1N6@onednn": row(20, 60),
                        "adaptive@onednn": row(19, 57)}}
    compare(result)
    assert result["speedup_vs_plain"]["eagle_chain_S5K1N6@numpy"] == {1: 1.5, 4: 1.0}
    assert result["speedup_vs_plain"]["eagle_chain_S5K1N6@onednn"] == {1: 2.0, 4: 1.5}
    assert result["adaptive_vs"]["@onednn"] == {
        1: {"plain": 1.9, "best_fixed": 0.95, "best_fixed_same_head": 0.95},
        4: {"plain": 1.425, "best_fixed": 0.95, "best_fixed_same_head": 0.95}}
    assert result["cpu_blas_vs"]["plain: onednn / numpy"] == {1: 1.0, 4: 2.0}
    # adaptive with the EAGLE-3 head, against the same fixed shapes (here plain wins at 4)
    result = {"modes": {"plain": row(10, 40), "eagle3_chain_S5K1N6": row(20, 30),
                        "adaptive_eagle3": row(18, 38)}}
    compare(result)
    assert result["adaptive_eagle3_vs"] == {
        1: {"plain": 1.8, "best_fixed": 0.9, "best_fixed_same_head": 0.9},
        4: {"plain": 0.95, "best_fixed": 0.95, "best_fixed_same_head": 0.95}}
    assert "adaptive_vs" not in result
    before = cpu_blas.mode()
    with mode_checks("plain@torch"):
        assert cpu_blas.mode() == "torch"
    assert cpu_blas.mode() == before


def test_adaptive_is_compared_with_the_best_fixed_shape_of_its_own_head():
    """`best_fixed` is the best fixed mode of the run; `best_fixed_same_head` the best among
    the shapes of the head the adaptive mode drafts with (EAGLE-3 modes for the adaptive_eagle3
    modes, the others for adaptive), which is what it can choose; the tree-candidate mode is
    compared too."""
    from eaglekv.bench.gpu import MODES, compare

    def row(*tps):
        return {"rows": {4: {"tokens_per_s": tps[0]}}}
    result = {"modes": {"plain": row(10), "eagle_chain_S5K1N6": row(15),
                        "eagle3_tree_S6K4N16": row(20), "eagle3_chain_S5K1N6": row(16),
                        "adaptive": row(14.4), "adaptive_eagle3_trees": row(19)}}
    compare(result)
    assert result["adaptive_vs"][4] == pytest.approx(
        {"plain": 1.44, "best_fixed": 0.72, "best_fixed_same_head": 0.96})
    assert result["adaptive_eagle3_trees_vs"][4] == pytest.approx(
        {"plain": 1.9, "best_fixed": 0.95, "best_fixed_same_head": 0.95})
    assert (6, 4, 16) in MODES["adaptive_eagle3_trees"]["shapes"]


def test_checks_are_compared_with_the_unchecked_step():
    """`*_unchecked` and `*_layerchecks` modes: the shipped step and the every-layer step each
    against the unchecked one; neither variant counts as a fixed shape for adaptive; the
    `_layerchecks` mode builds its engine inside `layer_checks()`."""
    from eaglekv.attention import triton_backend
    from eaglekv.bench.gpu import checks_vs_unchecked, compare, mode_checks

    def row(*tps):
        return {"rows": {1: {"tokens_per_s": tps[0]}, 4: {"tokens_per_s": tps[1]}}}
    result = {"modes": {"plain": row(10, 40), "plain_unchecked": row(10, 50),
                        "eagle_chain_S5K1N6": row(18, 45),
                        "eagle_chain_S5K1N6_unchecked": row(20, 50),
                        "eagle_chain_S5K1N6_layerchecks": row(16, 45),
                        "adaptive": row(18, 40)}}
    checks_vs_unchecked(result)
    ratio = {m: {B: r["tokens_per_s"] for B, r in rows.items()}
             for m, rows in result["checked_vs_unchecked"].items()}
    assert ratio == {"plain": {1: 1.0, 4: 0.8}, "eagle_chain_S5K1N6": {1: 0.9, 4: 0.9}}
    assert {m: {B: r["tokens_per_s"] for B, r in rows.items()}
            for m, rows in result["layerchecks_vs_unchecked"].items()} == {
        "eagle_chain_S5K1N6_layerchecks": {1: 0.8, 4: 0.9}}
    compare(result)
    assert result["adaptive_vs"][1]["best_fixed"] == 1.0      # not 18 / 20: unchecked
    assert triton_backend.CHECK_ONCE
    with mode_checks("eagle_chain_S5K1N6_layerchecks"):
        assert not triton_backend.CHECK_ONCE
    assert triton_backend.CHECK_ONCE


def test_chained_modes_are_compared_with_one_step_a_sync():
    """`*_1step` modes (num_scheduler_steps=1: no multi-step decode, no speculative chains):
    `chained_vs_1step` is mode / mode_1step per batch; a `_1step` shape is not one of
    adaptive's fixed shapes (those run with the shipped settings)."""
    from eaglekv.bench.gpu import MODES, chained_vs_1step, compare

    def row(*tps):
        return {"rows": {1: {"tokens_per_s": tps[0]}, 4: {"tokens_per_s": tps[1]}}}
    result = {"modes": {"plain": row(10, 40), "plain_1step": row(8, 40),
                        "eagle_chain_S5K1N6": row(20, 60),
                        "eagle_chain_S5K1N6_1step": row(25, 50),
                        "adaptive": row(20, 50), "adaptive_1step": row(16, 50)}}
    chained_vs_1step(result)
    assert {m: {B: r["tokens_per_s"] for B, r in rows.items()}
            for m, rows in result["chained_vs_1step"].items()} == {
        "plain": {1: 1.25, 4: 1.0}, "eagle_chain_S5K1N6": {1: 0.8, 4: 1.2},
        "adaptive": {1: 1.25, 4: 1.0}}
    compare(result)
    assert result["adaptive_vs"][1]["best_fixed"] == 1.0      # 20 / 20, not 20 / 25
    assert MODES["eagle_chain_S5K1N6_1step"] == MODES["eagle_chain_S5K1N6"]


def test_a_random_draft_adaptive_is_judged_against_its_own_head():
    """`adaptive_random_draft` (a randomly initialised head: drafts that always fail) is
    compared with plain and the fixed shapes of the same random head, not with the shipped
    head's; the shipped head's adaptive not with the random head's shapes' (here slower
    anyway, so the best fixed is the shipped one's)."""
    from eaglekv.bench.gpu import MODES, compare

    def row(*tps):
        return {"rows": {1: {"tokens_per_s": tps[0]}, 4: {"tokens_per_s": tps[1]}}}
    result = {"modes": {"plain": row(10, 40), "eagle_chain_S3K1N4": row(20, 60),
                        "eagle_chain_S3K1N4_random_draft": row(5, 20),
                        "adaptive": row(20, 60), "adaptive_random_draft": row(9.9, 40)}}
    compare(result)
    rv = result["adaptive_random_draft_vs"]
    assert rv[1] == pytest.approx({"plain": 0.99, "best_fixed": 9.9 / 20,
                                   "best_fixed_same_head": 0.99})   # plain is the best there
    assert rv[4]["best_fixed_same_head"] == 1.0
    assert result["adaptive_vs"][1]["best_fixed_same_head"] == 1.0
    assert MODES["adaptive_random_draft"]["draft_model"] == "random"


def test_gemv_modes_are_compared_with_cublas(monkeypatch):
    """`*_gemv` / `*_cublas` modes capture their graphs with / without the Triton
    matrix-vector kernel (fused.FUSE_GEMV set while the engine is built, put back after; the
    other modes as shipped): `gemv_vs_cublas` is mode_gemv / mode or mode / mode_cublas per
    batch, and neither is one of adaptive's fixed shapes."""
    from eaglekv.bench import gpu
    from eaglekv.kernels import fused

    def row(*tps):
        return {"rows": {1: {"tokens_per_s": tps[0]}, 4: {"tokens_per_s": tps[1]}}}
    result = {"modes": {"plain": row(12, 38), "plain_cublas": row(10, 40),
                        "eagle_chain_S5K1N6": row(20, 60),
                        "eagle_chain_S5K1N6_gemv": row(30, 60), "adaptive": row(20, 60)}}
    gpu.chained_vs_1step(result)
    assert {m: {B: round(r["tokens_per_s"], 9) for B, r in rows.items()}
            for m, rows in result["gemv_vs_cublas"].items()} == {
        "plain": {1: 1.2, 4: 0.95}, "eagle_chain_S5K1N6": {1: 1.5, 4: 1.0}}
    gpu.compare(result)
    assert result["adaptive_vs"][1]["best_fixed"] == 1.0      # 20 / 20, not 20 / 30
    seen = []
    monkeypatch.setattr(gpu, "_make_engine", lambda args, mode, b: seen.append(
        (mode, fused.FUSE_GEMV, fused.GEMV_MAX_ROWS)))
    monkeypatch.setattr(fused, "FUSE_GEMV", None)                  # the default: CUDA only
    for mode in ("plain_gemv", "plain", "plain_cublas", "eagle_chain_S5K1N6_gemv",
                 "eagle_chain_S5K1N6_gemv8"):
        gpu.make_engine(None, mode, 1)
    assert seen == [("plain_gemv", True, 4), ("plain", None, 4), ("plain_cublas", False, 4),
                    ("eagle_chain_S5K1N6_gemv", True, 4),
                    ("eagle_chain_S5K1N6_gemv8", None, 8)]
    assert fused.FUSE_GEMV is None and fused.GEMV_MAX_ROWS == 4


def test_xs1_modes_capture_the_unsplit_extend(monkeypatch):
    """`*_xs1` modes build their engine with the verify's extend attention unsplit
    (attention_triton.EXTEND_SPLITS = 1), `*_fmerge` ones with the decode's merge in its own
    launch (FUSED_DECODE_MERGE on), each put back after; `split_vs_nosplit` is mode /
    mode_xs1 per batch."""
    pytest.importorskip("triton")
    from eaglekv.bench import gpu
    from eaglekv.kernels import attention_triton as at

    def row(*tps):
        return {"rows": {1: {"tokens_per_s": tps[0]}, 4: {"tokens_per_s": tps[1]}}}
    result = {"modes": {"eagle_chain_S5K1N6": row(22, 60),
                        "eagle_chain_S5K1N6_xs1": row(20, 64)}}
    gpu.chained_vs_1step(result)
    assert {B: round(r["tokens_per_s"], 9) for B, r in
            result["split_vs_nosplit"]["eagle_chain_S5K1N6"].items()} == {1: 1.1, 4: 0.9375}
    seen = []
    monkeypatch.setattr(gpu, "_make_engine",
                        lambda args, mode, b: seen.append((mode, at.EXTEND_SPLITS)))
    monkeypatch.setattr(at, "EXTEND_SPLITS", None)
    from eaglekv.kernels import fused, pdl
    monkeypatch.setattr(gpu, "_make_engine", lambda args, mode, b: seen.append(
        (mode, at.EXTEND_SPLITS, at.FUSED_DECODE_MERGE, pdl.PDL, fused.FUSE_GEMV)))
    monkeypatch.setattr(at, "FUSED_DECODE_MERGE", False)
    monkeypatch.setattr(pdl, "PDL", False)
    monkeypatch.setattr(fused, "FUSE_GEMV", None)
    for mode in ("eagle_chain_S5K1N6_xs1", "eagle_chain_S5K1N6", "plain_fmerge",
                 "plain_fmerge_pdl", "plain_gemv_pdl", "plain_nopdl"):
        gpu.make_engine(None, mode, 1)
    assert seen == [("eagle_chain_S5K1N6_xs1", 1, False, False, None),
                    ("eagle_chain_S5K1N6", None, False, False, None),
                    ("plain_fmerge", None, True, False, None),
                    ("plain_fmerge_pdl", None, True, True, None),
                    ("plain_gemv_pdl", None, False, True, True),
                    ("plain_nopdl", None, False, False, None)]
    assert at.EXTEND_SPLITS is None and at.FUSED_DECODE_MERGE is False and pdl.PDL is False
    assert fused.FUSE_GEMV is None
    from eaglekv.kernels import fused_triton
    tiles = []
    monkeypatch.setattr(gpu, "_make_engine", lambda args, mode, b: tiles.append(
        (mode, fused_triton.GEMV_CONFIG["max_tile"], fused.GEMV_MAX_ROWS)))
    monkeypatch.setitem(fused_triton.GEMV_CONFIG, "max_tile", 0)
    for mode in ("plain_gt1k", "eagle_chain_S5K1N6_gemv8_gt1k", "eagle3_chain_S3K1N4_gt1k",
                 "adaptive_eagle3_gt1k", "plain"):
        gpu.make_engine(None, mode, 1)
    assert tiles == [("plain_gt1k", 1024, 4), ("eagle_chain_S5K1N6_gemv8_gt1k", 1024, 8),
                     ("eagle3_chain_S3K1N4_gt1k", 1024, 4), ("adaptive_eagle3_gt1k", 1024, 4),
                     ("plain", 0, 4)]
    assert fused_triton.GEMV_CONFIG["max_tile"] == 0 and fused.GEMV_MAX_ROWS == 4
    xpdl = []
    monkeypatch.setattr(gpu, "_make_engine", lambda args, mode, b: xpdl.append(
        (mode, at.EXTEND_PDL, fused_triton.GEMV_CONFIG["max_tile"])))
    monkeypatch.setattr(at, "EXTEND_PDL", False)
    for mode in ("eagle_chain_S5K1N6_gemv8_gt1k_xpdl", "eagle_chain_S5K1N6"):
        gpu.make_engine(None, mode, 1)
    assert xpdl == [("eagle_chain_S5K1N6_gemv8_gt1k_xpdl", True, 1024),
                    ("eagle_chain_S5K1N6", False, 0)]
    assert at.EXTEND_PDL is False
    grope = []                      # the qkv gemv's RoPE epilogue, while the engine is built
    monkeypatch.setattr(gpu, "_make_engine", lambda args, mode, b: grope.append(
        (mode, fused.FUSE_GEMV_ROPE, at.EXTEND_PDL, fused.GEMV_MAX_ROWS)))
    monkeypatch.setattr(fused, "FUSE_GEMV_ROPE", False)
    for mode in ("plain_grope", "eagle_chain_S5K1N6_gemv8_gt1k_xpdl_grope", "plain"):
        assert mode in gpu.MODES
        gpu.make_engine(None, mode, 1)
    assert grope == [("plain_grope", True, False, 4),
                     ("eagle_chain_S5K1N6_gemv8_gt1k_xpdl_grope", True, True, 8),
                     ("plain", False, False, 4)]
    assert fused.FUSE_GEMV_ROPE is False
    result = {"modes": {"plain": row(1000, 4000), "plain_grope": row(1100, 3600)}}
    gpu.chained_vs_1step(result)
    assert {B: round(r["tokens_per_s"], 9) for B, r in
            result["rope_in_gemv_vs_separate"]["plain"].items()} == {1: 1.1, 4: 0.9}
    from eaglekv.kernels import attention
    splits = []                     # the decode's split-K cap, while the engine is built
    monkeypatch.setattr(gpu, "_make_engine", lambda args, mode, b: splits.append(
        (mode, attention.MAX_SPLITS, fused.FUSE_GEMV_ROPE,
         attention.default_num_splits(1, 3, 4096))))
    for mode in ("plain_sp1", "plain_sp4", "plain_grope_sp1", "plain"):
        assert mode in gpu.MODES
        gpu.make_engine(None, mode, 1)
    assert splits == [("plain_sp1", 1, False, 1), ("plain_sp4", 4, False, 4),
                      ("plain_grope_sp1", 1, True, 1), ("plain", 16, False, 16)]
    result = {"modes": {"plain": row(1000, 4000), "plain_sp1": row(1200, 3000)}}
    gpu.chained_vs_1step(result)
    assert {B: round(r["tokens_per_s"], 9) for B, r in
            result["decode_one_split_vs_shipped"]["plain"].items()} == {1: 1.2, 4: 0.75}
    from eaglekv.kernels import greedy_triton
    picks = []                      # the greedy pick's split, while the engine is built
    monkeypatch.setattr(gpu, "_make_engine", lambda args, mode, b: picks.append(
        (mode, greedy_triton.split_count(1, 49152))))
    for mode in ("plain_gp1", "eagle_chain_S5K1N6_gp1", "plain"):
        gpu.make_engine(None, mode, 1)
    assert picks == [("plain_gp1", 1), ("eagle_chain_S5K1N6_gp1", 1), ("plain", 24)]
    result = {"modes": {"plain": row(1000, 4000), "plain_gp1": row(800, 4000)}}
    gpu.chained_vs_1step(result)
    assert {B: round(r["tokens_per_s"], 9) for B, r in
            result["greedy_pick_split_vs_one_program"]["plain"].items()} == {1: 1.25, 4: 1.0}


def test_jit_loads_names_kernels_first_launched_in_a_timed_run():
    """`jit_loads` records the kernels Triton specialises inside the block (its cache hook:
    a miss of the in-process cache), lets them compile (the hook returns False), and puts the
    previous hook back."""
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no knobs.runtime.jit_cache_hook")
    from eaglekv.bench import gpu
    before = knobs.runtime.jit_cache_hook
    with gpu.jit_loads() as loaded:
        hook = knobs.runtime.jit_cache_hook
        assert hook(key=(), repr="_extend_kernel[num_warps=4](q_ptr: *bf16)", fn=None,
                    compile={}, is_manual_warmup=False, already_compiled=False) is False
        hook(key=(), repr="_extend_merge_kernel[num_warps=1]()", fn=None, compile={},
             is_manual_warmup=False, already_compiled=False)
    assert loaded == ["_extend_kernel", "_extend_merge_kernel"]
    assert [d["kernel"] for d in loaded.details] == [
        "_extend_kernel[num_warps=4](q_ptr: *bf16)", "_extend_merge_kernel[num_warps=1]()"]
    # the launching eaglekv frames (none here: the hook was called from the test)
    assert all(d["launched_from"] == [] for d in loaded.details)
    assert knobs.runtime.jit_cache_hook is before


def test_full_batch_rate_and_its_table():
    """`full_batch_tokens_per_s`: the tokens of the decode steps that began with the whole
    batch decoding over their wall, the median over the runs; none where a run had no such
    step; its own table, without the floor (a batch-1 decode figure)."""
    from eaglekv.bench.gpu import full_batch_rate, table
    ph = [{"full_batch_ms": 100.0, "full_batch_tokens": 50}, {"full_batch_ms": 200.0,
                                                              "full_batch_tokens": 300},
          {"full_batch_ms": 50.0, "full_batch_tokens": 100}]
    assert full_batch_rate(ph) == pytest.approx(1500.0)      # the median of 500, 1500, 2000
    assert full_batch_rate(ph + [{"full_batch_ms": 0.0, "full_batch_tokens": 0}]) is None
    assert full_batch_rate([]) is None
    result = {"modes": {"plain": {"rows": {8: {"tokens_per_s": 9.0,
                                               "full_batch_tokens_per_s": 10.0}}},
                        "eagle3_chain_S7K1N8": {"rows": {8: {"tokens_per_s": 13.0,
                                                             "full_batch_tokens_per_s": 25.0}}}},
              "floor": {"smollm2_shape": {"compiled_graph_tok_s": 1100.0}}}
    text = table(result, "full_batch_tokens_per_s")
    assert "| full-batch tok/s (steps with every request decoding) | batch 8 |" in text
    assert "| eagle3_chain_S7K1N8 | 25.0 (2.50x) |" in text
    assert "floor" not in text and "floor" in table(result)


def test_decode_rate_leaves_the_prefill_out():
    """`decode_tokens_per_s`: the B x (n - 1) tokens after each request's first over the
    decode steps' wall, the median over the runs; none with waves (later prefills are among the
    decode steps); its own table (the floor in it: the floor is decode only) and ratios."""
    from eaglekv.bench.gpu import compare, decode_rate, table
    ph = [{"decode_ms": 100.0, "prefill_ms": 20.0}, {"decode_ms": 200.0, "prefill_ms": 50.0},
          {"decode_ms": 400.0, "prefill_ms": 9.0}]
    assert decode_rate(ph, 2, 101) == pytest.approx(2 * 100 / 0.2)        # the median run
    assert decode_rate(ph, 2, 101, waves=4) is None
    assert decode_rate([{"decode_ms": 0.0}], 1, 8) is None
    result = {"modes": {"plain": {"rows": {1: {"tokens_per_s": 900.0,
                                               "decode_tokens_per_s": 1000.0}}},
                        "eagle_chain_S5K1N6": {"rows": {1: {"tokens_per_s": 1800.0,
                                                            "decode_tokens_per_s": 2500.0}}}},
              "floor": {"smollm2_shape": {"compiled_graph_tok_s": 1100.0}}}
    compare(result)
    assert result["speedup_vs_plain"]["eagle_chain_S5K1N6"][1] == 2.0
    assert result["speedup_vs_plain_decode"]["eagle_chain_S5K1N6"][1] == 2.5
    text = table(result, "decode_tokens_per_s")
    assert "| decode tok/s (prefill excluded) | batch 1 |" in text
    assert "| eagle_chain_S5K1N6 | 2500.0 (2.50x) |" in text
    assert "| floor: torch.compile + one CUDA graph (same process) | 1100.0 |" in text
    assert "| eagle_chain_S5K1N6 | 1800.0 (2.00x) |" in table(result)
    # a compile inside one of a cell's timed runs marks the cell (the empty runs do not)
    result["modes"]["eagle_chain_S5K1N6"]["rows"][1]["triton_jit_loads"] = [[], ["_extend_kernel"]]
    result["modes"]["plain"]["rows"][1]["triton_jit_loads"] = [[], []]
    assert "| eagle_chain_S5K1N6 | 1800.0 (2.00x) (jit) |" in table(result)
    assert "| plain | 900.0 |" in table(result)


def test_chain_length_modes():
    """`*_1step` modes sync every step, `*_k64` ones chain 64 tokens (twice the default), the
    others the default; `chain64_vs_default` is mode_k64 / mode."""
    from eaglekv.bench import gpu
    assert [gpu.scheduler_steps(m) for m in ("plain_1step", "eagle_chain_S5K1N6_k64",
                                             "plain", "adaptive_1step")] == [1, 64, None, 1]
    result = {"modes": {"plain": {"rows": {1: {"tokens_per_s": 100.0}}},
                        "plain_k64": {"rows": {1: {"tokens_per_s": 110.0}}}}}
    gpu.chained_vs_1step(result)
    assert result["chain64_vs_default"]["plain"][1]["tokens_per_s"] == pytest.approx(1.1)


def test_an_unknown_mode_is_refused_before_anything_loads():
    """`eaglekv bench --table --modes plain,nope`: a ConfigError naming the mode (and the
    known ones), not a KeyError after the first engines were built."""
    from eaglekv.bench import gpu
    from eaglekv.errors import ConfigError
    args = SimpleNamespace(batches="1", modes="plain,eagle3_chain_S4K1N5@onednn,nope")
    with pytest.raises(ConfigError, match=r"unknown mode\(s\) \['eagle3_chain_S4K1N5@onednn', "
                                          r"'nope'\]; known: plain, "):
        gpu.main(args)


def test_a_missing_floor_script_is_refused_before_anything_loads(tmp_path):
    """`eaglekv bench --floor PATH` with no file there: a ConfigError naming the path before
    the modes run (it raised FileNotFoundError after a whole table's minutes on an H100,
    2026-12-07, and the run's JSON was never written)."""
    from eaglekv.bench import gpu
    from eaglekv.errors import ConfigError
    missing = str(tmp_path / "graph_floor.py")
    args = SimpleNamespace(batches="1", modes="plain", floor=missing)
    with pytest.raises(ConfigError, match=r"--floor '.*graph_floor\.py' is not a file"):
        gpu.main(args)


def test_bench_prompts_from_a_file(tiny_dir, tmp_path):
    """`eaglekv bench --table --prompts FILE`: request i of a batch takes the file's prompt
    i mod their count (eval-draft's format); a missing or malformed file is a ConfigError
    before anything loads."""
    import json
    from eaglekv.bench import gpu
    from eaglekv.errors import ConfigError
    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"ids": [5, 6, 7], "kind": "chat"}, {"ids": [9, 9]},
                             {"ids": [11], "kind": "code"}]))
    eng = tiny_engine(tiny_dir)
    assert gpu.prompts(eng, 5, str(f)) == [[5, 6, 7], [9, 9], [11], [5, 6, 7], [9, 9]]
    assert gpu.prompts(eng, 2) != gpu.prompts(eng, 2, str(f))
    for bad in (tmp_path / "none.json", tmp_path / "bad.json"):
        if bad.name == "bad.json":
            bad.write_text(json.dumps([{"ids": []}]))
        args = SimpleNamespace(batches="1", modes="plain", prompts=str(bad))
        with pytest.raises(ConfigError, match="--prompts"):
            gpu.main(args)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_cpu_bench_with_speculation(adaptive):
    """`eaglekv bench --spec ...` (the CPU bench, one request): plain and speculative side by
    side, greedy identical, the speculative summary naming its shape, or, for adaptive (the
    default with a shipped head; it raised AttributeError here before 2026-12-06), its
    candidates and steps per choice."""
    from eaglekv.bench.e2e import run_bench
    from eaglekv.config import SpecConfig
    sc = (SpecConfig("eagle", "random", adaptive=True) if adaptive else
          SpecConfig("eagle", "random", 3, 1, 4))
    res = run_bench("default", new_tokens=6, repeats=1, with_hf=False, spec=sc)  # a tokenizer
    sp = res["speculative"]
    assert sp["greedy_tokens_identical_to_plain"] is True
    assert res["tokens_per_s"]["eaglekv_spec"] > 0 and res["speedup_spec_vs_plain"] > 0
    if adaptive:
        assert sp["adaptive"] is True and sp["shapes"] == ["S1K1N2", "S3K1N4", "S5K1N6",
                                                           "S7K1N8"]   # S7 gated
        assert sum(sp["choices"].values()) > 0
    else:
        assert (sp["num_steps"], sp["topk"], sp["num_draft_tokens"]) == (3, 1, 4)


def test_run_modes_reports_each_engines_start_up(tiny_dir):
    """Each mode's row carries its engine's build time (weights, KV pool and, on CUDA, every
    graph's capture: what a bigger candidate set costs at start-up) and the timed runs."""
    from eaglekv.bench import gpu
    args = SimpleNamespace(new_tokens=6, model=str(tiny_dir), dtype="float32", device="cpu",
                           disable_cuda_graph=True, draft="default", repeats=1, out=None)
    out = gpu.run_modes(args, ["plain"], [1, 2])
    assert out["plain"]["engine_build_s"] > 0
    assert sorted(out["plain"]["rows"]) == [1, 2]
    assert all(r["tokens_per_s"] > 0 for r in out["plain"]["rows"].values())


def test_patched_puts_every_attribute_back():
    """The bench's variants set module attributes while a graph captures (`patched`): each is
    back after the block, an exception inside included, in reverse order (two settings of one
    attribute leave the first value)."""
    from eaglekv.bench.gpu import patched
    from eaglekv.kernels import fused
    rows, dot = fused.GEMV_MAX_ROWS, fused.GEMV_DOT_MAX_ROWS
    with patched([(fused, "GEMV_MAX_ROWS", 1), (fused, "GEMV_DOT_MAX_ROWS", 16)]):
        assert (fused.GEMV_MAX_ROWS, fused.GEMV_DOT_MAX_ROWS) == (1, 16)
    assert (fused.GEMV_MAX_ROWS, fused.GEMV_DOT_MAX_ROWS) == (rows, dot)
    with pytest.raises(RuntimeError):
        with patched([(fused, "GEMV_MAX_ROWS", 2), (fused, "GEMV_MAX_ROWS", 3)]):
            assert fused.GEMV_MAX_ROWS == 3
            raise RuntimeError("inside")
    assert fused.GEMV_MAX_ROWS == rows


def test_phase_sums_count_kernels_not_the_marks_spans():
    """On CUDA a part is the kernels launched in its host range: the same mark's device-side
    annotation (its span, idle gaps included) is counted neither in the part nor in `other`
    (counted, the H100 and H200 tables read S7's parts at ~59 ms a step where the step's
    kernels took 5.3)."""
    import torch

    from eaglekv.bench.gpu import phase_sums
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(name, dev, total=0.0, own=0.0, cpu_us=0.0):
        return SimpleNamespace(name=name, device_type=dev, device_time_total=total,
                               device_time=own, cpu_time_total=cpu_us)
    events = [ev("eaglekv::draft", cpu, total=300.0, cpu_us=900.0),
              ev("eaglekv::draft", cuda, total=4000.0, own=4000.0),   # the span
              ev("eaglekv::verify", cpu, total=600.0, cpu_us=700.0),
              ev("eaglekv::verify", cuda, total=5000.0, own=5000.0),
              ev("_gemv_kernel", cuda, total=300.0, own=300.0),
              ev("_gemv_kernel", cuda, total=600.0, own=600.0),
              ev("_merge_kernel", cuda, total=100.0, own=100.0)]    # outside every part
    got = phase_sums(events, True, steps=1)
    assert got == pytest.approx({"draft": 0.3, "verify": 0.6, "accept": 0.0, "extend": 0.0,
                                 "other": 0.1})
    on_cpu = phase_sums([e for e in events if e.device_type == cpu], False, steps=2)
    assert on_cpu == pytest.approx({"draft": 0.45, "verify": 0.35, "accept": 0.0,
                                    "extend": 0.0})


def test_hf_row_warms_up_at_the_timed_length(monkeypatch):
    """The HF row's untimed run is as long as the timed ones: its first 256-token run on the
    H200 ran a third of the speed of the later ones after an 8-token warm-up."""
    from eaglekv.bench import e2e, gpu
    calls = []
    monkeypatch.setattr(e2e, "load_hf", lambda *a: "hf")
    monkeypatch.setattr(e2e, "time_hf", lambda hf, ids, n, dev: calls.append(n) or 10.0 * n)
    args = SimpleNamespace(model="m", dtype="float32", device="cpu", new_tokens=256, repeats=3)
    row = gpu.hf_row(args, [1, 2, 3])
    assert calls == [256] * 4
    assert row == {"tokens_per_s": 2560.0, "runs": [2560.0] * 3}


def test_every_bench_script_compiles():
    """The scripts under bench/ that only a GPU loan runs at least compile here (a
    `global` after the name's first use in bench/attention_checks.py was a SyntaxError that
    also broke the scripts importing from it, found 2026-12-07)."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2] / "bench"
    scripts = sorted(root.glob("*.py"))
    assert len(scripts) > 10
    for path in scripts:
        compile(path.read_text(), str(path), "exec")            # raises SyntaxError
