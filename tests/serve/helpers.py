"""Test helpers of the serving tests: the OpenAI-compatible server on a background thread."""

from __future__ import annotations

import threading
import time

import uvicorn

from ecru.serve.engine.models import ServedModel
from ecru.serve.engine.request_engine import EngineConfig, PredictLength, RemainingPredictor
from ecru.serve.entrypoints.openai_api import APIConfig
from ecru.serve.entrypoints.server import build, free_port


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
        engine = served.engine(config, remaining=remaining, predict=predict)
        self.threads, app = build(served, engine, api=api)
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
