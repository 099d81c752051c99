"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP
(uvicorn on a free port) on SmolLM2: greedy answers equal the engine's own, streams add up to
the same text, concurrent streams stay apart, a client that leaves frees its KV, bad input gets
an OpenAI-style 400, and the engine is back to empty after every scenario."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from eaglekv.config import SamplingParams  # noqa: E402
from eaglekv.errors import KVIndexError  # noqa: E402
from eaglekv.server.local import LocalServer  # noqa: E402

MODEL = "smollm2"
pytestmark = pytest.mark.slow


class Server(LocalServer):
    def __init__(self, engine, name=MODEL):
        super().__init__(engine, name, default_max_tokens=24)
        self.client = self.client()


@pytest.fixture(scope="module")
def server(smol_engine):
    s = Server(smol_engine)
    yield s
    s.wait_idle()
    s.stop()


def reference(server, prompt, n: int):
    out = server.on_engine(lambda e: e.generate([prompt], SamplingParams(max_new_tokens=n))[0])
    return out


PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


def test_one_loop_per_engine(server):
    from eaglekv.server import EngineLoop
    with pytest.raises(RuntimeError, match="already driven by a running EngineLoop"):
        EngineLoop(server.loop.engine)


def test_models_and_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in server.client.models.list().data] == [MODEL]


def test_completion_greedy_equals_engine(server):
    ref = reference(server, PROMPT, 20)
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                         temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    ids = ref.prompt_token_ids                        # token-id prompts give the same answer
    r2 = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert r2.choices[0].text == ref.text
    server.wait_idle()


def test_chat_greedy_and_stream_equal_engine(server):
    ref = server.on_engine(lambda e: e.chat(CHAT, SamplingParams(max_new_tokens=24))[0])
    r = server.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0)
    assert r.choices[0].message.content == ref.text       # default_max_tokens=24
    assert r.choices[0].message.role == "assistant"
    chunks = list(server.client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    server.wait_idle()


def test_concurrent_streams_stay_apart(server):
    prompts = ["One, two, three,", "The sky is", "def fibonacci(n):", "Water boils at"]
    refs = [reference(server, p, 16).text for p in prompts]
    got = [None] * len(prompts)

    def run(i):
        s = server.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16,
                                             temperature=0, stream=True)
        got[i] = "".join(c.choices[0].text for c in s)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == refs
    server.wait_idle()


def test_seeded_sampling_n_choices(server):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=11)
    a = server.client.completions.create(**kw)
    b = server.client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]   # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1                          # seed + i per choice
    assert a.usage.prompt_tokens == len(reference(server, PROMPT, 1).prompt_token_ids)
    server.wait_idle()


def test_penalties_reach_the_engine(server):
    pen = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3)
    ref = server.on_engine(lambda e: e.generate([PROMPT], SamplingParams(max_new_tokens=20,
                                                                         **pen))[0])
    plain = reference(server, PROMPT, 20)
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                         temperature=0, presence_penalty=0.6,
                                         frequency_penalty=0.4,
                                         extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].text == ref.text != plain.text
    server.wait_idle()


