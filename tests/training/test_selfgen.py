"""Data made by the target (eaglekv.training.selfgen, prompt_writer, feeder, seqstore) on the
CPU: cleaning and the held-out topic split; prompts written by the default model; responses from
the engine equal to its own greedy output, ending at EOS or max_new; the uint16 store round trip,
shard sizes and refusals; the time budget leaving a partial, valid dataset."""

from __future__ import annotations

import argparse
import json
import random
import time

import pytest
import torch

from eaglekv.config import SamplingParams
from eaglekv.training.prompt_writer import (KIND_MIX, clean_prompt, held_out_topics,
                                            kind_topics, near_key, norm_key, parse_candidates,
                                            write_prompts)
from eaglekv.training.selfgen import add_gen_data_arguments, generate_responses, run_gen_data
from eaglekv.training.seqstore import KINDS, load_gen_data, save_gen_data
from helpers import tiny_engine


def random_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"ids": [rng.randrange(3, 256) for _ in range(rng.randrange(2, 9))],
             "kind": rng.choice(["chat", "code", "math"]), "chat": True,
             "held_out": i % 4 == 0, "text": f"prompt {i}"} for i in range(n)]


def random_seqs(n: int, seed: int = 0, top: int = 49152) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(top) for _ in range(rng.randrange(1, 300))]
        out.append({"ids": ids, "n_prompt": rng.randrange(len(ids) + 1),
                    "greedy": rng.random() < 0.5, "chat": rng.random() < 0.8,
                    "kind": rng.choice(KINDS), "held_out": rng.random() < 0.2})
    return out


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return tiny_engine(tiny_dir, max_running_requests=8)


# ---- cleaning and the held-out split ------------------------------------------------------------
def test_parse_and_clean():
    text = (" How do volcanoes form?\n2. **What is lava made of?**\n3. \"Explain magma.\"\n"
            "4. ok\nnot an item\n5. Questions people ask an AI assistant about rocks?")
    items = parse_candidates(text, numbered_first=True)
    assert items[:3] == ["How do volcanoes form?", "**What is lava made of?**",
                         "\"Explain magma.\""] and len(items) == 5
    cleaned = [clean_prompt(c, "chat") for c in items]
    assert cleaned == ["How do volcanoes form?", "What is lava made of?", None, None, None]
    assert clean_prompt("Explain how magma rises to the surface.", "explanation")
    assert clean_prompt("Write a Python function that sorts a list.", "code")
    assert clean_prompt("How does Socrates think about life?", "code") is None   # not code
    assert clean_prompt("A box holds 12 eggs. How many boxes hold 60?", "math")
    assert clean_prompt("How do they help people in need?", "chat") is None  # lost subject
    assert clean_prompt("The sky over the bay was grey.", "chat") is None   # not a question
    assert clean_prompt("The sky over the bay was grey.", "raw")             # a sentence
    assert clean_prompt("Why is it so? " * 16, "chat") is None                # > 60 words
    assert clean_prompt("Why is it so? " * 5, "chat") is None                 # a loop
    chat_list = "Here's a list of questions:\n\n1. What do owls eat?\n2. Why do owls hoot?"
    assert parse_candidates(chat_list, numbered_first=False) == ["What do owls eat?",
                                                                 "Why do owls hoot?"]
    assert norm_key("What's a volcano?") == norm_key("what s a VOLCANO")
    assert near_key("What is a volcano made of?") == near_key("a volcano: what made of")


def test_held_out_topics_disjoint_deterministic():
    held = held_out_topics(0.1)
    assert held == held_out_topics(0.1) and not held_out_topics(0.0)
    for kind in KINDS:
        pool = set(kind_topics(kind))
        train = pool - held
        assert pool & held and train and not train & held, kind
    allt = set().union(*(kind_topics(k) for k in KINDS))
    assert 0.04 < len(held) / len(allt) < 0.2


# ---- the target writes prompts (the default model: a tokenizer and sensible text) ---------------
def test_write_prompts_default_model(smol_engine):
    mix = {"chat": 0.5, "code": 0.5}
    out, stats = write_prompts(smol_engine, 6, heldout_frac=0.3, seed=1, mix=mix, max_new=48,
                               deadline=time.monotonic() + 12, progress=False)
    assert out and stats["output_tokens"] > 0
    held = held_out_topics(0.3)
    texts = [p["text"] for p in out]
    assert len(set(map(norm_key, texts))) == len(texts)                  # deduplicated
    for p in out:
        assert p["text"].strip() and clean_prompt(p["text"], p["kind"]) == p["text"]
        assert p["kind"] in mix and p["held_out"] == (p["topic"] in held)
        assert p["ids"] == smol_engine.apply_chat_template([{"role": "user",
                                                             "content": p["text"]}])


