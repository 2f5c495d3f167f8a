"""`ecru serve api`: an OpenAI-compatible HTTP server (FastAPI) on the request engine.

Every HTTP request becomes one engine request on the engine thread (`background.EngineThread`), so
concurrent clients share the running batch. The engine's listener hands each released piece of text to
the request's asyncio queue (thread-safely); a streaming response sends it as a server-sent event at once,
a plain one gathers it while watching for the client's disconnect, so a client that goes away has its
requests cancelled at once and their rows leave the batch at the next step. Tokenisation runs on a worker
thread, so the event loop keeps answering (`/health`) while a long prompt is encoded. `APIGuard`
refuses, before any route runs, a body over the limit (413) and a `/v1` call without the API key (401). Errors are OpenAI's JSON bodies: 400 invalid request, 401, 404 unknown model or path, 413, 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ecru.serve.engine.background import EngineThread
from ecru.serve.engine.models import ServedModel
from ecru.serve.engine.sampling import SamplingParams
from ecru.serve.entrypoints.api_schema import APIError, ChatCompletionRequest, CompletionRequest
from ecru.serve.entrypoints.metrics import CONTENT_TYPE, ServerMetrics

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
DISCONNECTED = "499"  # the status /metrics counts for a client that left before its answer (nginx's code)


class _Call:
    """One engine request (one choice) seen from the event loop: its request, and its cancellation."""

    def __init__(
        self, threads: EngineThread, kind: str, *, response_id: str, index: int, events: asyncio.Queue
    ):
        self.threads, self.kind, self.response_id, self.index = threads, kind, response_id, index
        self.id = f"{response_id}-{index}"  # the engine's request id
        self.created = int(time.time())
        self.events, self.loop = events, asyncio.get_running_loop()
        self.request = None
        self.done = False

    def listener(self, request, piece: str) -> None:  # runs on the engine thread
        try:
            event = (self.index, piece, request.finished, len(request.output))  # the tokens this piece closes
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        """Queue the engine request (it joins at the engine's next step; `started` awaits it)."""
        return self.threads.submit(prompt, params, request_id=self.id, listener=self.listener)

    async def started(self, added: Future) -> None:
        try:
            self.request = await asyncio.wrap_future(added)
        except ValueError as exc:
            raise APIError(400, str(exc), param="max_tokens" if "max_tokens" in str(exc) else None) from None

    def cancel(self) -> None:
        if not self.done:
            self.threads.abort(self.id)


class _Choices:
    """The n calls of one HTTP request, their events merged into one queue (in the engine's order)."""

    def __init__(self, threads: EngineThread, kind: str, n: int):
        self.kind, self.events = kind, asyncio.Queue()
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.calls = [
            _Call(threads, kind, response_id=response_id, index=i, events=self.events) for i in range(n)
        ]

    @property
    def done(self) -> bool:
        return all(c.done for c in self.calls)

    async def next(self) -> tuple[_Call, str, int]:
        """The call with news, the text it released and how many tokens it had generated then."""
        index, piece, finished, tokens = await self.events.get()
        call = self.calls[index]
        call.done = finished
        return call, piece, tokens

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()


class OpenAIServer:
    """Routes, validation and response bodies; `app` is the FastAPI application."""

    def __init__(self, served: ServedModel, threads: EngineThread, *, default_max_tokens: int):
        self.served, self.threads, self.default_max_tokens = served, threads, default_max_tokens
        self.metrics = ServerMetrics(self._gauges, endpoints=ENDPOINTS)
        # no redirect of a trailing slash (a 307 without an OpenAI body): such a path is a 404
        self.app = app = FastAPI(
            title="ecru serve api", docs_url=None, redoc_url=None, redirect_slashes=False
        )
        for kind in (APIError, RequestValidationError, HTTPException, Exception):
            app.add_exception_handler(kind, self._error)
        app.post("/v1/chat/completions")(self.chat)
        app.post("/v1/completions")(self.completions)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}")(self.model_card)
        app.api_route("/health", methods=["GET", "HEAD"])(self.health)  # load balancers probe with either
        app.get("/metrics")(self.prometheus)

    # ---- routes -------------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, http: Request):
        self._check(body)
        messages = [m.to_template() for m in body.messages]
        try:
            prompt = await asyncio.to_thread(self.served.encode_chat, messages)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except Exception as exc:  # a template that rejects these messages (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        return await self._serve(body, prompt, "chat", http)

    async def completions(self, body: CompletionRequest, http: Request):
        self._check(body)
        prompt = await asyncio.to_thread(self.served.encode, body.text)
        return await self._serve(body, prompt, "completion", http)

    async def models(self):
        self.metrics.count_request(endpoint="/v1/models", status="200")
        return {"object": "list", "data": [self._card()]}

    async def model_card(self, model_id: str):
        self._check_model(model_id)
        self.metrics.count_request(endpoint="/v1/models", status="200")
        return self._card()

    def _card(self) -> dict:
        return {"id": self.served.name, "object": "model", "created": 0, "owned_by": "ecru"}

    async def health(self):
        alive = self.threads.alive
        self.metrics.count_request(endpoint="/health", status="200" if alive else "503")
        if not alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    async def prometheus(self):
        self.metrics.count_request(endpoint="/metrics", status="200")
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ---- serving ------------------------------------------------------------------------------------
    def _check(self, body) -> None:
        self._check_model(body.model)
        body.refuse_unsupported()

    def _check_model(self, name: str) -> None:
        if name != self.served.name:
            raise APIError(404, f"model {name!r} not found; this server has {self.served.name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    def _params(self, body, prompt: list[int], choice: int) -> SamplingParams:
        asked = body.requested_max_tokens
        room = self.served.context_len - len(prompt)
        if asked is None:
            if room < 1:
                raise APIError(400, f"the prompt ({len(prompt)} tokens) fills the model's context "
                               f"of {self.served.context_len} tokens", param="messages")  # fmt: skip
            asked = min(self.default_max_tokens, room)
        return body.sampling(max_tokens=asked, choice=choice)

    async def _serve(self, body, prompt: list[int], kind: str, http: Request):
        choices = _Choices(self.threads, kind, body.n)  # each choice its own engine request
        try:  # all n queued before the engine's next step, so they join together
            added = [
                call.submit(prompt, self._params(body, prompt, i)) for i, call in enumerate(choices.calls)
            ]
            for call, future in zip(choices.calls, added, strict=True):
                await call.started(future)
        except BaseException:
            choices.cancel()
            raise
        if body.stream:
            return StreamingResponse(self._sse(choices, body), media_type="text/event-stream")
        try:
            stayed = await self._gather(choices, http)
        finally:
            choices.cancel()
        self._record(choices, stayed=stayed, streamed=False)
        if not stayed:
            return Response(status_code=int(DISCONNECTED))  # nobody reads it: the connection is gone
        return self._response(choices.calls, body)

    async def _gather(self, choices: _Choices, http: Request) -> bool:
        """Wait for every call to finish; False as soon as the client disconnects (watched, not polled)."""
        gone = asyncio.ensure_future(_disconnect(http))
        try:
            while not choices.done:
                event = asyncio.ensure_future(choices.next())
                await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone.done():
                    event.cancel()
                    return False
            return True
        finally:
            gone.cancel()

    async def _sse(self, choices: _Choices, body) -> AsyncIterator[str]:
        calls = choices.calls
        try:
            for call in calls:
                yield _event(self._chunk(call, body, role=True))
            sent = [0] * len(calls)  # tokens of each choice whose logprobs went out
            while not choices.done:
                call, piece, tokens = await choices.next()
                logprobs = None
                if body.top_logprobs_asked is not None and tokens > sent[call.index]:
                    logprobs, sent[call.index] = self._logprobs(call, sent[call.index], tokens), tokens
                if piece or logprobs:
                    yield _event(self._chunk(call, body, text=piece, logprobs=logprobs))
                if call.done:
                    yield _event(self._chunk(call, body, finish=True))
            if body.include_usage:
                yield _event({**self._chunk(calls[0], body), "choices": [], "usage": self._usage(calls)})
            yield "data: [DONE]\n\n"
        finally:
            choices.cancel()
            self._record(choices, stayed=choices.done, streamed=True)

    # ---- bodies -------------------------------------------------------------------------------------
    def _response(self, calls: list[_Call], body) -> dict:
        if any(c.request.finish_reason == "error" for c in calls):
            raise APIError(500, f"the model failed while generating: {self.threads.error}")
        choices = [self._choice(i, c, body) for i, c in enumerate(calls)]
        obj = "chat.completion" if calls[0].kind == "chat" else "text_completion"
        return {"id": calls[0].response_id, "object": obj, "created": calls[0].created,
                "model": self.served.name, "choices": choices, "usage": self._usage(calls)}  # fmt: skip

    def _choice(self, index: int, call: _Call, body) -> dict:
        req = call.request
        choice = {"index": index, "finish_reason": req.finish_reason, "logprobs": None}
        if call.kind == "chat":
            choice["message"] = {"role": "assistant", "content": req.text}
        else:
            choice["text"] = req.text
        if body.top_logprobs_asked is not None:
            choice["logprobs"] = self._logprobs(call, 0, min(len(req.output), len(req.logprobs)))
        return choice

    def _token(self, token_id: int) -> str:
        """A token as text, or as `bytes:\\xNN...` when it is part of a UTF-8 character (as OpenAI shows them)."""
        raw = self.served.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _logprobs(self, call: _Call, start: int, end: int) -> dict:
        """The `logprobs` of a choice (or a chunk) over its generated tokens [start, end), in the
        endpoint's shape: chat's `content` list, or completions' parallel lists."""
        req = call.request
        pairs = list(zip(req.output[start:end], req.logprobs[start:end], strict=True))
        if call.kind == "chat":
            return {"content": [{**self._entry(t, lp), "top_logprobs": [self._entry(i, v) for i, v in top]}
                                for t, (lp, top) in pairs], "refusal": None}  # fmt: skip
        tokens = [self._token(t) for t, _ in pairs]
        decode = self.served.tokenizer.decode
        offsets = [len(decode(req.output[:k]).rstrip("\ufffd")) for k in range(start, start + len(pairs))]
        tops = [
            {self._token(i): v for i, v in top} | {tok: lp}
            for tok, (_, (lp, top)) in zip(tokens, pairs, strict=True)
        ]
        return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in pairs],
                "top_logprobs": tops, "text_offset": offsets}  # fmt: skip

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = self.served.token_bytes(token_id)
        return {"token": self._token(token_id), "logprob": logprob, "bytes": list(raw)}

    def _chunk(self, call: _Call, body, *, text: str = "", role: bool = False, finish: bool = False,
               logprobs: dict | None = None) -> dict:  # fmt: skip
        reason = call.request.finish_reason if finish else None
        if call.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": call.index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": call.index, "text": text, "finish_reason": reason, "logprobs": logprobs}
            obj = "text_completion"
        return {"id": call.response_id, "object": obj, "created": call.created, "model": self.served.name,
                "choices": [choice]}  # fmt: skip

    @staticmethod
    def _usage(calls: list[_Call]) -> dict:
        p, c = len(calls[0].request.prompt), sum(len(call.request.output) for call in calls)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _record(self, choices: _Choices, *, stayed: bool, streamed: bool) -> None:
        """Count the HTTP request (499 if the client left first) and observe each of its calls. A failed
        call answered in one body is counted by the error handler, as the 500 it is answered with."""
        failed = any(c.request.finish_reason == "error" for c in choices.calls)
        if streamed or not stayed or not failed:
            status = DISCONNECTED if not stayed else "500" if failed else "200"
            path = "/v1/chat/completions" if choices.kind == "chat" else "/v1/completions"
            self.metrics.count_request(endpoint=path, status=status)
        for call in choices.calls:
            req = call.request
            end = req.finish_s or time.perf_counter()
            ttft = None if req.first_token_s is None else req.first_token_s - req.arrival_s
            self.metrics.observe(prompt_tokens=len(req.prompt), generation_tokens=len(req.output),
                                 ttft_s=ttft, latency_s=end - req.arrival_s)  # fmt: skip

    def _gauges(self) -> dict[str, tuple[float, str]]:
        s = self.threads.snapshot
        return {
            "ecru_queue_length": (s["waiting"], "Requests waiting for a row"),
            "ecru_running_requests": (s["running"], "Requests in the running batch"),
            "ecru_batch_occupancy": (s["running"] / s["rows"], "Running rows / the batch's row limit"),
            "ecru_engine_steps": (s["steps"], "Engine iterations since start"),
            "ecru_preemptions": (s["preemptions"], "Requests preempted since start (cb-kv)"),
            "ecru_prefix_cache_hit_tokens": (
                s["prefix_hit_tokens"],
                "Prompt tokens whose KV came from the prefix cache since start",
            ),
        }

    # ---- errors -------------------------------------------------------------------------------------
    async def _error(self, request: Request, exc: Exception):
        return _refuse(self.metrics, request.url.path, _as_api_error(exc))