def test_streamed_choices_and_prompts(server):
    """n > 1 and lists of prompts stream too: chunks carry their choice index, each choice
    adds up to what the same request gives unstreamed, usage counts every choice."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=11)
    whole = server.client.completions.create(**kw)
    chunks = list(server.client.completions.create(**kw, stream=True,
                                                   stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    prompts = ["One, two, three,", "The sky is"]
    refs = [reference(server, p, 10).text for p in prompts]
    got = ["", ""]
    for c in server.client.completions.create(model=MODEL, prompt=prompts, max_tokens=10,
                                              temperature=0, stream=True):
        got[c.choices[0].index] += c.choices[0].text
    assert got == refs
    chat = list(server.client.chat.completions.create(model=MODEL, messages=CHAT, n=2,
                                                      max_tokens=6, stream=True, seed=3))
    assert [c.choices[0].delta.role for c in chat[:2]] == ["assistant", "assistant"]
    assert sorted(c.choices[0].index for c in chat[:2]) == [0, 1]
    server.wait_idle()


def test_client_disconnect_frees_kv(server):
    aborted = server.metric('eaglekv_requests_total{endpoint="completions",status="aborted"}')
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break                                  # one chunk, then hang up
    server.wait_idle(timeout=10)   # 2000 tokens would take minutes here: it was aborted
    assert server.metric('eaglekv_requests_total{endpoint="completions",status="aborted"}') \
        == aborted + 1


def test_client_disconnect_non_streaming_frees_kv(server):
    """A non-streaming client that gives up (here a 2 s read timeout) is noticed too."""
    aborted = server.metric('eaglekv_requests_total{endpoint="chat",status="aborted"}')
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=2)
    server.wait_idle(timeout=10)
    assert server.metric('eaglekv_requests_total{endpoint="chat",status="aborted"}') \
        == aborted + 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens=0 must be >= 1"),
    (dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(max_tokens=100000), "exceeds max_context_len"),
    (dict(logprobs=21), r"logprobs=21 must be in \[0, 20\]"),
    (dict(n=0), r"n=0 must be in \[1, 128\]"),
    (dict(n=129, stream=True), r"n=129 must be in \[1, 128\]"),
    (dict(presence_penalty=2.5), r"presence_penalty=2.5 must be in \[-2, 2\]"),
    (dict(logit_bias={"5": 1}), r"logit_bias=\{'5': 1\} is not supported"),
    (dict(extra_body={"beam_width": 4}), "unknown field 'beam_width'"),
    (dict(prompt=[70000]), r"prompt token id 70000 outside the vocabulary"),
])
def test_bad_requests_get_openai_400(server, kwargs, match):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError, match=match) as e:
        server.client.completions.create(**kw)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    server.wait_idle()


def test_unknown_model_404_and_chat_validation(server):
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' does not exist"):
        server.client.chat.completions.create(model="gpt-4", messages=CHAT)
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    for extra, msg in (({"top_logprobs": 2}, "top_logprobs needs logprobs=true"),
                       ({"logprobs": True, "top_logprobs": 21},
                        "top_logprobs=21 must be in [0, 20]")):
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": CHAT} | extra)
        assert r.status_code == 400 and r.json()["error"]["message"] == msg
        assert r.json()["error"]["param"] == "top_logprobs"


def engine_logprobs(server, prompt_or_chat, n: int, k: int):
    params = SamplingParams(max_new_tokens=n, logprobs=k)
    if isinstance(prompt_or_chat, str):
        return server.on_engine(lambda e: e.generate([prompt_or_chat], params)[0])
    return server.on_engine(lambda e: e.chat(prompt_or_chat, params)[0])


def test_completion_logprobs_equal_engine(server):
    ref = engine_logprobs(server, PROMPT, 12, 3)
    tok = server.loop.engine.tokenizer
    words = [tok.decode([t.token_id]) for t in ref.logprobs]
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                         temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == words and "".join(words) == r.choices[0].text == ref.text
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-5)
    assert [list(d) for d in lp.top_logprobs] == [[tok.decode([i]) for i, _ in t.top]
                                                  for t in ref.logprobs]
    assert all(c == pytest.approx(max(d.values())) for c, d in zip(lp.token_logprobs,
                                                                    lp.top_logprobs))  # greedy
    assert lp.text_offset == [sum(len(w) for w in words[:i]) for i in range(len(words))]
    chunks = list(server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                                   temperature=0, logprobs=3, stream=True))
    got = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((g.tokens for g in got), []) == words
    assert sum((g.text_offset for g in got), []) == lp.text_offset
    assert sum((g.token_logprobs for g in got), []) == pytest.approx(lp.token_logprobs)
    assert all(c.choices[0].logprobs is None for c in server.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, stream=True))          # not asked: null
    server.wait_idle()


def test_chat_logprobs_equal_engine(server):
    ref = engine_logprobs(server, CHAT, 24, 2)
    tok = server.loop.engine.tokenizer
    r = server.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t.token_id]) for t in ref.logprobs]
    assert [c.logprob for c in content] == pytest.approx([t.logprob for t in ref.logprobs],
                                                         abs=1e-5)
    assert all(c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2
               for c in content)
    assert [[a.token for a in c.top_logprobs] for c in content] == \
        [[tok.decode([i]) for i, _ in t.top] for t in ref.logprobs]
    stream = server.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                                   logprobs=True, stream=True)
    got = [x for c in stream if c.choices and c.choices[0].logprobs
           for x in c.choices[0].logprobs.content]
    assert [c.token for c in got] == [c.token for c in content]        # every token, once
    assert all(c.top_logprobs == [] for c in got)                       # top_logprobs unset: 0
    assert r.choices[0].logprobs is not None and server.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2).choices[0].logprobs is None
    server.wait_idle()


def break_next_forward(server, error: Exception) -> None:
    """The engine's next model forward raises `error` (once)."""
    def patch(engine):
        real = engine.model.forward

        def forward(*a, **k):
            engine.model.forward = real
            raise error
        engine.model.forward = forward
    server.on_engine(patch)


