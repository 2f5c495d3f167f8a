"""Starting the OpenAI-compatible server in the foreground (`ecru serve api`): uvicorn on the engine thread's
batch. The tests run the same app (`build`) on a background thread (tests/serve/helpers.py)."""

from __future__ import annotations

import signal
import socket

import uvicorn

from ecru.errors import EcruError
from ecru.serve.engine.background import EngineThread
from ecru.serve.engine.models import ServedModel
from ecru.serve.engine.request_engine import RequestEngine
from ecru.serve.entrypoints.openai_api import APIConfig, create_app


def build(served: ServedModel, engine: RequestEngine, *, api: APIConfig | None = None):
    """The engine thread running `engine` and the ASGI app on it (`api`: the API key and body limit)."""
    threads = EngineThread(engine)
    return threads, create_app(served, threads, default_max_tokens=engine.config.max_new_tokens, api=api)


DRAIN_S = 60.0
"""Ctrl-C waits at most this long for the requests in flight (a client that stops reading cannot hold the
server); then they are cancelled."""


def serve_forever(
    served: ServedModel, engine: RequestEngine, *, host: str, port: int, api: APIConfig | None = None
) -> None:
    """Run until Ctrl-C: uvicorn stops accepting, drains the requests in flight, then re-raises the
    signal (KeyboardInterrupt: the CLI exits 130)."""
    threads, app = build(served, engine, api=api)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=DRAIN_S)
    server = _Server(config)
    try:  # not uvicorn.run, which swallows the KeyboardInterrupt its server re-raises after draining
        server.run()
    finally:
        threads.close()
    if server.interrupted:  # SIGINT ignored when started (a background job): uvicorn's re-raise did nothing
        raise KeyboardInterrupt


class _Server(uvicorn.Server):
    """uvicorn's server, remembering a Ctrl-C (SIGINT) it drained for."""

    interrupted = False

    def handle_exit(self, sig, frame) -> None:
        self.interrupted |= sig == signal.SIGINT
        super().handle_exit(sig, frame)


def check_bindable(host: str, port: int) -> None:
    """A busy port or a foreign address, refused in one line (before a front end loads its model)."""
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise EcruError(
            f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port or --host"
        ) from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
