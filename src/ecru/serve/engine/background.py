"""The engine on a background thread, so that an asyncio server keeps answering while the batch runs.

Front ends call `submit` and `abort` from any thread; the engine thread applies them between steps (the
engine itself is single-threaded) and steps while any request is unfinished, sleeping otherwise. A model
error ends the requests in flight with finish_reason "error" and the thread carries on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from ecru.serve.engine.request_engine import Listener, RequestEngine
from ecru.serve.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineThread:
    """Runs a `RequestEngine` on its own thread; requests from other threads join its running batch."""

    def __init__(self, engine: RequestEngine):
        self.engine = engine
        self._inbox: list[Callable[[], None]] = []
        self._wake = threading.Condition()
        self._closed = False
        self.error: str | None = None
        self.snapshot: dict[str, float] = {}
        """Waiting and running requests, rows, steps: updated by the engine thread, read by /metrics."""
        self._record()
        self._thread = threading.Thread(target=self._loop, name="ecru-engine", daemon=True)
        self._thread.start()

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, *, request_id: str, listener: Listener
    ) -> Future:
        """Queue a request; the future holds its `Request` once queued, or the ValueError refusing it."""
        added: Future = Future()
        prompt = list(prompt)  # the caller's list, copied now

        def add() -> None:
            try:
                added.set_result(
                    self.engine.add_request(prompt, params, request_id=request_id, listener=listener)
                )
            except ValueError as exc:
                added.set_exception(exc)

        self._post(add)
        return added

    def abort(self, request_id: str) -> None:
        self._post(lambda: self.engine.abort(request_id))

    def close(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _post(self, action: Callable[[], None]) -> None:
        """Run `action` on the engine thread, between steps."""
        with self._wake:
            self._inbox.append(action)
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._inbox or self._closed or self.engine.has_unfinished()):
                    self._wake.wait()
                if self._closed:
                    self.engine.fail_all("abort")
                    return
                inbox, self._inbox = self._inbox, []
            for action in inbox:
                action()
            if self.engine.has_unfinished():
                self._step()
            self._record()

    def _record(self) -> None:
        e, sched = self.engine, self.engine.scheduler
        self.snapshot = {
            "waiting": sched.num_waiting,
            "running": len(sched.running),
            "rows": sched.config.max_rows,
            "steps": e.stats.steps,
            "preemptions": e.stats.preemptions,
            "prefix_hit_tokens": e.stats.prefix_hit_tokens,
        }

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as exc:  # a model failure must not take the server down with it
            log.exception("engine step failed; ending the requests in flight")
            self.error = f"{type(exc).__name__}: {exc}"
            self.engine.fail_all("error")
