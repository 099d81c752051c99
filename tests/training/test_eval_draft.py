"""`eaglekv eval-draft` (eaglekv/training/eval_draft.py) on a tiny random target, CPU: the
figures agree with each other (rates from the histogram, non-increasing; histogram over the
verify steps; accept length its mean), a real engine is lossless and an injected difference is
reported, the CLI runs end to end and writes its JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from eaglekv import Engine, EngineConfig, SamplingParams
from eaglekv.cli import main as cli_main
from eaglekv.core import SpecStats
from eaglekv.errors import ConfigError, ModelLoadError
from eaglekv.speculative.drafter import ScriptedDrafter
from eaglekv.training import eval_draft
from helpers import PROMPTS, expected_accepts, oracle

NEW = 24
PROMPTS_KINDS = [{"ids": p, "kind": k} for p, k in zip(PROMPTS, ("chat", "code", "chat", "code"))]


def test_position_rates_and_total():
    a = SpecStats(3, 9, 2, {1: 2, 3: 1})                  # steps accepting 0, 0, 2 drafts
    b = SpecStats(3, 9, 5, {2: 1, 4: 1, 3: 1}, {"S3K1N4": 3})   # 1, 3, 2
    st = SpecStats.total([a, None, b])
    assert (st.verify_steps, st.draft_tokens, st.accepted_tokens) == (6, 18, 7)
    assert st.accept_histogram == {1: 2, 2: 1, 3: 2, 4: 1} and st.choices == {"S3K1N4": 3}
    assert st.position_rates(4) == [4 / 6, 3 / 6, 1 / 6, 0.0]
    assert SpecStats().position_rates(2) == [0.0, 0.0]


def test_parse_shapes_and_temperatures():
    assert eval_draft.parse_shapes("S3K1N4,S5K1N6,tree:S4K2N8") == [(3, 1, 4), (5, 1, 6),
                                                                      (4, 2, 8)]
    assert eval_draft.parse_shapes(" chain:s1k1n2 ") == [(1, 1, 2)]
    assert eval_draft.parse_shapes("S3K1N4, Adaptive") == [(3, 1, 4), "adaptive"]
    assert eval_draft.parse_shapes("adaptive,adaptive:S1K1N2/tree:S4K2N8") == [
        "adaptive", ("adaptive", ((1, 1, 2), (4, 2, 8)))]
    for bad in ("S3K1", "tree:S3K1N4", "chain:S4K2N8", "S3K1N4,S3K1N4", "adaptive,adaptive",
                "adaptive2", "adaptive:", "adaptive:S3K1N4/adaptive", "adaptive:S3K1",
                "adaptive:S3K1N4,adaptive:S3K1N4"):
        with pytest.raises(ConfigError, match="--shapes"):
            eval_draft.parse_shapes(bad)
    assert eval_draft.parse_temperatures("1e-9,0.7") == [0.0, 0.7]    # below 1e-5: greedy
    for bad in ("0,x", "0,-1", "0,0.0"):
        with pytest.raises(ConfigError):
            eval_draft.parse_temperatures(bad)


def test_load_prompts(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"ids": [1, 2], "kind": "code"}, {"ids": [3], "chat": False},
                             {"ids": [4]}, "hello"]))
    assert eval_draft.load_prompts(str(f)) == [
        {"kind": "code", "ids": [1, 2]}, {"kind": "text", "ids": [3]},
        {"kind": "chat", "ids": [4]}, {"kind": "chat", "text": "hello"}]
    assert len(eval_draft.load_prompts(str(f), 2)) == 2
    # a string goes through the engine's chat template
    eng = SimpleNamespace(tokenizer=object(), apply_chat_template=lambda conv: [9, len(conv)])
    assert eval_draft.prompt_ids(eng, eval_draft.load_prompts(str(f)))[2:] == [[4], [9, 1]]
    f.write_text(json.dumps([{"ids": []}]))
    with pytest.raises(ConfigError, match="item 0"):
        eval_draft.load_prompts(str(f))


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Plain greedy continuations (EOS stops them, as in the evaluation), long enough for a
    script to look past the last token evaluated."""
    eng = Engine(EngineConfig(model=str(tiny_dir), max_total_tokens=2048))
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW + 8))]


def wrong(j: int) -> bool:
    """Where the scripted draft is wrong (output index j): a chain of 3 accepts 0, 1 or 3."""
    return j * j % 7 == 1


def scripted(reference):
    """Engines whose draft follows the plain greedy output, wrong where `wrong`."""
    def make(cfg):
        if not cfg.speculative.enabled:
            return Engine(cfg)
        topk = cfg.speculative.topk
        propose = oracle(PROMPTS, reference, wrong=wrong, topk=topk)
        return Engine(cfg, drafter=ScriptedDrafter(propose, 256))
    return make


