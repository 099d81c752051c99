"""Text-level behaviour on SmolLM2: stop strings, streaming text, the CLI."""

from __future__ import annotations

import pytest

from eaglekv import SamplingParams
from eaglekv.cli import main as cli_main

pytestmark = pytest.mark.slow
PROMPT = "List the days of the week: Monday, Tuesday,"


def test_stop_string_truncates_text(smol_engine):
    """The text ends right before the first stop string; tokens end where it completed."""
    free = smol_engine.generate(PROMPT, SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert "Friday" in free.text
    out = smol_engine.generate(PROMPT, SamplingParams(max_new_tokens=24, stop=("Friday", "xyz")))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.index("Friday")]
    assert out.token_ids == free.token_ids[:len(out.token_ids)]
    assert "Friday" in smol_engine.tokenizer.decode(out.token_ids)
    assert "Friday" not in smol_engine.tokenizer.decode(out.token_ids[:-1])
    smol_engine.check_memory()


def test_stream_text_equals_generate(smol_engine):
    """Streamed text deltas concatenate to the generated text, stop string held back."""
    sp = SamplingParams(max_new_tokens=24, stop=("Friday",))
    ref = smol_engine.generate(PROMPT, sp)[0]
    deltas = list(smol_engine.stream(PROMPT, sp))
    assert "".join(d.text for d in deltas) == ref.text
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert len(deltas) > 3 and deltas[-1].finish_reason == "stop"
    smol_engine.check_memory()


def test_batched_smollm2_equals_solo(smol_engine):
    """Three prompts of different lengths batched give the one-at-a-time greedy tokens."""
    prompts = ["Hello, my name is", PROMPT, "The three primary colors are red,"]
    sp = SamplingParams(max_new_tokens=20)
    solo = [smol_engine.generate(p, sp)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in smol_engine.generate(prompts, sp)]
    assert batched == solo
    smol_engine.check_memory()


def test_cli_generate_prints_text_and_speed(capsys):
    rc = cli_main(["generate", "The capital of France is", "--max-new-tokens", "6"])
    cap = capsys.readouterr()
    assert rc == 0 and "Paris" in cap.out
    assert "tokens/s" in cap.err


def test_cli_reports_errors_without_traceback(capsys):
    rc = cli_main(["generate", "x", "--model", "/nonexistent/model"])
    assert rc == 2 and "ModelLoadError: model path /nonexistent/model does not exist" in \
        capsys.readouterr().err