# ---- responses from the engine ------------------------------------------------------------------
def test_responses_are_the_engines_own(engine):
    prompts = random_prompts(12)
    ref = engine.generate([p["ids"] for p in prompts], SamplingParams(max_new_tokens=10))
    eos = ref[0].token_ids[3]          # a token the model emits: EOS ends some responses early
    eos_ids, engine.eos_ids = engine.eos_ids, frozenset({eos})
    try:
        seqs, stats = generate_responses(engine, prompts, max_new=10, greedy_frac=0.5, seed=3,
                                         progress=False)
        ref = engine.generate([p["ids"] for p in prompts], SamplingParams(max_new_tokens=10))
    finally:
        engine.eos_ids = eos_ids
    assert len(seqs) == len(prompts) and not stats["cut_by_budget"]
    by_prompt = {tuple(s["ids"][:s["n_prompt"]]): s for s in seqs}
    greedy = ended = 0
    for p, r in zip(prompts, ref):
        s = by_prompt[tuple(p["ids"])]
        resp = s["ids"][s["n_prompt"]:]
        assert s["kind"] == p["kind"] and s["held_out"] == p["held_out"]
        assert (resp[-1] == eos or len(resp) == 10) and eos not in resp[:-1]
        if s["greedy"]:
            greedy += 1
            assert resp == r.token_ids
        ended += resp[-1] == eos
    assert 0 < greedy < len(prompts) and ended > 0
    engine.check_memory()


def test_budget_stops_early_with_a_valid_partial_dataset(engine, tmp_path):
    prompts = random_prompts(200, seed=1)
    t = time.monotonic()
    seqs, stats = generate_responses(engine, prompts, max_new=64, greedy_frac=0.5,
                                     deadline=t + 1.0, progress=False)
    assert time.monotonic() - t < 2.5
    assert stats["cut_by_budget"] and 0 < len(seqs) < len(prompts)
    assert all(len(s["ids"]) - s["n_prompt"] == 64 or s["ids"][-1] == 2 for s in seqs)
    assert not engine.has_unfinished()
    engine.check_memory()
    save_gen_data(tmp_path, seqs)
    back = load_gen_data(tmp_path)
    assert [b["ids"] for b in back] == [s["ids"] for s in seqs]


def test_a_failing_step_drops_only_its_requests(engine, monkeypatch, capsys):
    run, calls = engine.runner.run, []

    def flaky(plan):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return run(plan)
    monkeypatch.setattr(engine.runner, "run", flaky)
    prompts = random_prompts(20, seed=2)
    seqs, stats = generate_responses(engine, prompts, max_new=6, greedy_frac=1.0,
                                     progress=False)
    assert stats["failed"] > 0 and len(seqs) == len(prompts) - stats["failed"]
    assert "injected" in capsys.readouterr().err
    ref = engine.generate([s["ids"][:s["n_prompt"]] for s in seqs],
                          SamplingParams(max_new_tokens=6))
    assert [s["ids"][s["n_prompt"]:] for s in seqs] == [r.token_ids for r in ref]
    engine.check_memory()


# ---- the store ----------------------------------------------------------------------------------
def test_uint16_round_trip_and_shards(tmp_path):
    seqs = random_seqs(120, top=65536)
    seqs[0]["ids"][:3] = [0, 65535, 49151]
    limit = 12 * 1024
    paths = save_gen_data(tmp_path, seqs, {"seed": 7}, max_file_bytes=limit)
    assert len(paths) > 3 and all(p.stat().st_size <= limit for p in paths)
    back = load_gen_data(tmp_path)
    assert back == seqs
    assert load_gen_data(tmp_path, "train") == [s for s in seqs if not s["held_out"]]
    assert load_gen_data(tmp_path / "manifest.json", "held_out") == [s for s in seqs
                                                                     if s["held_out"]]
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["seed"] == 7 and man["sequences"] == 120
    assert man["tokens"] == sum(len(s["ids"]) for s in seqs)
    assert sum(f["sequences"] for f in man["files"]) == 120


def test_store_refuses_ids_beyond_uint16(tmp_path):
    seqs = random_seqs(3)
    seqs[2]["ids"][1] = 65536
    with pytest.raises(ValueError, match=r"token id 65536 \(sequence 2, position 1\)"):
        save_gen_data(tmp_path, seqs)
    assert not list(tmp_path.iterdir())                                   # nothing written
    with pytest.raises(ValueError, match="max_file_bytes"):
        save_gen_data(tmp_path, [{"ids": [1] * 5000, "n_prompt": 1, "greedy": True,
                                  "chat": True, "kind": "chat", "held_out": False}],
                      max_file_bytes=8192)


