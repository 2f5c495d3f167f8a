"""Waiting queues for continuous batching: which request is admitted next when a row frees up.

`FCFSQueue` admits in arrival order (`cb`). `SJFQueue` admits the shortest predicted response first, with
aging: a request's priority is predicted_len - aging x (steps waited). Every waiting request ages at the
same rate, so the order is that of predicted_len + aging x arrival_step, a key fixed at arrival (a heap).
A request arriving at step t has key >= aging x t, so one waiting since step a with prediction p is
admitted by step a + p / aging at the latest, however many short requests keep arriving: no starvation
(`cb-sjf`, for mean latency). The same queue on negated predictions admits the longest predicted first
(`cb-ljf`, for throughput): with every request waiting, starting the long ones first leaves no long
answer running alone at the end while the batch drains (longest-processing-time-first list scheduling). `cb-kv` admits in FCFS order but reserves KV memory by
predicted length instead of the cap (`scheduler.Admitter`), so more rows fit the same memory.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ecru.serve.sched.names import CONTINUOUS_POLICIES, DEFAULT_AGING


class RequestQueue(Protocol):
    """Where waiting requests are held; `pop` returns the index of the next request to admit (`now`: the
    decode step it is admitted at); `discard` forgets a waiting request (cancelled) whenever it is popped."""

    def push(self, index: int, *, now: int) -> None: ...

    def pop(self, *, now: int) -> int: ...

    def discard(self, index: int) -> None: ...

    def __len__(self) -> int: ...


class FCFSQueue:
    """First come, first served."""

    def __init__(self):
        self._items: deque[int] = deque()

    def push(self, index: int, *, now: int) -> None:
        self._items.append(index)

    def pop(self, *, now: int) -> int:
        return self._items.popleft()

    def discard(self, index: int) -> None:
        if index in self._items:
            self._items.remove(index)

    def __len__(self) -> int:
        return len(self._items)


class SJFQueue:
    """Shortest predicted job first, aged by `aging` tokens of priority per decode step waited.

    With `fcfs_slack`, the longest-waiting request is admitted first once it has waited (1 + fcfs_slack) x
    the wait first-come-first-served would now impose: the backlog of predicted tokens (the waiting
    requests' predictions plus `running_tokens()`, the running rows' predicted remainders) over `rows`
    decode rows, in decode steps. Short requests still go first, while a request's wait stays bounded
    relative to the current predicted backlog: a bound on the tail that, unlike aging, does not turn the
    order into FCFS under a backlog (use it with aging 0). The estimate counts requests that arrived after the waiting
    one, so under a sustained load above 1 + 1 / (1 + fcfs_slack) times the capacity (1.87 at 0.15) it
    grows as fast as the wait and the bound recedes until arrivals slow; aging bounds the wait there.
    """

    def __init__(self, predicted: Sequence[float] | Mapping[int, float], *, aging: float = DEFAULT_AGING,
                 fcfs_slack: float | None = None, rows: int = 16,
                 running_tokens: Callable[[], float] = lambda: 0.0):  # fmt: skip
        if aging < 0:
            raise ValueError(f"aging must be >= 0 (0 = pure SJF, may starve long requests), got {aging}")
        if fcfs_slack is not None and fcfs_slack < 0:
            raise ValueError(f"fcfs_slack must be >= 0 (None: off), got {fcfs_slack}")
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.predicted, self.aging, self.fcfs_slack = predicted, aging, fcfs_slack
        self.rows, self.running_tokens = rows, running_tokens
        self._heap: list[tuple[float, int, int]] = []
        self._arrivals: list[tuple[int, int, int]] = []  # heap of (step its wait began, count, index)
        self._began: dict[int, int] = {}  # waiting index -> the step its wait began
        self._waited: dict[int, int] = {}  # index -> steps it waited in earlier stays (a preempted request)
        self._live: dict[int, float] = {}  # count of each waiting entry -> its prediction
        self._count_of: dict[int, int] = {}  # index -> count of its waiting entry
        self._waiting_tokens = 0.0
        self._count = 0
        self.past_deadline: set[int] = set()
        """Requests popped because their FCFS deadline passed (until discarded): never to be preempted."""

    def push(self, index: int, *, now: int) -> None:
        if index in self._count_of:
            raise ValueError(f"request {index} is already waiting")
        # the counter breaks ties in arrival order; a request pushed again (preempted) goes on waiting from
        # where it stopped: its aging and its deadline count every step it waited
        p, began = float(self.predicted[index]), now - self._waited.get(index, 0)
        heapq.heappush(self._heap, (p + self.aging * began, self._count, index))
        if self.fcfs_slack is not None:
            heapq.heappush(self._arrivals, (began, self._count, index))
        self._began[index] = began
        self._live[self._count], self._count_of[index] = p, self._count
        self._waiting_tokens += max(p, 0.0)
        self._count += 1

    def pop(self, *, now: int) -> int:
        overdue = self._overdue(now)
        count, index = overdue or self._shortest()
        if overdue:
            self.past_deadline.add(index)
        self._waited[index] = now - self._began[index]
        self._forget(count, index)
        return index

    def waited(self, index: int) -> int:
        """Decode steps request `index` waited in its stays so far (while it runs: before it was admitted)."""
        return self._waited.get(index, 0)

    def would_be_overdue(self, waited: int) -> bool:
        """Whether a request that has waited `waited` steps is past its FCFS deadline now: (1 + fcfs_slack) x the
        predicted backlog over `rows` decode rows."""
        if self.fcfs_slack is None:
            return False
        return waited >= (1 + self.fcfs_slack) * (self._waiting_tokens + self.running_tokens()) / self.rows

    def smallest(self, n: int, *, now: int) -> list[float]:
        """The `n` lowest priorities now (predicted length less aging x steps waited), lowest first."""
        live = (key for key, count, _ in self._heap if count in self._live)
        return [key - self.aging * now for key in heapq.nsmallest(n, live)]

    def discard(self, index: int) -> None:
        """A finished or cancelled request leaves the backlog now; its stale entries are skipped later."""
        self.past_deadline.discard(index)
        self._waited.pop(index, None)
        if index in self._count_of:
            self._forget(self._count_of[index], index)

    def _forget(self, count: int, index: int) -> None:
        self._waiting_tokens -= max(self._live.pop(count), 0.0)
        del self._count_of[index], self._began[index]
        if not self._live:  # nothing waits: drop the stale entries at once
            self._heap.clear()
            self._arrivals = []
            self._waiting_tokens = 0.0
        elif len(self._heap) + len(self._arrivals) > 4 * len(self._live) + 64:  # stale entries pile up
            self._heap = [e for e in self._heap if e[1] in self._live]
            heapq.heapify(self._heap)
            self._arrivals = [e for e in self._arrivals if e[1] in self._live]
            heapq.heapify(self._arrivals)

    def _shortest(self) -> tuple[int, int]:
        while self._heap[0][1] not in self._live:  # taken by its deadline earlier
            heapq.heappop(self._heap)
        _, count, index = heapq.heappop(self._heap)
        return count, index

    def _overdue(self, now: int) -> tuple[int, int] | None:
        if self.fcfs_slack is None:
            return None
        while self._arrivals[0][1] not in self._live:  # admitted by its prediction earlier
            heapq.heappop(self._arrivals)
        began, count, index = self._arrivals[0]
        if not self.would_be_overdue(now - began):
            return None
        heapq.heappop(self._arrivals)
        return count, index

    def __len__(self) -> int:
        return len(self._live)


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
