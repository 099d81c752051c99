"""Incremental detokenization (engine/detok.py) on SmolLM2's tokenizer: after every append its
text is the whole decode of the tokens so far, over random token runs (multi-byte characters
split across byte tokens, special tokens, appends of 1-40 tokens as chains make); through a
request, streamed deltas concatenate to the final text and stop strings cut where a whole
decode after every token would; and a long stream decodes only a window a step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglekv.config import SamplingParams
from eaglekv.engine.detok import IncrementalDetokenizer
from eaglekv.engine.request import Req

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok():
    from eaglekv.model.loader import default_model_path
    from eaglekv.model.tokenizer import load_gguf_tokenizer
    return load_gguf_tokenizer(default_model_path())


def _pieces(tok) -> list[int]:
    """Token ids of text with multi-byte characters (split over byte tokens), spaces,
    newlines and the special tokens, to draw from."""
    text = "Grüße, 東京 🙂 café naïve — ok\n  x = [1, 2]; ∑ é"
    ids = tok.encode(text, add_special_tokens=False)
    return sorted(set(ids) | {0, 1, 2} | set(range(130, 200)))   # specials and raw bytes


def whole(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_update_is_the_whole_decode(tok, data):
    pool = _pieces(tok)
    ids: list[int] = []
    d = IncrementalDetokenizer(lambda x: whole(tok, x))
    for _ in range(data.draw(st.integers(1, 12))):
        ids += data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=40))
        assert d.update(ids) == whole(tok, ids)
        assert d.update(ids) == whole(tok, ids)           # nothing new: the same text


def test_update_decodes_a_window_not_the_whole_text(tok):
    """2000 tokens appended one at a time: every decode call sees a few tokens."""
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 250,
                     add_special_tokens=False)[:2000]
    sizes = []

    def decode(x):
        sizes.append(len(x))
        return whole(tok, x)
    d = IncrementalDetokenizer(decode)
    for n in range(1, len(ids) + 1):
        d.update(ids[:n])
    assert d.update(ids) == whole(tok, ids)
    assert max(sizes) <= 4
    with pytest.raises(ValueError, match="only grows"):
        d.update(ids[:10])


def _req(tok, params: SamplingParams) -> Req:
    return Req(rid=0, prompt_ids=[1, 2], params=params, generator=torch.Generator(),
               eos_ids=frozenset(), tokenizer=tok)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_stream_deltas_and_stop_strings_as_whole_decodes(tok, data):
    """A request fed random runs: the deltas concatenate to the final text; with a stop
    string, the output ends at the token where the whole decode first holds it and the text
    right before it (as the whole decode after every token decided)."""
    pool = _pieces(tok)
    run = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=200))
    stop = data.draw(st.sampled_from([(), ("é",), ("ok", "x ="), ("\n",)]))
    p = SamplingParams(max_new_tokens=len(run), stop=stop, ignore_eos=True)
    r = _req(tok, p)
    sent, i = "", 0
    while i < len(run) and not r.finished:
        k = data.draw(st.integers(1, 33))
        r.append_tokens(run[i:i + k])
        i += k
        delta = r.stream_delta()
        sent += delta.text if delta else ""
    assert r.finished
    delta = r.stream_delta()
    sent += delta.text if delta else ""
    assert sent == r.refresh_text()
    # the reference: a whole decode after every token
    cut = next((n for n in range(1, len(run) + 1)
                if any(s in whole(tok, run[:n]) for s in stop)), None)
    if cut is None:
        assert r.output_ids == run and r.text == whole(tok, run)
    else:
        text = whole(tok, run[:cut])
        assert r.output_ids == run[:cut] and r.finish_reason == "stop"
        assert r.text == text[:min(text.find(s) for s in stop if s in text)]