def _as_api_error(exc: Exception) -> APIError:
    """Any error a route raised, as the OpenAI error it is answered with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return APIError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where or None)
    if isinstance(exc, HTTPException):
        return APIError(exc.status_code, str(exc.detail))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def _refuse(metrics: ServerMetrics, path: str, exc: APIError) -> JSONResponse:
    """The one place an error becomes OpenAI's JSON body (and a count in /metrics)."""
    metrics.count_request(endpoint=path, status=str(exc.status))
    return JSONResponse(exc.body(), status_code=exc.status)


async def _disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def create_app(
    served: ServedModel, threads: EngineThread, *, default_max_tokens: int = 256, api: APIConfig | None = None
):
    """The ASGI application: `OpenAIServer`'s routes behind `APIGuard`."""
    server = OpenAIServer(served, threads, default_max_tokens=default_max_tokens)
    return APIGuard(server.app, api or APIConfig(), server.metrics)


# ---- before routing: the API key and the body limit ----------------------------------------------------
@dataclass(frozen=True)
class APIConfig:
    """What the HTTP layer enforces before a request reaches a route."""

    api_key: str | None = None
    """Bearer token every /v1 route requires (None: open); /health and /metrics stay open."""
    max_body_bytes: int = 2**20
    """Largest request body accepted; a larger one is answered 413."""
    body_timeout_s: float = 30.0
    """Seconds a request body may stall between its parts; then 408 (a half-sent body holds no connection)."""

    def __post_init__(self):
        key = self.api_key
        if key is not None and (not key or key != key.strip() or not (key.isascii() and key.isprintable())):
            raise ValueError("the API key must be non-empty printable ASCII (an HTTP header carries it), "
                             "without surrounding spaces")  # fmt: skip
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")