def test_failed_batch_is_500_then_the_server_serves(server):
    """An index error inside a step fails that batch with a 500; the next request is fine."""
    break_next_forward(server, KVIndexError("store_cache", 99999, 4112, 1, 1, layer=3))
    with pytest.raises(openai.InternalServerError, match="slot 99999 out of range"):
        server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                         temperature=0)
    server.wait_idle()
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                         temperature=0)
    assert r.choices[0].text == reference(server, PROMPT, 8).text


def test_crash_inside_a_step_fails_its_requests_then_serves(server):
    """Not an index error but a bug (here a RuntimeError out of the model): the requests in
    flight get a 500, their KV is freed, the engine thread lives on."""
    break_next_forward(server, RuntimeError("kernel exploded"))
    with pytest.raises(openai.InternalServerError, match="RuntimeError: kernel exploded"):
        server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                         temperature=0)
    server.wait_idle()
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                         temperature=0)
    assert r.choices[0].text == reference(server, PROMPT, 8).text


def test_unexpected_error_is_an_openai_500(server):
    """A bug inside a handler (here a chat template that raises) is a JSON 500, and the next
    request is served."""
    tok = server.app.state.tokenization
    real = tok.render_sync

    def template(*args):
        tok.render_sync = real
        raise ValueError("template exploded")
    tok.render_sync = template
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "ValueError: template exploded",
                                 "type": "internal_error", "param": None, "code": 500}
    ok = server.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                               max_tokens=3)
    assert ok.choices[0].message.content
    server.wait_idle()


def test_metrics_count_tokens(server):
    before = server.metric("eaglekv_generation_tokens_total")
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 9
    assert server.metric("eaglekv_generation_tokens_total") == before + 9
    assert server.metric("eaglekv_num_requests_running") == 0
    assert "spec" not in r.model_extra                  # plain decoding: no spec stats


def test_speculative_server_is_lossless(server):
    """A second server with EAGLE and the shipped draft: greedy answers equal the plain
    engine's, streamed or not, and the response and /metrics carry the accept length."""
    from eaglekv import Engine, EngineConfig
    from eaglekv.config import SpecConfig
    ref = server.on_engine(lambda e: e.chat(CHAT, SamplingParams(max_new_tokens=24))[0])
    ref_c = reference(server, PROMPT, 20)
    spec = Server(Engine(EngineConfig(model="default", max_total_tokens=4096,
                                      max_running_requests=2,
                                      speculative=SpecConfig(algorithm="eagle",
                                                             draft_model="default",
                                                             num_steps=3))))
    try:
        r = spec.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0)
        assert r.choices[0].message.content == ref.text
        st = r.model_extra["spec"]
        assert st["verify_steps"] >= 1
        assert st["accept_length_mean"] == pytest.approx(
            (st["accepted_tokens"] + st["verify_steps"]) / st["verify_steps"])
        stream = spec.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                                temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == ref_c.text
        assert spec.metric("eaglekv_spec_verify_steps_total") >= st["verify_steps"]
        # vLLM's names: drafts = verify steps; per position, the drafts accepted that deep
        # (position i counts a step that accepted more than i tokens), so they sum to accepted
        spec.wait_idle()
        drafts = spec.metric("eaglekv:spec_decode_num_drafts_total")
        accepted = spec.metric("eaglekv:spec_decode_num_accepted_tokens_total")
        per_pos = [spec.metric(f'eaglekv:spec_decode_num_accepted_tokens_per_pos_total'
                               f'{{model_name="{MODEL}",position="{i}"}}') for i in range(3)]
        totals = spec.on_engine(lambda e: e.spec_stats())
        assert drafts == totals.verify_steps and accepted == totals.accepted_tokens
        assert spec.metric("eaglekv:spec_decode_num_draft_tokens_total") == totals.draft_tokens
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
        assert per_pos[0] > 0
        # logprobs come from the verify forward: the plain engine's figures
        ref_lp = engine_logprobs(server, CHAT, 24, 2)
        r = spec.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                                logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        assert r.model_extra["spec"]["accepted_tokens"] > 0
        assert [c.logprob for c in content] == pytest.approx(
            [t.logprob for t in ref_lp.logprobs], abs=1e-3)
        spec.wait_idle()
    finally:
        spec.stop()



def test_eaglekv_serve_command():
    """The command users run: `eaglekv serve` in its own process answers the openai client and
    stops cleanly on SIGINT."""
    import re
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "eaglekv.cli", "serve", "--port", "0",
                             "--served-model-name", "smol", "--max-total-tokens", "2048"],
                            stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = None, time.time() + 120
        while url is None:
            assert time.time() < deadline and proc.poll() is None, "server did not start"
            m = re.search(r"Uvicorn running on (http://\S+)", proc.stderr.readline())
            url = m and m.group(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5 or r.choices[0].finish_reason == "stop"
        assert r.choices[0].text
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
