"""Issue 11: no request can harm another, and the clients people already use work unchanged.
Driven over real HTTP (uvicorn on a free port) on SmolLM2 with the official openai client and
httpx: a poisoned request fails alone, a large body stalls no stream, gauges follow hang-ups,
nothing is generated for a client that left, client errors are 400s, and every error has the
OpenAI shape; content parts, continuous usage stats, /tokenize, /detokenize, /version,
/v1/models/{id}, x-request-id, --api-key and the vLLM-named metrics."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from eaglekv.config import SamplingParams  # noqa: E402
from eaglekv.server.local import LocalServer  # noqa: E402

MODEL = "smollm2"
PROMPT = "The capital of France is"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smol_engine):
    s = LocalServer(smol_engine, MODEL, default_max_tokens=24, max_sub_requests=64)
    s.api = s.client()
    yield s
    if not s.stopped:
        s.wait_idle()
        s.stop()


def reference(server, prompt, n: int, **kw):
    params = SamplingParams(max_new_tokens=n, **kw)
    return server.on_engine(lambda e: e.generate([prompt], params)[0])


def post(server, path, body=None, headers=None, **kw):
    """JSON with ASCII escapes, as most clients send it (a lone surrogate stays "\\ud800")."""
    return httpx.post(server.url + path, content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json", **(headers or {})}, **kw)


def assert_openai_error(r: httpx.Response, status: int, *needles: str) -> dict:
    """The OpenAI error shape, nothing else, with the status as its code."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    for needle in needles:
        assert needle in err["message"], err
    return err


class Streamer(threading.Thread):
    """A greedy completion stream in the background; records each chunk's arrival time."""

    def __init__(self, server, n: int, prompt=PROMPT):
        super().__init__(daemon=True)
        self.server, self.n, self.prompt = server, n, prompt
        self.text, self.times, self.error = "", [], None
        self.started = threading.Event()

    def run(self):
        try:
            for c in self.server.api.completions.create(
                    model=MODEL, prompt=self.prompt, max_tokens=self.n, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}):
                self.times.append(time.perf_counter())
                self.text += c.choices[0].text
                self.started.set()
        except Exception as e:  # noqa: BLE001 - checked by the test
            self.error = e
        self.started.set()

    def max_gap(self) -> float:
        return max(b - a for a, b in zip(self.times, self.times[1:]))


def poison_next_request(server, **bad):
    """The next request's sampling parameters are set past validation (as if a value slipped
    through it): only the engine's own isolation stands between it and the others."""
    def patch(engine):
        real = engine.add_request

        def add(prompt, params=None, **kw):
            engine.add_request = real
            for k, v in bad.items():
                object.__setattr__(params, k, v)
            return real(prompt, params, **kw)
        engine.add_request = add
    server.on_engine(patch)


# ---- 1. one request fails alone -----------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(temperature=1e-40), dict(repetition_penalty=1e-40)])
def test_poisoned_request_fails_alone(server, bad):
    ref = reference(server, PROMPT, 40, ignore_eos=True)
    victim = Streamer(server, 40)
    victim.start()
    assert victim.started.wait(60)
    poison_next_request(server, **bad)
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 8,
                                         "temperature": 0.7, "seed": 1})
    err = assert_openai_error(r, 500, "RequestFailed", "not finite")
    assert err["type"] == "internal_error"
    victim.join(120)
    assert victim.error is None and victim.text == ref.text
    server.wait_idle()


def test_poisoned_stream_fails_alone(server):
    """The same inside a stream: the poisoned stream ends with an error event, the other
    stream of the engine finishes with its greedy text."""
    ref = reference(server, PROMPT, 30, ignore_eos=True)
    victim = Streamer(server, 30)
    victim.start()
    assert victim.started.wait(60)
    poison_next_request(server, temperature=1e-40)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 8, "stream": True,
                            "temperature": 0.7}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "not finite" in json.loads(events[-2])["error"]["message"]
    victim.join(120)
    assert victim.error is None and victim.text == ref.text
    server.wait_idle()


def test_tiny_sampling_values_are_handled_at_the_door(server):
    """What slipped through before: a temperature below 1e-5 is greedy (vLLM's rule); a
    repetition penalty fp32 cannot divide by is a 400 naming it."""
    ref = reference(server, PROMPT, 8)
    r = server.api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                      temperature=1e-40)
    assert r.choices[0].text == ref.text
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                         "temperature": 0.7, "repetition_penalty": 1e-40})
    assert_openai_error(r, 400, "repetition_penalty")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                         "temperature": 0.7, "top_p": 1e-300})
    assert r.status_code in (200, 400), r.text   # mapped or refused, never a 500
    server.wait_idle()