# ---- the stage's options ------------------------------------------------------------------------
def test_gen_data_options(tmp_path):
    p = argparse.ArgumentParser()
    add_gen_data_arguments(p.add_subparsers(dest="stage"))
    args = p.parse_args(["gen-data", "--out", str(tmp_path), "--n-prompts", "5",
                         "--budget", "9", "--greedy-frac", "0.5", "--heldout-frac", "0.2"])
    assert (args.stage, args.n_prompts, args.budget, args.model, args.device) == \
        ("gen-data", 5, 9.0, "default", "auto")
    args.greedy_frac = 1.5
    with pytest.raises(SystemExit, match="--greedy-frac=1.5"):
        run_gen_data(args)
    assert set(KIND_MIX) == set(KINDS)


def test_gen_data_stage_on_the_default_model(smol_engine, tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_gen_data_arguments(p.add_subparsers(dest="stage"))
    # a budget the 6 prompts need a fraction of on an idle 2-core machine (~6 s): at 8 s a
    # loaded machine (a second suite beside it) spent it all writing prompts, none answered
    args = p.parse_args(["gen-data", "--out", str(tmp_path), "--n-prompts", "6", "--budget", "30",
                         "--max-new", "8", "--write-max-new", "48", "--write-frac", "0.7",
                         "--heldout-frac", "0.5", "--no-progress"])
    t = time.monotonic()
    assert run_gen_data(args, "test", engine=smol_engine) == 0
    assert time.monotonic() - t < 30 + 2
    man = json.loads((tmp_path / "manifest.json").read_text())
    seqs = load_gen_data(tmp_path)
    assert man["command"] == "test" and man["sequences"] == len(seqs) > 0
    assert man["responses"]["tok_s"] > 0 and man["generation"]["max_new"] == 8
    assert all(0 < len(s["ids"]) - s["n_prompt"] <= 8 for s in seqs)
    held = json.loads((tmp_path / "heldout_prompts.json").read_text())
    assert len(held) == man["prompts"]["held_out"]
    assert all(h["ids"] and h["kind"] in KINDS for h in held)
    assert "sequences" in capsys.readouterr().out


class KindRequest:
    def __init__(self, params, left):
        self.params, self.left, self.output_ids = params, left, []
        self.finished, self.finish_reason = False, None


class KindEngine:
    """A stand-in engine for the Feeder: a request runs 1-4 steps; each step records the
    greedy flags of the requests in it."""

    def __init__(self):
        self.running, self.steps = [], []

    def add_request(self, ids, params):
        req = KindRequest(params, 1 + sum(ids) % 4)
        self.running.append(req)
        return req

    def step(self):
        self.steps.append({r.params.greedy for r in self.running})
        for r in self.running:
            r.output_ids.append(7)
            r.left -= 1
            if r.left == 0:
                r.finished, r.finish_reason = True, "length"
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return done

    def abort(self, req):
        self.running.remove(req)


@pytest.mark.parametrize("homogeneous", [True, False])
def test_feeder_never_mixes_greedy_and_sampled(homogeneous):
    """Greedy and sampled jobs interleaved one by one: with `homogeneous` (the default) no step
    holds both kinds (an all-greedy batch keeps its multi-step chain), every job still runs
    once, and the kind switches a bounded number of times; without it they mix."""
    from eaglekv.training.feeder import Feeder, Job
    eng, done = KindEngine(), []
    feeder = Feeder(eng, capacity=8, max_new=4, homogeneous=homogeneous)
    rng = random.Random(0)
    for i in range(200):
        params = (SamplingParams(max_new_tokens=4) if i % 2 == 0 else
                  SamplingParams(max_new_tokens=4, temperature=0.7, seed=i))
        feeder.push(Job([rng.randrange(100)], params, lambda r, i=i: done.append(i)))
    feeder.run()
    assert sorted(done) == list(range(200)) and not feeder.queue
    mixed = sum(len(kinds) > 1 for kinds in eng.steps)
    if homogeneous:
        assert mixed == 0
        # the first 4 x capacity queued jobs are searched, so a kind runs on while any of
        # its jobs is among them: a few switches, not one per job (5 here)
        assert 2 <= feeder.stats()["kind_switches"] <= 200 // 16
    else:
        assert mixed > len(eng.steps) // 2
