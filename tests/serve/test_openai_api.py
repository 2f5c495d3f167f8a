"""`ecru serve api` through the official `openai` client against a real uvicorn server on loopback,
serving a local model folder (`--model PATH`): concurrency, streaming, bad requests, disconnects, load."""

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from ecru.serve.engine.models import ServedModel
from ecru.serve.engine.request_engine import EngineConfig
from ecru.serve.engine.sampling import SamplingParams
from tests.serve.helpers import BackgroundServer

CAP = 256  # the server's largest max_tokens (the tiny model's context is 512)


@pytest.fixture(scope="module")
def served(chat_model_dir):
    return ServedModel.load(str(chat_model_dir))


@pytest.fixture(scope="module")
def server(served):
    background = BackgroundServer(served, EngineConfig(max_new_tokens=CAP, max_batch_size=8, refill_min=1))
    with background as url:
        background.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield background


def ask(server, text, **kw):
    messages = [{"role": "user", "content": text}]
    return server.client.chat.completions.create(model=server.model_name, messages=messages, **kw)


@pytest.fixture(autouse=True)
def _name(server, served):
    server.model_name = served.name


def offline(served, texts, max_tokens):
    """The same prompts through the engine alone, one request at a time (the reference)."""
    engine = served.engine(EngineConfig(max_new_tokens=CAP))
    prompts = [served.encode_chat([{"role": "user", "content": t}]) for t in texts]
    return [engine.generate([p], SamplingParams(max_tokens=max_tokens))[0].text for p in prompts]


def get(server, path):
    with urllib.request.urlopen(server.url + path, timeout=10) as r:
        return r.status, r.read().decode()


def test_models_health_and_metrics(server, served):
    assert [m.id for m in server.client.models.list().data] == [served.name]
    assert server.client.models.retrieve(served.name).id == served.name
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("gpt-4")
    assert get(server, "/health") == (200, '{"status":"ok"}')
    ask(server, "warm up", max_tokens=3, temperature=0)
    status, text = get(server, "/metrics")
    assert status == 200
    for name in ("ecru_requests_total", "ecru_generation_tokens_total", "ecru_queue_length",
                 "ecru_batch_occupancy", "ecru_request_latency_seconds_bucket", "ecru_time_to_first_token"):  # fmt: skip
        assert name in text
    assert 'ecru_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:  # what a scraper parses by
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_chat_requests_reuse_the_templates_start_from_the_prefix_cache(server):
    stats = server.threads.engine.stats
    ask(server, "what is the weather like", max_tokens=2, temperature=0)
    before = stats.prefix_hit_tokens
    ask(server, "book me a table for two", max_tokens=2, temperature=0)  # prefilled before it answers
    assert stats.prefix_hit_tokens - before >= 16  # the chat template's system prompt, at least
    assert "ecru_prefix_cache_hit_tokens" in get(server, "/metrics")[1]


def test_concurrent_requests_share_the_batch_and_match_alone(server, served):
    texts = [f"tell me about item {i}" for i in range(8)]
    steps_before = server.threads.engine.stats.steps
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda t: ask(server, t, max_tokens=24, temperature=0), texts))
    got = [a.choices[0].message.content for a in answers]
    assert got == offline(served, texts, 24)
    assert all(a.usage.completion_tokens == 24 and a.choices[0].finish_reason == "length" for a in answers)
    # 8 x 24 tokens took far fewer engine steps than tokens: the requests were decoded together
    assert server.threads.engine.stats.steps - steps_before < 8 * 24 / 2


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 5}])
def test_streamed_text_equals_non_streamed(server, sampling):
    plain = ask(server, "stream me a story", max_tokens=40, **sampling)
    chunks = list(ask(server, "stream me a story", max_tokens=40, stream=True, **sampling))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content and len(streamed) > 20
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    kw = {"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 30, **sampling}
    whole = server.client.completions.create(**kw).choices[0].text
    parts = server.client.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].text for c in parts) == whole


def test_stop_strings_end_the_answer_before_them(server):
    full = ask(server, "count for me", max_tokens=40, temperature=0).choices[0].message.content
    stop = full[15:19]
    cut = full[: full.index(stop)]
    answer = ask(server, "count for me", max_tokens=40, temperature=0, stop=[stop])
    assert answer.choices[0].message.content == cut and answer.choices[0].finish_reason == "stop"
    chunks = ask(server, "count for me", max_tokens=40, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut


BAD = [
    ({"model": "gpt-4"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": -5}, 400, "max_tokens"),
    ({"max_tokens": CAP + 1}, 400, "max_tokens"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": 3.0}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"messages": [{"content": "no role"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 200}, 400, None),  # > context
    ({"n": 0}, 400, "n"),
    ({"n": 17}, 400, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
]


@pytest.mark.parametrize(("change", "status", "param"), BAD)
def test_bad_requests_get_their_4xx_and_the_server_keeps_serving(server, change, status, param):
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(change)
    with pytest.raises(openai.APIStatusError) as info:
        server.client.chat.completions.create(**body)
    err = info.value
    assert err.status_code == status
    assert set(err.body) == {"message", "type", "param", "code"} and err.body["message"]
    assert err.body["type"] == "invalid_request_error"
    if param:
        assert err.body["param"].startswith(param)
    assert get(server, "/health")[0] == 200
    assert ask(server, "still there?", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_malformed_json_and_unknown_paths_are_openai_errors(server):
    req = urllib.request.Request(server.url + "/v1/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400 and "error" in json.loads(info.value.read())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.url + "/v1/nothing", timeout=10)
    assert info.value.code == 404 and json.loads(info.value.read())["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=server.model_name, prompt="", max_tokens=3)


def test_a_client_that_disconnects_frees_its_row(server):
    engine = server.threads.engine
    stream = ask(server, "a long answer please", max_tokens=CAP, temperature=0, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away long before 256 tokens
    deadline = time.monotonic() + 10
    while (engine.has_unfinished() or len(engine.scheduler.running)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished() and len(engine.scheduler.running) == 0
    assert 'status="499"' in get(server, "/metrics")[1]


def test_load_200_requests_from_32_clients_all_answered_once(server, served):
    texts = [f"load request number {i}" for i in range(200)]
    barrier = threading.Barrier(32)

    def client(k):
        barrier.wait()  # every client starts at once
        return [(i, ask(server, texts[i], max_tokens=6, temperature=0)) for i in range(k, 200, 32)]

    with ThreadPoolExecutor(32) as pool:
        results = [pair for chunk in pool.map(client, range(32)) for pair in chunk]
    assert sorted(i for i, _ in results) == list(range(200))
    assert len({a.id for _, a in results}) == 200  # no answer handed to two requests
    expected = offline(served, texts, 6)
    assert [a.choices[0].message.content for _, a in sorted(results, key=lambda p: p[0])] == expected
    assert get(server, "/health")[0] == 200
