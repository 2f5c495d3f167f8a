"""Waiting queues for continuous batching: which request is admitted next when a row frees up.

`FCFSQueue` admits in arrival order (`cb`). `SJFQueue` admits the shortest predicted response first, with
aging: a request's priority is predicted_len - aging x (steps waited). Every waiting request ages at the
same rate, so the order is that of predicted_len + aging x arrival_step, a key fixed at arrival (a heap).
A request arriving at step t has key >= aging x t, so one waiting since step a with prediction p is
admitted by step a + p / aging at the latest, however many short requests keep arriving: no starvation
(`cb-sjf`, for mean latency). The same queue on negated predictions admits the longest predicted first
(`cb-ljf`, for throughput): with every request waiting, starting the long ones first leaves no long
answer running alone at the end while the batch drains (longest-processing-time-first list scheduling). `cb-kv` admits in FCFS order but reserves KV memory by
predicted length instead of the cap (`continuous.Admitter`), so more rows fit the same memory.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from typing import Protocol


class RequestQueue(Protocol):
    """Where waiting requests are held; `pop` returns the index of the next request to admit."""

    def push(self, index: int, *, now: int) -> None: ...

    def pop(self) -> int: ...

    def __len__(self) -> int: ...


class FCFSQueue:
    """First come, first served."""

    def __init__(self):
        self._items: deque[int] = deque()

    def push(self, index: int, *, now: int) -> None:
        self._items.append(index)

    def pop(self) -> int:
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


DEFAULT_AGING = 0.1
"""Priority tokens per decode step waited. The old 0.5 made `cb-sjf` FCFS under any backlog: once requests
wait a few hundred steps, 0.5 x the arrival gap outweighs predictions of at most the cap. 0.1 keeps most of
shortest-first's mean-latency gain while bounding a long request's wait behind later arrivals to
prediction / 0.1 steps (`bench/serve_online.py`'s aging sweep, mixed workload, load 1.2)."""


class SJFQueue:
    """Shortest predicted job first, aged by `aging` tokens of priority per decode step waited."""

    def __init__(self, predicted: Sequence[float], *, aging: float = DEFAULT_AGING):
        if aging < 0:
            raise ValueError(f"aging must be >= 0 (0 = pure SJF, may starve long requests), got {aging}")
        self.predicted, self.aging = predicted, aging
        self._heap: list[tuple[float, int, int]] = []
        self._count = 0

    def push(self, index: int, *, now: int) -> None:
        # the counter breaks ties in arrival order
        heapq.heappush(self._heap, (self.predicted[index] + self.aging * now, self._count, index))
        self._count += 1

    def pop(self) -> int:
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)


CONTINUOUS_POLICIES = ("cb", "cb-sjf", "cb-ljf", "cb-kv")


def make_queue(
    policy: str, predicted: Sequence[float] | None = None, *, aging: float = DEFAULT_AGING
) -> RequestQueue:
    """The waiting queue of a continuous-batching policy of `CONTINUOUS_POLICIES`."""
    if policy not in CONTINUOUS_POLICIES:
        raise ValueError(
            f"unknown continuous policy {policy!r}; choose from {', '.join(CONTINUOUS_POLICIES)}"
        )
    if policy in ("cb", "cb-kv"):  # cb-kv: FCFS order, KV reserved by predicted length (runner)
        return FCFSQueue()
    if predicted is None:
        raise ValueError(f"policy {policy!r} needs a predicted length per request")
    return SJFQueue(predicted if policy == "cb-sjf" else [-p for p in predicted], aging=aging)
