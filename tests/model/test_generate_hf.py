"""Greedy generation on SmolLM2 is token-identical to HF transformers `generate`."""

from __future__ import annotations

import pytest

from eaglekv import SamplingParams
from helpers import hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_hf_generate(smol_engine, smol_hf, prompt):
    """40 greedy tokens (or up to EOS) equal HF's, and the KV is all returned afterwards."""
    ids = smol_engine.encode(prompt)
    ref = hf_greedy(smol_hf, ids, 40)
    out = smol_engine.generate([ids], SamplingParams(max_new_tokens=40))[0]
    assert out.token_ids == ref
    assert len(ref) >= 32 or ref[-1] in smol_engine.eos_ids
    smol_engine.check_memory()


@pytest.mark.slow
def test_chat_greedy_equals_hf_generate(smol_engine, smol_hf):
    """A chat-templated prompt: the template comes from the GGUF, the tokens equal HF's."""
    conv = [{"role": "user", "content": "What is the tallest mountain on Earth?"}]
    ids = smol_engine.apply_chat_template(conv)
    assert ids[:1] == smol_engine.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    ref = hf_greedy(smol_hf, ids, 48)
    out = smol_engine.chat(conv, SamplingParams(max_new_tokens=48))[0]
    assert out.token_ids == ref
    assert "Everest" in out.text
