"""`ecru serve api` against hostile and demanding clients, through raw sockets and the official `openai`
client: disconnects, oversized bodies, odd paths, invalid text, the API key, logprobs and n > 1."""

import json
import re
import socket
import threading
import time
import urllib.request

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ecru.serve.engine.models import ServedModel
from ecru.serve.engine.request_engine import EngineConfig
from ecru.serve.engine.sampling import SamplingParams
from ecru.serve.entrypoints.openai_api import APIConfig
from tests.serve.helpers import BackgroundServer

CAP = 256
KEY = "sekret-key"
LIMIT = 2 * 2**20  # this server's body limit


@pytest.fixture(scope="module")
def served(chat_model_dir):
    return ServedModel.load(str(chat_model_dir))


@pytest.fixture(scope="module")
def server(served):
    config = EngineConfig(max_new_tokens=CAP, max_batch_size=8, refill_min=1)
    background = BackgroundServer(
        served, config, api=APIConfig(api_key=KEY, max_body_bytes=LIMIT, body_timeout_s=1.0)
    )
    with background as url:
        background.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        background.name = served.name
        yield background


def raw(server, method: str, path: str, body: bytes = b"", *, key: str | None = KEY, chunked=False):
    """One HTTP/1.1 exchange over a plain socket: (status, parsed JSON body or text)."""
    head = [f"{method} {path} HTTP/1.1", f"Host: {server.host}", "Content-Type: application/json",
            "Connection: close"]  # fmt: skip
    if key is not None:
        head.append(f"Authorization: Bearer {key}")
    if chunked:
        head.append("Transfer-Encoding: chunked")
        body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in _pieces(body, 2**16)) + b"0\r\n\r\n"
    else:
        head.append(f"Content-Length: {len(body)}")
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        try:
            s.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        except (BrokenPipeError, ConnectionResetError):  # the server answered before reading it all
            pass
        data = _read_all(s)
    status = int(data.split(b" ", 2)[1])
    text = data.split(b"\r\n\r\n", 1)[1].decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def _pieces(data: bytes, size: int):
    return [data[i : i + size] for i in range(0, len(data), size)]


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def chat_body(server, text="hi", **kw) -> bytes:
    return json.dumps({"model": server.name, "messages": [{"role": "user", "content": text}], **kw}).encode()


def is_openai_error(body) -> bool:
    return isinstance(body, dict) and set(body.get("error", {})) == {"message", "type", "param", "code"}


def metrics(server) -> str:
    return raw(server, "GET", "/metrics", key=None)[1]


def count(text: str, endpoint: str, status: str) -> int:
    """ecru_requests_total{endpoint, status} in the exposition, as a Prometheus parser reads it."""
    labels = {"endpoint": endpoint, "status": status}
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return int(sum(s.value for s in families["ecru_requests"].samples if s.labels == labels))


def test_a_disconnected_plain_client_frees_its_row_within_a_step(server):
    engine = server.threads.engine
    before = count(metrics(server), "/v1/chat/completions", "499")
    s = socket.create_connection((server.host, server.port))
    body = chat_body(server, "a long answer please", max_tokens=CAP, temperature=0)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    s.sendall(head.encode() + body)
    deadline = time.monotonic() + 10
    while len(engine.scheduler.running) == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    steps = engine.stats.steps
    s.close()  # gone while its answer is being decoded
    while (engine.has_unfinished() or len(engine.scheduler.running)) and time.monotonic() < deadline:
        time.sleep(0.001)  # the engine thread finishes the request, then drops its row
    assert not engine.has_unfinished() and len(engine.scheduler.running) == 0
    # it left within a few steps (the abort is applied between steps), far from its 256 tokens
    assert engine.stats.steps - steps <= 5
    time.sleep(0.1)
    assert count(metrics(server), "/v1/chat/completions", "499") == before + 1


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_413(server, chunked):
    big = chat_body(server, "x" * (LIMIT + 10), max_tokens=2)
    status, body = raw(server, "POST", "/v1/chat/completions", big, chunked=chunked)
    assert status == 413 and is_openai_error(body) and "bytes" in body["error"]["message"]
    assert server.client.completions.create(model=server.name, prompt="ok", max_tokens=2).choices[0].text