def evaluate(tiny_dir, make_engine=Engine, temps=(0.0,), batch=2):
    base = EngineConfig(model=str(tiny_dir), max_total_tokens=2048, max_running_requests=batch)
    return eval_draft.evaluate(base, "eagle", "random", PROMPTS_KINDS, [(3, 1, 4), (3, 2, 6)],
                               list(temps), NEW, make_engine=make_engine, log=lambda m: None)


def test_figures_agree_and_greedy_is_lossless(tiny_dir, reference):
    res = evaluate(tiny_dir, scripted(reference), temps=(0.0, 0.7))
    assert [(r["shape"], r["temperature"]) for r in res["runs"]] == [
        ("chain_S3K1N4", 0.0), ("chain_S3K1N4", 0.7), ("tree_S3K2N6", 0.0), ("tree_S3K2N6", 0.7)]
    for r in res["runs"]:
        hist, steps = r["accept_histogram"], r["verify_steps"]
        assert sum(hist.values()) == steps > 0
        assert r["accept_length_mean"] == pytest.approx(sum(k * n for k, n in hist.items())
                                                        / steps)
        rates = r["position_rates"]
        assert len(rates) == r["num_steps"]
        assert all(a >= b for a, b in zip(rates, rates[1:]))
        assert rates == pytest.approx([sum(n for k, n in hist.items() if k > i + 1) / steps
                                       for i in range(len(rates))])
        assert r["accept_length_mean"] == pytest.approx(1 + sum(rates))
        assert set(r["accept_length_by_kind"]) == {"chat", "code"}
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0
        if r["temperature"] == 0:
            assert r["greedy_mismatches"] == 0 and r["mismatched"] == []
            assert rates[2] > 0 and rates[0] > rates[1]
        else:
            assert r["greedy_mismatches"] is None
    # the chain's exact histogram: each prompt's scripted accepts (no output stops early)
    assert all(len(r) == NEW + 8 for r in reference)
    want: dict[int, int] = {}
    for a in expected_accepts(64, 3, wrong, NEW) * len(PROMPTS):
        want[a + 1] = want.get(a + 1, 0) + 1
    assert res["runs"][0]["accept_histogram"] == want
    assert res["prompts_by_kind"] == {"chat": 2, "code": 2}
    assert [p["temperature"] for p in res["plain"]] == [0.0, 0.7]


def test_adaptive_is_measured_like_a_shape(tiny_dir):
    """`--shapes ...,adaptive`: the engine's default (adaptive over the device's candidates)
    runs the same prompts against the same plain run: greedy identical to plain, its steps per
    choice recorded (plain steps among them), rates up to its deepest candidate (the gated S7
    on the CPU, which a random head's drafts never open); a fixed shape's row has no choices.
    `adaptive:S1K1N2/S3K1N4` chooses among those only."""
    base = EngineConfig(model=str(tiny_dir), max_total_tokens=2048, max_running_requests=2)
    res = eval_draft.evaluate(base, "eagle", "random", PROMPTS_KINDS,
                              [(3, 1, 4), "adaptive", ("adaptive", ((1, 1, 2), (3, 1, 4)))],
                              [0.0], NEW, log=lambda m: None)
    fixed, adaptive, two = res["runs"]
    assert (fixed["shape"], adaptive["shape"]) == ("chain_S3K1N4", "adaptive")
    assert two["shape"] == "adaptive:S1K1N2/S3K1N4" and len(two["position_rates"]) == 3
    assert {c.removesuffix("+plain") for c in two["choices"]} <= {"plain", "S1K1N2", "S3K1N4"}
    assert two["greedy_mismatches"] == 0
    assert "choices" not in fixed and adaptive["num_steps"] is None
    assert sum(adaptive["choices"].values()) > 0
    assert ({c.removesuffix("+plain") for c in adaptive["choices"]}
            <= {"plain", "S1K1N2", "S3K1N4", "S5K1N6"})
    assert len(adaptive["position_rates"]) == 7
    assert adaptive["greedy_mismatches"] == 0 and adaptive["tokens_per_s"] > 0
    text = eval_draft.table({**res, "model": "m"})
    line = next(x for x in text.splitlines() if x.startswith("adaptive"))
    top = max(adaptive["choices"], key=adaptive["choices"].get)
    assert f"  steps {top} {adaptive['choices'][top]}" in line
    assert "steps" not in next(x for x in text.splitlines() if x.startswith("chain_S3K1N4"))