# ---- 2. a large body stalls no stream -----------------------------------------------------------
def test_large_body_is_tokenized_off_the_engine_thread(server):
    """A 3 MB prompt (under the 4 MiB limit) takes seconds to tokenize; a stream in flight
    keeps getting tokens all along (before, it froze until the tokenizer was done), and the
    big request gets its 400 (too long for the context)."""
    victim = Streamer(server, 60)
    victim.start()
    assert victim.started.wait(60)
    big = "word " * (3 * 2**20 // 5)
    t0 = time.perf_counter()
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": big, "max_tokens": 4})
    took = time.perf_counter() - t0
    assert_openai_error(r, 400, "max_context_len")
    victim.join(120)
    assert victim.error is None
    t1 = t0 + took
    during = [b - a for a, b in zip(victim.times, victim.times[1:]) if t0 < b < t1]
    assert took > 1.0 and len(during) >= 3 and max(during) < took / 3, (took, during)
    server.wait_idle()


def test_body_over_the_limit_is_413(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * (4 * 2**20 + 10)})
    assert_openai_error(r, 413, "exceeds the limit of 4194304 bytes")

    def chunks():   # no Content-Length: counted while it streams in
        yield b'{"model": "smollm2", "prompt": "'
        for _ in range(5):
            yield b"y" * 2**20
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413, "exceeds the limit")


# ---- 3 + 4. hang-ups: gauges follow, no work for nobody -----------------------------------------
def gauges(server) -> tuple[float, float]:
    return (server.metric("eaglekv:num_requests_running"),
            server.metric("eaglekv:num_requests_waiting"))


def wait_gauges_zero(server, within: float = 1.0) -> float:
    t0 = time.perf_counter()
    while gauges(server) != (0, 0):
        assert time.perf_counter() - t0 < within, gauges(server)
        time.sleep(0.05)
    return time.perf_counter() - t0


def test_gauges_follow_hangups(server):
    clients = [httpx.Client(timeout=60) for _ in range(3)]
    streams = []
    for c in clients:
        s = c.stream("POST", server.url + "/v1/completions",
                     json={"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "stream": True,
                           "ignore_eos": True})
        streams.append(s)
    lines = []     # the line iterators stay referenced: a collected one closes its stream
    try:
        for s in streams:
            lines.append(s.__enter__().iter_lines())
            next(lines[-1])
        # a fan-out that leaves most of its 60 sub-requests waiting, then hangs up too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(60, read=1.0),
                       json={"model": MODEL, "prompt": [PROMPT] * 4, "n": 15,
                             "max_tokens": 300, "ignore_eos": True})
        assert sum(gauges(server)) > 0
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
    wait_gauges_zero(server, within=1.0)
    server.wait_idle()


def test_no_sub_request_after_hangup(server):
    """A call's sub-requests reach the engine in one visit, all or none; after the client
    leaves, within a second nothing of it is left and no request is ever added again."""
    count = lambda: server.on_engine(lambda e: next(e._rids))  # noqa: E731 - consumes one id
    before = count()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(60, read=0.5),
                   json={"model": MODEL, "prompt": [PROMPT] * 4, "n": 16,
                         "max_tokens": 200, "ignore_eos": True})
    wait_gauges_zero(server, within=1.5)
    added = count() - before - 1
    assert added in (0, 64), added            # all or none
    time.sleep(1.0)
    assert count() == before + added + 2       # nothing added since (only our two probes)
    server.wait_idle()


def test_sub_requests_capped(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [PROMPT] * 5, "n": 16})
    assert_openai_error(r, 400, "80 sub-requests", "limit of 64")


# ---- 5 + 7. client errors are 400s ---------------------------------------------------------------
@pytest.mark.parametrize("body,needle", [
    ({"prompt": PROMPT, "seed": 2**64}, "seed"),
    ({"prompt": PROMPT, "seed": 2**64 - 1, "n": 2}, "seed"),
    ({"prompt": PROMPT, "seed": -2**63 - 1}, "seed"),
    ({"prompt": "a\ud800b"}, "surrogate"),
    ({"prompt": ["ok", "\udfff"]}, "surrogate"),
    ({"prompt": PROMPT, "stop": ["\ud800"]}, "surrogate"),
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": [[1, True]]}, "prompt"),
    ({"prompt": PROMPT, "stop_token_ids": [True]}, "stop_token_ids"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_client_errors_are_400(server, body, needle):
    assert_openai_error(post(server, "/v1/completions", {"model": MODEL, **body}), 400, needle)


def test_chat_client_errors_are_400(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "a\ud800"}]})
    assert_openai_error(r, 400, "surrogate")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert_openai_error(r, 400, "image_url")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": None}]})
    assert_openai_error(r, 400, "null")