def health_waits(server, request: threading.Thread) -> list[float]:
    """Start `request`; the seconds each `/health` took (every one a 200), polled until it is done."""
    request.start()
    waits = []
    while request.is_alive():
        start = time.perf_counter()
        with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
            assert r.status == 200
        waits.append(time.perf_counter() - start)
        time.sleep(0.01)
    request.join()
    return waits


def test_health_answers_while_a_long_prompt_is_tokenised(server):
    prompt = "words and more words " * 60_000  # 1.26 MB: seconds to tokenise on a busy CPU
    body = json.dumps({"model": server.name, "prompt": prompt, "max_tokens": 2}).encode()
    answer = {}
    big = threading.Thread(target=lambda: answer.update(r=raw(server, "POST", "/v1/completions", body)))
    waits = health_waits(server, big)
    status, error = answer["r"]
    assert status == 400 and is_openai_error(error)  # longer than the model's context
    assert len(waits) >= 3 and max(waits) < 0.5, waits  # polled while it was tokenised


def test_health_answers_while_a_large_invalid_body_is_refused(server):
    start = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ['
    body = start + b"1," * ((LIMIT - len(start) - 3) // 2) + b"1]}"  # ~1M invalid items, within the limit
    answer = {}
    big = threading.Thread(target=lambda: answer.update(r=raw(server, "POST", "/v1/chat/completions", body)))
    waits = health_waits(server, big)
    status, error = answer["r"]  # its first error only (a list stops at its first invalid item)
    assert status == 400 and is_openai_error(error) and error["error"]["param"].startswith("stop")
    assert waits and max(waits) < 0.5, waits


def test_a_stalled_body_is_408_and_frees_its_connection(server):
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 80\r\n\r\n{\"model\":")  # fmt: skip
        start = time.perf_counter()
        data = _read_all(s)
    assert data.startswith(b"HTTP/1.1 408") and time.perf_counter() - start < 10
    error = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert is_openai_error(error) and error["error"]["code"] == "body_timeout"


def test_a_client_that_leaves_mid_body_is_counted_499_and_nothing_runs(server):
    engine = server.threads.engine
    before, prefills = count(metrics(server), "/v1/completions", "499"), engine.stats.prefills
    body = json.dumps({"model": server.name, "prompt": "hello", "max_tokens": 2}).encode()  # valid JSON...
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % (len(body) + 5)
                  + body)  # fmt: skip
        time.sleep(0.2)  # ...but 5 bytes short when the client leaves
    deadline = time.monotonic() + 5
    while count(metrics(server), "/v1/completions", "499") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count(metrics(server), "/v1/completions", "499") == before + 1
    assert engine.stats.prefills == prefills  # the partial body was not served


def test_odd_paths_and_methods_for_load_balancers(server):
    status, body = raw(server, "POST", "/v1/chat/completions/", chat_body(server, max_tokens=2))
    assert status == 404 and is_openai_error(body)  # no 307 to a Host-built URL
    assert raw(server, "GET", "/metrics/", key=None)[0] == 404
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_all(s).startswith(b"HTTP/1.1 200")


def test_a_seed_out_of_a_generators_range_is_a_400(server):
    for seed in (2**64, -(2**63) - 1):
        status, body = raw(server, "POST", "/v1/chat/completions", chat_body(server, seed=seed, max_tokens=2))
        assert status == 400 and is_openai_error(body) and body["error"]["param"] == "seed"


def test_n_choices_join_the_batch_together(server):
    engine = server.threads.engine
    before = engine.stats.prefills
    answer = server.client.completions.create(model=server.name, prompt="count", max_tokens=2, n=8)
    assert len(answer.choices) == 8
    assert engine.stats.prefills - before <= 2  # one admission (two if the engine stepped between submits)


@pytest.mark.parametrize("key", ["", " k", "clé", "a\tb"])
def test_an_api_key_an_http_header_cannot_carry_is_refused(key):
    with pytest.raises(ValueError, match="printable ASCII"):
        APIConfig(api_key=key)


EXPOSITION = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_]\w*="(?:[^"\\\n]|\\[\\"n])*"(,[a-zA-Z_]\w*="(?:[^"\\\n]|\\[\\"n])*")*\})?'
    r" (-?[0-9.]+(e[+-]?[0-9]+)?|[+-]Inf|NaN)$"
)