def test_injected_mismatch_is_reported(tiny_dir, monkeypatch):
    run_prompts = eval_draft.run_prompts

    def corrupt(engine, ids, params):   # the speculative engine's output for prompt 1 is off
        run = run_prompts(engine, ids, params)
        if engine.config.speculative.enabled:
            run.outputs[1].token_ids[3] ^= 1
        return run
    monkeypatch.setattr(eval_draft, "run_prompts", corrupt)
    res = evaluate(tiny_dir, batch=1)
    for r in res["runs"]:
        assert r["greedy_mismatches"] == 1
        assert r["mismatched"] == [{"prompt": 1, "first_difference": 3, "spec_tokens": NEW,
                                    "plain_tokens": NEW}]


def test_cli_end_to_end(tiny_dir, tmp_path, capsys):
    prompts, out = tmp_path / "prompts.json", tmp_path / "res" / "eval.json"
    prompts.write_text(json.dumps(PROMPTS_KINDS))
    argv = ["eval-draft", "--model", str(tiny_dir), "--draft", "random", "--prompts",
            str(prompts), "--max-prompts", "3", "--max-new-tokens", "6", "--shapes",
            "S2K1N3,tree:S2K2N4", "--temperatures", "0,0.7", "--batch", "2", "--out", str(out)]
    assert cli_main(argv) == 0
    res = json.loads(out.read_text())
    assert res["command"] == "eaglekv " + " ".join(argv)
    for key in ("date", "device", "model", "draft", "algorithm", "batch", "plain", "runs"):
        assert key in res
    assert (res["algorithm"], res["draft"], res["batch"], res["prompts"]) == ("eagle", "random",
                                                                              2, 3)
    assert len(res["runs"]) == 4
    assert [r["greedy_mismatches"] for r in res["runs"] if r["temperature"] == 0] == [0, 0]
    assert "chain_S2K1N3" in capsys.readouterr().out
    assert cli_main(argv + ["--num-steps", "3"]) == 2
    assert "--num-steps" in capsys.readouterr().err


def test_also_draft_runs_in_the_same_process(tiny_dir, tmp_path, capsys):
    """--also-draft: a second draft measured against the same plain runs, its rows labelled by
    algorithm and draft, in the JSON and the table; a bad value is a usage error."""
    prompts, out = tmp_path / "prompts.json", tmp_path / "eval.json"
    prompts.write_text(json.dumps(PROMPTS_KINDS))
    argv = ["eval-draft", "--model", str(tiny_dir), "--draft", "random", "--prompts",
            str(prompts), "--max-prompts", "2", "--max-new-tokens", "5", "--shapes", "S2K1N3",
            "--temperatures", "0", "--out", str(out), "--also-draft", "eagle:random",
            "--also-draft", "multi_layer_eagle:random"]
    assert cli_main(argv) == 0
    res = json.loads(out.read_text())
    assert res["also"] == [["eagle", "random"], ["multi_layer_eagle", "random"]]
    assert [(r["algorithm"], r["draft"]) for r in res["runs"]] == [
        ("eagle", "random"), ("eagle", "random"), ("multi_layer_eagle", "random")]
    assert len(res["plain"]) == 1                       # one plain run for every draft
    assert all(r["greedy_mismatches"] == 0 for r in res["runs"])
    assert "multi_layer_eagle:random  chain_S2K1N3" in capsys.readouterr().out
    assert eval_draft.parse_also(["/some/dir", "eagle3:default"], "eagle") == [
        ("eagle", "/some/dir"), ("eagle3", "default")]
    with pytest.raises(ConfigError, match="--also-draft"):
        eval_draft.parse_also(["eagle3:"], "eagle")


def test_a_bad_also_draft_fails_before_any_run(tiny_dir, tmp_path, capsys, monkeypatch):
    """A draft directory without weights (or without config.json, or missing) given with
    --also-draft fails before the first engine is built, naming the path; the shipped heads
    and "random" pass the check."""
    prompts, out = tmp_path / "prompts.json", tmp_path / "eval.json"
    prompts.write_text(json.dumps(PROMPTS_KINDS))
    empty = tmp_path / "head3"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    built = []
    monkeypatch.setattr(eval_draft, "evaluate", lambda *a, **k: built.append(a))
    argv = ["eval-draft", "--model", str(tiny_dir), "--draft", "random", "--prompts",
            str(prompts), "--max-prompts", "2", "--max-new-tokens", "5", "--shapes", "S2K1N3",
            "--temperatures", "0", "--out", str(out), "--also-draft", f"eagle3:{empty}"]
    assert cli_main(argv) != 0
    assert f"no weights in {empty}" in capsys.readouterr().err
    assert built == [] and not out.exists()
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        (empty / "config.json").unlink()
        eval_draft.check_drafts([("eagle3", str(empty))])
    with pytest.raises(ModelLoadError, match="does not exist"):
        eval_draft.check_drafts([("eagle", str(tmp_path / "nowhere"))])
    eval_draft.check_drafts([("eagle", "default"), ("eagle3", "default"), ("eagle", "random")])
