"""Starting the OpenAI-compatible server: in the foreground (`ecru serve api`) or on a background thread
(tests, benchmarks), always uvicorn on the engine thread's batch."""

from __future__ import annotations

import socket
import threading
import time

from ecru.serve.api_guard import APIConfig
from ecru.serve.background import EngineThread
from ecru.serve.models import ServedModel
from ecru.serve.openai_api import create_app
from ecru.serve.request_engine import EngineConfig, PredictLength, RemainingPredictor


def build(
    served: ServedModel,
    config: EngineConfig,
    *,
    remaining: RemainingPredictor | None = None,
    predict: PredictLength | None = None,
    api: APIConfig | None = None,
):
    """The engine thread and the ASGI app on it (`remaining`: cb-srpt's fitted `RemainingProbe`;
    `predict`: each request's predicted length, e.g. a fitted `EmbeddingPredictor`'s `engine_predict`;
    `api`: the API key and body limit)."""
    threads = EngineThread(served.engine(config, remaining=remaining, predict=predict))
    return threads, create_app(served, threads, default_max_tokens=config.max_new_tokens, api=api)


def serve_forever(
    served: ServedModel,
    config: EngineConfig,
    *,
    host: str,
    port: int,
    remaining: RemainingPredictor | None = None,
    predict: PredictLength | None = None,
    api: APIConfig | None = None,
) -> None:
    """Run until Ctrl-C: uvicorn stops accepting, drains the requests in flight, then re-raises the
    signal (KeyboardInterrupt: the CLI exits 130)."""
    import uvicorn

    threads, app = build(served, config, remaining=remaining, predict=predict, api=api)
    try:  # not uvicorn.run, which swallows the KeyboardInterrupt its server re-raises after draining
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info")).run()
    finally:
        threads.close()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """`with BackgroundServer(served, config) as url:` a real uvicorn server on a free loopback port."""

    def __init__(
        self,
        served: ServedModel,
        config: EngineConfig,
        *,
        host: str = "127.0.0.1",
        remaining: RemainingPredictor | None = None,
        predict: PredictLength | None = None,
        api: APIConfig | None = None,
    ):
        import uvicorn

        self.threads, app = build(served, config, remaining=remaining, predict=predict, api=api)
        self.host, self.port = host, free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self.server.run, name="ecru-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the uvicorn server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.threads.close()