def test_metrics_stay_valid_prometheus_text(server, served, monkeypatch):
    assert raw(server, "GET", "/foo%22bar", key=None)[0] == 404
    assert raw(server, "GET", '/a"b\\c', key=None)[0] == 404
    for i in range(50):
        assert raw(server, "GET", f"/unknown/{i}", key=None)[0] == 404

    def boom(text):
        raise RuntimeError("the tokenizer broke")

    monkeypatch.setattr(served, "encode", boom)
    status, body = raw(
        server, "POST", "/v1/completions", json.dumps({"model": served.name, "prompt": "x"}).encode()
    )
    assert status == 500 and is_openai_error(body) and body["error"]["type"] == "server_error"
    text = metrics(server)
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or EXPOSITION.match(line), line
    assert count(text, "other", "404") >= 52 and "foo" not in text
    assert count(text, "/v1/completions", "500") == 1
    before = {path: count(text, path, "200") for path in ("/health", "/v1/models", "/metrics")}
    for path in ("/health", "/v1/models", f"/v1/models/{served.name}"):
        assert raw(server, "GET", path)[0] == 200
    after = metrics(server)  # this scrape counts once it is answered
    assert count(after, "/health", "200") == before["/health"] + 1
    assert count(after, "/v1/models", "200") == before["/v1/models"] + 2  # the list and a model's card
    assert count(after, "/metrics", "200") == before["/metrics"] + 1


def test_a_model_failure_is_a_500_and_the_engine_thread_carries_on(server, monkeypatch):
    def broken():
        raise RuntimeError("the model broke")

    before = count(metrics(server), "/v1/completions", "500")
    monkeypatch.setattr(server.threads.engine, "step", broken)
    body = json.dumps({"model": server.name, "prompt": "x", "max_tokens": 4}).encode()
    status, error = raw(server, "POST", "/v1/completions", body)
    monkeypatch.undo()
    assert status == 500 and is_openai_error(error) and error["error"]["type"] == "server_error"
    assert error["error"]["message"].endswith("RuntimeError: the model broke")
    assert count(metrics(server), "/v1/completions", "500") == before + 1  # counted once
    assert server.client.completions.create(model=server.name, prompt="ok", max_tokens=2).choices[0].text


def test_invalid_text_and_fields_are_openai_4xx(server):
    lone = b'"\\ud800 x"'  # valid JSON, not valid Unicode
    model = json.dumps(server.name).encode()
    cases = [
        ("/v1/completions", b'{"model": %s, "prompt": %s}' % (model, lone), "prompt"),
        ("/v1/completions", b'{"model": %s, "prompt": [%s]}' % (model, lone), "prompt"),
        ("/v1/chat/completions", b'{"model": %s, "messages": [{"role": "user", "content": %s}]}' % (model, lone),
         "messages"),
        ("/v1/completions", b'{"model": %s, "prompt": "a", "stop": %s}' % (model, lone), "stop"),
        ("/v1/completions", b'{"model": %s, "prompt": "a", "response_format": {"type": "json_object"}}' % model,
         "response_format"),
        ("/v1/chat/completions", b'{"model": %s, "messages": [], "tool_choice": "auto", "functions": [{}]}' % model,
         "tool_choice"),
        ("/v1/completions", b'{"model": %s, "prompt": "a", "logprobs": 6}' % model, "logprobs"),
        ("/v1/completions", b'[1, 2]', None),
        ("/v1/completions", b'\xff\xfe', None),
    ]  # fmt: skip
    for path, body, param in cases:
        status, error = raw(server, "POST", path, body)
        assert status == 400 and is_openai_error(error), (body, status, error)
        if param:
            assert error["error"]["param"] == param and param in error["error"]["message"], error
    assert (
        server.client.completions.create(model=server.name, prompt="ok", max_tokens=2).usage.completion_tokens
        == 2
    )