class APIGuard:
    """ASGI middleware: a body over the limit is 413 and a /v1 call without the key 401, both before
    routing; a body within the limit is read here once and replayed to the app."""

    def __init__(self, app, config: APIConfig, metrics: ServerMetrics):
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._unauthorised(scope)
        if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, refusal = await self._read(scope, receive)
            receive = _replay(body, receive)
        if refusal is None:
            return await self.app(scope, receive, send)
        await _refuse(self.metrics, scope["path"], refusal)(scope, receive, send)

    def _unauthorised(self, scope) -> APIError | None:
        key = self.config.api_key
        if key is None or not scope["path"].startswith("/v1"):
            return None
        given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return None
        return APIError(
            401, "missing or wrong API key: send 'Authorization: Bearer KEY'", code="invalid_api_key"
        )

    async def _read(self, scope, receive) -> tuple[bytes, APIError | None]:
        limit = self.config.max_body_bytes
        too_big = APIError(
            413, f"the request body exceeds {limit} bytes (--max-body-bytes)", code="body_too_large"
        )
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > limit:
            return b"", too_big
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), self.config.body_timeout_s)
            except TimeoutError:
                return b"", APIError(408, f"the request body stalled for {self.config.body_timeout_s:g} s; "
                                     "send it whole", code="body_timeout")  # fmt: skip
            if message["type"] != "http.request":  # the client left mid-body: nothing to answer, counted 499
                return b"", APIError(int(DISCONNECTED), "the client disconnected while sending its body")
            chunks.append(message.get("body", b""))
            size, more = size + len(chunks[-1]), message.get("more_body", False)
            if size > limit:
                return b"", too_big
        return b"".join(chunks), None


def _replay(body: bytes, receive):
    """`receive` that hands the app the body already read, then reads on (the disconnect)."""
    first = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return first.pop() if first else await receive()

    return replayed