# ---- 6. every error path has the OpenAI shape ----------------------------------------------------
def test_framework_errors_have_the_openai_shape(server):
    url = server.url
    r = httpx.post(url + "/v1/completions", content=b'{"model": "\xff\xfe"}',
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    r = httpx.post(url + "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    r = httpx.post(url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "JSON")
    assert_openai_error(httpx.get(url + "/v1/nope"), 404, "/v1/nope")
    assert_openai_error(httpx.get(url + "/v1/completions"), 405, "GET /v1/completions")
    assert_openai_error(httpx.post(url + "/v1/models"), 405)
    assert server.metric('eaglekv:http_responses_total{status="405"}') >= 2


def test_non_streaming_disconnect_logs_no_traceback(server, capfd):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(60, read=0.5),
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 100,
                         "ignore_eos": True})
    server.wait_idle()
    time.sleep(0.3)
    err = capfd.readouterr().err
    assert "CancelledError" not in err and "Traceback" not in err, err


# ---- compatibility -------------------------------------------------------------------------------
def test_content_parts_and_null_assistant_content(server):
    conv = [{"role": "user", "content": "Name three\ncolours."},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "Again."}]
    ref = server.on_engine(lambda e: e.chat(conv, SamplingParams(max_new_tokens=12))[0])
    r = server.api.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Name three"},
                                     {"type": "text", "text": "colours."}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "Again."}]}])
    assert r.choices[0].message.content == ref.text


def test_continuous_usage_stats(server):
    ref = reference(server, PROMPT, 10, ignore_eos=True)
    chunks = list(server.api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    with_choice = [c for c in chunks if c.choices]
    done = [c.usage.completion_tokens for c in with_choice]
    assert all(c.usage.prompt_tokens == len(ref.prompt_token_ids) for c in with_choice)
    assert done == sorted(done) and done[-1] == 10
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    assert "".join(c.choices[0].text for c in with_choice) == ref.text
    chat = list(server.api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens <= 5


def test_tokenize_detokenize_version_models(server):
    ids = server.on_engine(lambda e: e.encode(PROMPT))
    r = post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT}).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] > 0
    conv = [{"role": "user", "content": "Hi"}]
    chat_ids = server.on_engine(lambda e: e.apply_chat_template(conv))
    r = post(server, "/tokenize", {"messages": conv}).json()
    assert r["tokens"] == chat_ids
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": PROMPT}
    assert_openai_error(post(server, "/detokenize", {"tokens": [10**9]}), 400, "vocabulary")
    assert_openai_error(post(server, "/tokenize", {"model": MODEL}), 400, "prompt")
    assert_openai_error(post(server, "/tokenize", {"model": "other", "prompt": "x"}), 404)
    assert httpx.get(server.url + "/version").json()["version"]
    m = server.api.models.retrieve(MODEL)
    assert m.id == MODEL and m.model_extra["max_model_len"] == r["max_model_len"]
    with pytest.raises(openai.NotFoundError):
        server.api.models.retrieve("gpt-4")


def test_request_id_header(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
             headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    r = httpx.get(server.url + "/health")
    assert len(r.headers["x-request-id"]) == 32


def test_vllm_named_metrics(server):
    before = server.metric("eaglekv:generation_tokens_total")
    bad = server.metric('eaglekv:http_responses_total{status="400"}')
    server.api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True}, stream=False)
    post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 0})
    assert server.metric("eaglekv:generation_tokens_total") == before + 6
    assert server.metric('eaglekv:http_responses_total{status="400"}') == bad + 1
    assert server.metric('eaglekv:request_success_total') >= 1
    assert server.metric("eaglekv:inter_token_latency_seconds_count") >= 5
    assert server.metric("eaglekv:time_to_first_token_seconds_count") >= 1
    assert server.metric("eaglekv:kv_cache_usage_perc") == 0
    for name in ("eaglekv:num_preemptions_total", "eaglekv:e2e_request_latency_seconds_count",
                 "eaglekv:prompt_tokens_total"):
        assert name in httpx.get(server.url + "/metrics").text


def test_api_key(smol_engine, server):
    server.wait_idle()
    server.stop()   # one EngineLoop per engine: this test runs a server of its own
    keyed = LocalServer(smol_engine, MODEL, api_key="sekrit")
    try:
        with pytest.raises(openai.AuthenticationError):
            keyed.client("wrong").models.list()
        r = httpx.get(keyed.url + "/v1/models")
        assert_openai_error(r, 401, "missing API key")
        r = keyed.client("sekrit").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert httpx.get(keyed.url + "/health").status_code == 200
        assert httpx.get(keyed.url + "/metrics").status_code == 200
        assert_openai_error(httpx.post(keyed.url + "/tokenize", json={"prompt": "x"}), 401)
        keyed.wait_idle()
    finally:
        keyed.stop()