def test_the_api_key_guards_every_v1_route_but_not_health(server):
    for key in (None, "wrong"):
        for method, path, body in (("GET", "/v1/models", b""), ("POST", "/v1/chat/completions", chat_body(server)),
                                   ("POST", "/v1/completions", b"{}"), ("GET", "/v1/nothing", b"")):  # fmt: skip
            status, error = raw(server, method, path, body, key=key)
            assert status == 401 and is_openai_error(error) and error["error"]["code"] == "invalid_api_key"
    anonymous = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    assert raw(server, "GET", "/health", key=None) == (200, {"status": "ok"})
    assert raw(server, "GET", "/metrics", key=None)[0] == 200
    assert server.client.models.list().data[0].id == server.name


def reference_logprobs(served, prompt: list[int], max_tokens: int) -> torch.Tensor:
    """The greedy answer's tokens (the engine alone), scored by a plain transformers forward over prompt +
    answer: the log-softmax at each answer token."""
    output = served.engine(EngineConfig(max_new_tokens=CAP)).generate(
        [prompt], SamplingParams(max_tokens=max_tokens)
    )
    output = output[0].output
    with torch.no_grad():
        logits = served.model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0]


def test_chat_logprobs_are_the_models_log_softmax(server, served):
    messages = [{"role": "user", "content": "tell me a story"}]
    answer = server.client.chat.completions.create(
        model=server.name, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == 12 and "".join(c.token for c in content) == answer.choices[0].message.content
    expected = reference_logprobs(served, served.encode_chat(messages), 12)
    torch.testing.assert_close(torch.tensor([c.logprob for c in content]), expected, atol=1e-4, rtol=0)
    for c in content:  # greedy: the sampled token is the most likely, alternatives in descending order
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and abs(tops[0] - c.logprob) < 1e-6
        assert c.top_logprobs[0].token == c.token and bytes(c.bytes) == c.token.encode()


def test_completion_logprobs_and_n_choices(server, served):
    kw = {"model": server.name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    one = server.client.completions.create(**kw, logprobs=2).choices[0]
    lp = one.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == one.text and lp.text_offset[0] == 0
    assert all(tok in top and len(top) <= 3 for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True))
    expected = reference_logprobs(served, served.encode(kw["prompt"]), 8)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), expected, atol=1e-4, rtol=0)

    greedy = server.client.completions.create(**kw, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and {c.text for c in greedy.choices} == {one.text}
    assert greedy.usage.completion_tokens == 3 * 8
    sampled = server.client.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "hi"}], n=4, max_tokens=16,
        temperature=1.0, seed=7,
    )  # fmt: skip
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1  # each choice drew its own tokens
    again = server.client.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "hi"}], n=4, max_tokens=16,
        temperature=1.0, seed=7,
    )  # fmt: skip
    assert [c.message.content for c in again.choices] == texts  # and a seed repeats them


def test_logprobs_carry_each_tokens_own_bytes(server, served):
    text = "dragon 龍 and 🐉🐉 é"
    ids = served.encode(text)
    assert b"".join(served.token_bytes(i) for i in ids).decode("utf-8").endswith(text)  # pieces of characters
    kw = {"model": server.name, "prompt": text, "max_tokens": 12, "temperature": 0, "logprobs": 5}
    one = server.client.completions.create(**kw).choices[0]
    lp = one.logprobs  # a random model: many top tokens are pieces of characters, each its own key
    assert all(len(top) >= 5 for top in lp.top_logprobs), lp.top_logprobs
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(one.text)
    chat = server.client.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": text}], max_tokens=32, temperature=0,
        logprobs=True, top_logprobs=20,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    special = {
        t.content for t in served.tokenizer.added_tokens_decoder.values() if t.special
    }  # not in the text
    joined = b"".join(bytes(entry.bytes) for entry in content if entry.token not in special)
    assert joined.decode("utf-8", "replace").rstrip("\ufffd") == chat.choices[0].message.content
    for entry in content:  # 20 different tokens are 20 different byte strings (pieces of characters too)
        assert (
            len({bytes(t.bytes) for t in entry.top_logprobs})
            == len({t.token for t in entry.top_logprobs})
            == 20
        )


