"""What `ecru serve api` enforces before a request reaches a route: the API key (401 on every /v1 route
without it) and the body limit (413), both answered as OpenAI error bodies and counted in /metrics."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from ecru.serve.api_schema import APIError
from ecru.serve.metrics import ServerMetrics


@dataclass(frozen=True)
class APIConfig:
    """What the HTTP layer enforces before a request reaches a route."""

    api_key: str | None = None
    """Bearer token every /v1 route requires (None: open); /health and /metrics stay open."""
    max_body_bytes: int = 2**20
    """Largest request body accepted; a larger one is answered 413."""

    def __post_init__(self):
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise ValueError("the API key must be non-empty, without surrounding spaces")
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
        self.metrics.count_request(endpoint=scope["path"], status=str(refusal.status))
        await JSONResponse(refusal.body(), status_code=refusal.status)(scope, receive, send)

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
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size, more = size + len(chunks[-1]), message.get("more_body", False)
            if size > limit:
                return b"", too_big
        return b"".join(chunks), None


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
