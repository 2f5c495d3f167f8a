"""`ecru serve api`: an OpenAI-compatible HTTP server (FastAPI) on the request engine.

Every HTTP request becomes one engine request on the engine thread (`background.EngineThread`), so
concurrent clients share the running batch. The engine's listener hands each released piece of text to
the request's asyncio queue (thread-safely); a streaming response sends it as a server-sent event at once,
a plain one gathers it. A client that goes away has its request cancelled, which frees its row at the
next step. Errors are OpenAI's JSON bodies: 400 for an invalid request, 404 for an unknown model or path.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ecru.serve.api_schema import APIError, ChatCompletionRequest, CompletionRequest
from ecru.serve.background import EngineThread
from ecru.serve.metrics import ServerMetrics
from ecru.serve.models import ServedModel
from ecru.serve.sampling import SamplingParams

POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


class _Call:
    """One engine request seen from the event loop: its events, and its cancellation."""

    def __init__(self, threads: EngineThread, kind: str):
        self.threads, self.kind = threads, kind
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.request = None
        self.done = False

    def listener(self, request, piece: str) -> None:  # runs on the engine thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (piece, request.finished))
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    async def start(self, prompt: list[int], params: SamplingParams) -> None:
        added = self.threads.submit(prompt, params, request_id=self.id, listener=self.listener)
        try:
            self.request = await asyncio.wrap_future(added)
        except ValueError as exc:
            raise APIError(400, str(exc), param="max_tokens" if "max_tokens" in str(exc) else None) from None

    async def next(self) -> tuple[str, bool]:
        piece, finished = await self.events.get()
        self.done = finished
        return piece, finished

    def cancel(self) -> None:
        if not self.done:
            self.threads.abort(self.id)


class OpenAIServer:
    """Routes, validation and response bodies; `app` is the FastAPI application."""

    def __init__(self, served: ServedModel, threads: EngineThread, *, default_max_tokens: int):
        self.served, self.threads, self.default_max_tokens = served, threads, default_max_tokens
        self.metrics = ServerMetrics(self._gauges)
        self.app = FastAPI(title="ecru serve api", docs_url=None, redoc_url=None)
        self._routes()

    # ---- routes -------------------------------------------------------------------------------------
    def _routes(self) -> None:
        app = self.app
        app.add_exception_handler(APIError, self._api_error)
        app.add_exception_handler(RequestValidationError, self._validation_error)
        app.add_exception_handler(HTTPException, self._http_error)
        app.post("/v1/chat/completions")(self.chat)
        app.post("/v1/completions")(self.completions)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}")(self.model_card)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)

    async def chat(self, body: ChatCompletionRequest, http: Request):
        self._check(body)
        try:
            prompt = self.served.encode_chat([m.to_template() for m in body.messages])
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except Exception as exc:  # a template that rejects these messages (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        return await self._serve(body, prompt, "chat", http)

    async def completions(self, body: CompletionRequest, http: Request):
        self._check(body)
        return await self._serve(body, self.served.encode(body.text), "completion", http)

    async def models(self):
        return {"object": "list", "data": [self._card()]}

    async def model_card(self, model_id: str):
        if model_id != self.served.name:
            raise APIError(404, f"model {model_id!r} not found; this server has {self.served.name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return self._card()

    def _card(self) -> dict:
        return {"id": self.served.name, "object": "model", "created": 0, "owned_by": "ecru"}

    async def health(self):
        if not self.threads.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    async def prometheus(self):
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    # ---- serving ------------------------------------------------------------------------------------
    def _check(self, body) -> None:
        if body.model != self.served.name:
            raise APIError(404, f"model {body.model!r} not found; this server has {self.served.name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        body.refuse_unsupported()

    def _params(self, body, prompt: list[int]) -> SamplingParams:
        asked = body.requested_max_tokens
        room = self.served.context_len - len(prompt)
        if asked is None:
            if room < 1:
                raise APIError(400, f"the prompt ({len(prompt)} tokens) fills the model's context "
                               f"of {self.served.context_len} tokens", param="messages")  # fmt: skip
            asked = min(self.default_max_tokens, room)
        return body.sampling(max_tokens=asked)

    async def _serve(self, body, prompt: list[int], kind: str, http: Request):
        call = _Call(self.threads, kind)
        await call.start(prompt, self._params(body, prompt))
        if body.stream:
            return StreamingResponse(self._sse(call, body), media_type="text/event-stream")
        try:
            await self._gather(call, http)
        finally:
            call.cancel()
        return self._response(call, body)

    async def _gather(self, call: _Call, http: Request) -> None:
        while not call.done:
            try:
                await asyncio.wait_for(call.next(), timeout=POLL_S)
            except TimeoutError:
                if await http.is_disconnected():
                    return

    async def _sse(self, call: _Call, body) -> AsyncIterator[str]:
        try:
            yield _event(self._chunk(call, body, role=True))
            while not call.done:
                piece, finished = await call.next()
                if piece:
                    yield _event(self._chunk(call, body, text=piece))
            yield _event(self._chunk(call, body, finish=True))
            if body.include_usage:
                yield _event({**self._chunk(call, body), "choices": [], "usage": self._usage(call)})
            yield "data: [DONE]\n\n"
        finally:
            call.cancel()
            self._record(call, kind=call.kind, stream=True)

    # ---- bodies -------------------------------------------------------------------------------------
    def _response(self, call: _Call, body) -> dict:
        req = call.request
        self._record(call, kind=call.kind, stream=False)
        if req.finish_reason == "error":
            raise APIError(500, f"the model failed while generating: {self.threads.error}")
        choice = {"index": 0, "finish_reason": req.finish_reason, "logprobs": None}
        if call.kind == "chat":
            choice["message"] = {"role": "assistant", "content": req.text}
            obj = "chat.completion"
        else:
            choice["text"] = req.text
            obj = "text_completion"
        return {"id": call.id, "object": obj, "created": call.created, "model": self.served.name,
                "choices": [choice], "usage": self._usage(call)}  # fmt: skip

    def _chunk(self, call: _Call, body, *, text: str = "", role: bool = False, finish: bool = False) -> dict:
        reason = call.request.finish_reason if finish else None
        if call.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            obj = "text_completion"
        return {"id": call.id, "object": obj, "created": call.created, "model": self.served.name,
                "choices": [choice]}  # fmt: skip

    @staticmethod
    def _usage(call: _Call) -> dict:
        p, c = len(call.request.prompt), len(call.request.output)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _record(self, call: _Call, *, kind: str, stream: bool) -> None:
        req = call.request
        status = "500" if req.finish_reason == "error" else "200" if call.done else "499"
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        self.metrics.count_request(endpoint=path, status=status)
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
    async def _api_error(self, request: Request, exc: APIError):
        self.metrics.count_request(endpoint=request.url.path, status=str(exc.status))
        return JSONResponse(exc.body(), status_code=exc.status)

    async def _validation_error(self, request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request body"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        message = f"{where}: {first['msg']}" if where else first["msg"]
        return await self._api_error(request, APIError(400, message, param=where or None))

    async def _http_error(self, request: Request, exc: HTTPException):
        return await self._api_error(request, APIError(exc.status_code, str(exc.detail)))


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def create_app(served: ServedModel, threads: EngineThread, *, default_max_tokens: int = 256) -> FastAPI:
    return OpenAIServer(served, threads, default_max_tokens=default_max_tokens).app