def test_pieces_of_characters_keep_their_bytes_and_their_own_keys(served):
    from types import SimpleNamespace

    from ecru.serve.entrypoints.openai_api import OpenAIServer

    api = OpenAIServer(served, threads=None, default_max_tokens=8)
    text = "龍🐉"
    ids = served.encode(text)
    assert len(ids) > 2  # byte-level pieces: each alone decodes to U+FFFD
    tops = [[(ids[(k + 1) % len(ids)], -1.0), (ids[(k + 2) % len(ids)], -2.0)] for k in range(len(ids))]
    request = SimpleNamespace(output=ids, logprobs=[(-0.5, top) for top in tops])
    chat = api._logprobs(SimpleNamespace(kind="chat", request=request), 0, len(ids))["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat) == text.encode()
    assert all(len({bytes(t["bytes"]) for t in e["top_logprobs"]}) == 2 for e in chat)
    plain = api._logprobs(SimpleNamespace(kind="completion", request=request), 0, len(ids))
    assert all(len(top) == 3 for top in plain["top_logprobs"])  # no two pieces share a key
    shown = "".join(plain["tokens"])
    assert "bytes:\\x" in shown and "\ufffd" not in shown  # a piece shows its bytes, not U+FFFD
    assert plain["text_offset"] == sorted(plain["text_offset"]) and plain["text_offset"][-1] < len(text)


@pytest.mark.parametrize("ignored", [False, True], ids=["terminal", "background-job"])
def test_ctrl_c_drains_the_requests_in_flight_and_exits_130(chat_model_dir, ignored):
    """Also when started with SIGINT ignored, as a shell starts a background job (`ecru serve api &`)."""
    import signal
    import subprocess
    import sys

    from ecru.serve.entrypoints.server import free_port

    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    port = str(free_port())
    cmd = [sys.executable, "-m", "ecru.cli", "serve", "api", "--model", str(chat_model_dir), "--port", port]
    server = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, preexec_fn=ignore_sigint if ignored else None
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
        body = {"model": str(chat_model_dir), "prompt": "go", "max_tokens": CAP, "temperature": 0}
        answer = {}
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        asking = threading.Thread(target=lambda: answer.update(a=client.completions.create(**body)))
        asking.start()
        time.sleep(0.2)
        server.send_signal(signal.SIGINT)
        assert server.wait(30) == 130
        asking.join()
    finally:
        server.kill()
    assert answer["a"].usage.completion_tokens >= 1  # answered, not dropped
    assert server.stderr.read().strip().endswith("ecru: interrupted")


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_streamed_logprobs_equal_the_whole_answers(server):
    messages = [{"role": "user", "content": "stream a story"}]
    kw = {"model": server.name, "max_tokens": 20, "temperature": 0}
    whole = server.client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **kw)
    chunks = server.client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=2, stream=True, **kw
    )
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    expected = whole.choices[0].logprobs.content
    assert len(streamed) == 20 and [e.token for e in streamed] == [e.token for e in expected]
    # the same tokens' logprobs: equal up to the float noise of a different batch (prefix cache, padding)
    close = torch.testing.assert_close
    close(
        torch.tensor([e.logprob for e in streamed]),
        torch.tensor([e.logprob for e in expected]),
        atol=1e-4,
        rtol=0,
    )
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in expected
    ]
    plain = server.client.completions.create(prompt="Once upon a time", logprobs=1, **kw).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in server.client.completions.create(
        prompt="Once upon a time", logprobs=1, stream=True, **kw) if c.choices[0].logprobs]  # fmt: skip
    for field in ("tokens", "text_offset"):
        assert [v for p in parts for v in getattr(p, field)] == getattr(plain, field)
    got = [v for p in parts for v in p.token_logprobs]
    close(torch.tensor(got), torch.tensor(plain.token_logprobs), atol=1e-4, rtol=0)
    assert [list(d) for p in parts for d in p.top_logprobs] == [list(d) for d in plain.top_logprobs]


def test_n_choices_stream_each_under_its_index(server):
    kw = {"model": server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}
    whole = server.client.chat.completions.create(n=3, temperature=1.0, seed=11, **kw)
    chunks = list(server.client.chat.completions.create(n=3, temperature=1.0, seed=11, stream=True, **kw))
    texts, ends = ["", "", ""], [None, None, None]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            ends[choice.index] = choice.finish_reason or ends[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert ends == [c.finish_reason for c in whole.choices] and len({c.id for c in chunks}) == 1
