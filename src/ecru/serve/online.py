"""Online serving in the simulator: requests arrive over time (seconds), a policy decides who runs.

Policies (`ONLINE_POLICIES`):
- `fcfs`: static batching; when the model is idle, up to `max_batch_size` waiting requests (arrival order)
  form one batch that runs until its longest answer ends (a row's answer is complete at its own last token);
- `cb`: continuous batching, first come first served;
- `cb-sjf`: continuous batching, shortest predicted (prompt-only) answer admitted first;
- `cb-srpt`: shortest predicted *remaining* answer first: every `repredict_every` tokens a running row's
  remaining length is predicted again (from its own hidden states); with `preempt`, the running row
  predicted to run longest gives its place to a waiting request predicted shorter by `preempt_margin`;
- `oracle-srpt`: `cb-srpt` on the true remaining lengths.

Aging is in the predictions' own unit, tokens: a waiting request's key is its predicted remaining length
minus `aging` x (seconds waited / `token_s`), `token_s` being the measured time of one decode step, i.e.
the time a running row takes to produce one token (aging 1: a waiting request gains priority as fast as a
running row works off its remaining length; the default 0.1 is `queues.DEFAULT_AGING`). All waiting requests age alike, so the order among them
is fixed at enqueue time (a heap); a request's wait is bounded by its prediction / aging in decode steps
behind any later arrival.

With `fcfs_slack` (the engine's `EngineConfig.fcfs_slack`), the longest-waiting request goes first once it
has waited (1 + fcfs_slack) x the wait first-come-first-served would now impose: the backlog of predicted
tokens (waiting requests' predictions, running rows' predicted remainders) over `max_batch_size` rows, in
decode steps. Shortest-first keeps the short requests' gain while each wait stays bounded relative to the
current predicted backlog (`queues.SJFQueue`).

Costs (`CostModel`): one prefill per admission over the widest (prompt + tokens kept) row, one decode step
per token over the padded cache (rows x widest row, the engine's left-padded layout, which is also
`peak_kv_tokens`). A preempted row keeps its tokens and is prefilled again with them when readmitted
(`preempt_mode` recompute, what the engine's cb-kv does), or keeps its KV too and rejoins without a forward
(keep, the engine's cb-srpt default; rejoining is not charged: the engine merges the kept rows into the
batch as it merges any admission). Prompt-only prediction costs `predict_s` per request and re-prediction `repredict_s`
per row, both on the serving clock. With `prefill_at_arrival` (the engine's prefill on arrival) the
prompt-only prediction rides on the prompt's own prefill, done when it arrives; its KV (counted in
`peak_kv_tokens`) waits with it and admission costs no forward.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ecru.serve.cost import CostModel
from ecru.serve.names import ONLINE_POLICIES, PREEMPT_MODES
from ecru.serve.queues import DEFAULT_AGING, past_fcfs_deadline


@dataclass(frozen=True)
class OnlineRequest:
    """One request of an online trace."""

    arrival_s: float
    """When it arrives (seconds from the start)."""
    prompt_len: int
    """Prompt tokens (chat template included)."""
    output_len: int
    """True answer length in tokens (capped by `OnlineConfig.max_new_tokens` when served)."""
    predicted: float = 0.0
    """Prompt-only predicted answer length (cb-sjf; cb-srpt before its first re-prediction)."""
    remaining: tuple[float, ...] = ()
    """cb-srpt: predicted remaining length after 0, k, 2k, ... generated tokens (k = repredict_every);
    entry 0 is unused (the prompt-only `predicted` stands there)."""


@dataclass(frozen=True)
class OnlineConfig:
    """Limits and knobs of the online simulator."""

    max_batch_size: int = 16
    """Rows decoded together at most."""
    max_new_tokens: int = 256
    """Cap on generated tokens per request."""
    refill_min: int = 4
    """Continuous policies admit only when this many rows are free (or the batch is empty), as the engine."""
    repredict_every: int = 16
    """cb-srpt: tokens between re-predictions of a running row's remaining length."""
    aging: float = DEFAULT_AGING
    """Priority tokens gained per decode-step time waited (0: none, long requests may starve)."""
    token_s: float = 0.1
    """Seconds of one decode step (the aging unit); set it from the measured cost model."""
    preempt: bool = False
    """cb-srpt, oracle-srpt: preempt the longest-predicted running row when a shorter one waits."""
    preempt_margin: float = 64.0
    """Tokens by which the waiting request must be predicted shorter than the row it displaces."""
    preempt_mode: str = "recompute"
    """What a preempted row's KV does: "recompute" drops it and the row is prefilled again with its tokens
    when readmitted (the engine's cb-kv); "keep" holds it while the row waits (counted in
    `peak_kv_tokens`, in host memory on a CPU server; the engine's cb-srpt default) and the row rejoins the
    batch without a forward. Rows that would be past their FCFS deadline as soon as they waited again are
    not preempted (the deadline would readmit them at once)."""
    predict_s: float = 0.0
    """Seconds of prompt-only prediction per request (cb-sjf, cb-srpt), charged on arrival."""
    repredict_s: float = 0.0
    """Seconds per row per re-prediction (cb-srpt)."""
    prefill_at_arrival: bool = False
    """The engine's prefill on arrival (`RequestEngine(state_predictor=...)`; cb too): prompts are
    prefilled as they arrive and the prompt-only prediction is read from that forward's hidden states (the
    probe's features), so `predict_s` must be 0. Arrived prompts are prefilled once `refill_min` of them
    wait unprefilled or the batch could take them now (running + waiting < `max_batch_size`), in the
    engine's `arrival_groups` (similar lengths, at most `max_batch_size` rows); each gets its first token
    there and its KV waits with it, queued in arrival order, so admission needs no forward."""
    fcfs_slack: float | None = None
    """cb-sjf, cb-srpt, oracle-srpt: a request that has waited (1 + fcfs_slack) x the FCFS wait estimate
    (predicted backlog / max_batch_size, in decode steps) is admitted first, longest-waiting first; None:
    aging alone bounds the wait."""
    arrival_kv_requests: int = 256
    """Waiting requests whose KV is kept at most (prefilled on arrival, or preempted with `preempt_mode`
    keep); beyond, the longest-predicted one's KV is dropped and it is prefilled again (prompt and the
    tokens it has) when admitted."""

    def __post_init__(self):
        if min(self.max_batch_size, self.max_new_tokens, self.refill_min, self.repredict_every) < 1:
            raise ValueError("max_batch_size, max_new_tokens, refill_min, repredict_every must be >= 1")
        if min(self.aging, self.preempt_margin, self.predict_s, self.repredict_s) < 0 or self.token_s <= 0:
            raise ValueError("aging, preempt_margin, predict_s, repredict_s must be >= 0 and token_s > 0")
        if self.fcfs_slack is not None and self.fcfs_slack < 0:
            raise ValueError(f"fcfs_slack must be >= 0 (or None: off), got {self.fcfs_slack}")
        if self.arrival_kv_requests < 1:
            raise ValueError(f"arrival_kv_requests must be >= 1, got {self.arrival_kv_requests}")
        if self.preempt_mode not in PREEMPT_MODES:
            raise ValueError(f"preempt_mode must be one of {PREEMPT_MODES}, got {self.preempt_mode!r}")
        if self.prefill_at_arrival and self.predict_s:
            raise ValueError("prefill_at_arrival reads the prediction from the prefill: predict_s must be 0")


@dataclass
class OnlineResult:
    """One policy over one online trace (names as in the JSON)."""

    policy: str
    requests: int
    mean_latency_s: float
    p50_latency_s: float
    p99_latency_s: float
    max_latency_s: float
    tokens_per_s: float
    peak_kv_tokens: int
    time_s: float
    preemptions: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("latencies")
        return out


def _result(policy, trace, finish, tokens, clock, peak_kv, preemptions) -> OnlineResult:
    lat = [f - r.arrival_s for f, r in zip(finish, trace, strict=True)]
    return OnlineResult(
        policy=policy,
        requests=len(trace),
        mean_latency_s=sum(lat) / len(lat),
        p50_latency_s=float(np.percentile(lat, 50)),
        p99_latency_s=float(np.percentile(lat, 99)),
        max_latency_s=max(lat),
        tokens_per_s=tokens / clock if clock else float("inf"),
        peak_kv_tokens=peak_kv,
        time_s=clock,
        preemptions=preemptions,
        latencies=lat,
    )


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """`n` arrival times (seconds) of a Poisson stream of `rate` requests per second."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def simulate_online(
    trace: Sequence[OnlineRequest], *, policy: str, config: OnlineConfig, cost: CostModel
) -> OnlineResult:
    """Serve `trace` (any order of arrivals) with `policy`; latency = finish - arrival per request."""
    if policy not in ONLINE_POLICIES:
        raise ValueError(f"unknown online policy {policy!r}; choose from {', '.join(ONLINE_POLICIES)}")
    if not trace:
        raise ValueError("the trace is empty")
    if config.fcfs_slack is not None and policy in ("fcfs", "cb"):
        raise ValueError(f"fcfs_slack orders predicted-shortest-first admission: not for policy {policy!r}")
    if policy == "fcfs":
        return _simulate_static(trace, config, cost)
    return _Continuous(trace, policy, config, cost).run()


def _simulate_static(trace: Sequence[OnlineRequest], config: OnlineConfig, cost: CostModel) -> OnlineResult:
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    finish, clock, peak, tokens, pos = [0.0] * len(trace), 0.0, 0, 0, 0
    while pos < len(order):
        clock = max(clock, trace[order[pos]].arrival_s)
        batch = []
        while (
            pos < len(order) and len(batch) < config.max_batch_size and trace[order[pos]].arrival_s <= clock
        ):
            batch.append(order[pos])
            pos += 1
        lens = [max(1, min(trace[i].output_len, config.max_new_tokens)) for i in batch]
        prompt = max(trace[i].prompt_len for i in batch)
        for i, n in zip(batch, lens, strict=True):
            finish[i] = clock + cost.batch_time(len(batch), prompt, n)
        clock += cost.batch_time(len(batch), prompt, max(lens))
        peak = max(peak, len(batch) * (prompt + max(lens) - 1))
        tokens += sum(lens)
    return _result("fcfs", trace, finish, tokens, clock, peak, 0)


class _Continuous:
    """The continuous-batching loop: arrivals, admission by key, prefill, decode steps, re-prediction."""

    def __init__(self, trace, policy: str, config: OnlineConfig, cost: CostModel):
        self.trace, self.policy, self.config, self.cost = trace, policy, config, cost
        self.target = [max(1, min(r.output_len, config.max_new_tokens)) for r in trace]
        self.done = [0] * len(trace)
        self.estimate = [float(r.predicted) for r in trace]  # predicted remaining, in tokens
        if policy == "oracle-srpt":
            self.estimate = [float(t) for t in self.target]
        self.since = [0] * len(trace)  # tokens generated when `estimate` was set (it counts down from there)
        self.waited = [0.0] * len(trace)  # seconds waited before the current enqueue
        self.enqueued = [0.0] * len(trace)
        self.finish = [0.0] * len(trace)
        self.heap: list[tuple[float, int, int]] = []
        self.seq = 0
        self.clock, self.peak, self.preemptions = 0.0, 0, 0
        self.steps = 0  # decode steps so far: the FCFS deadline's clock, as the engine's
        self.wait_steps = [0] * len(trace)  # decode steps waited before the current enqueue
        self.wait_began = [0] * len(trace)  # the step its wait would have begun, waited in one stay
        self.by_wait: list[tuple[int, int, tuple]] = []  # (step its wait began, seq, heap entry): a heap
        self.queued: dict[int, float] = {}  # seq of each heap entry -> its request's remaining tokens
        self.queued_tokens = 0.0
        self.overdue: set[int] = set()  # admitted past their deadline: never preempted
        self.running: list[int] = []
        self.arrived: list[int] = []  # prefill on arrival: arrived, not yet prefilled
        self.kept: dict[int, int] = {}  # waiting with their KV (tokens held), in keeping order
        self.kept_tokens = 0

    # -- priorities -------------------------------------------------------------------------------------
    def _static_key(self, i: int) -> float:
        """Key at enqueue, up to the term - aging x clock / token_s shared by every waiting request."""
        if self.policy == "cb":
            return self.enqueued[i]
        a = self.config.aging / self.config.token_s  # a preempted row's estimate is its remainder (as queued)
        return min(self.estimate[i], self.config.max_new_tokens) - a * self.waited[i] + a * self.enqueued[i]

    def _running_key(self, i: int) -> float:
        """A running row's key now: its predicted remaining tokens less the aging it earned while it waited."""
        return self._remaining(i) - self.config.aging / self.config.token_s * self.waited[i]

    def _push(self, i: int) -> None:
        self.enqueued[i] = self.clock
        entry = (self._static_key(i), self.seq, i)
        heapq.heappush(self.heap, entry)
        # a preempted request's wait goes on from where it stopped
        self.wait_began[i] = self.steps - self.wait_steps[i]
        heapq.heappush(self.by_wait, (self.wait_began[i], self.seq, entry))
        self.queued[self.seq] = self._remaining(i)
        self.queued_tokens += self.queued[self.seq]
        self.seq += 1

    def _pop(self) -> int:
        entry = self._overdue()
        if entry is None:
            entry = heapq.heappop(self.heap)
        else:  # the longest-waiting request, past its FCFS deadline: it runs to the end, never preempted
            self.overdue.add(entry[2])
            k = self.heap.index(entry)
            self.heap[k] = self.heap[-1]
            self.heap.pop()
            heapq.heapify(self.heap)
        self.queued_tokens -= self.queued.pop(entry[1])
        i = entry[2]
        self.waited[i] += self.clock - self.enqueued[i]
        self.wait_steps[i] = self.steps - self.wait_began[i]
        return i

    def _remaining(self, i: int) -> float:
        """Predicted tokens left: the estimate less what the row generated since it was made, at most what the
        cap leaves (the engine caps a row's predicted length, tokens so far included, at its max_tokens)."""
        left = self.estimate[i] - (self.done[i] - self.since[i])
        return max(0.0, min(left, self.config.max_new_tokens - self.done[i]))  # the answer ends at the cap

    def _overdue(self) -> tuple[float, int, int] | None:
        """With `fcfs_slack`, the heap entry of the longest-waiting request if it has waited (1 + slack) x
        the FCFS wait estimate (the predicted backlog over max_batch_size rows, in decode steps)."""
        if self.config.fcfs_slack is None:
            return None
        while self.by_wait[0][1] not in self.queued:
            heapq.heappop(self.by_wait)
        began, _, entry = self.by_wait[0]
        if not self._would_be_overdue(self.steps - began):
            return None
        return heapq.heappop(self.by_wait)[2]

    def _would_be_overdue(self, waited: int) -> bool:
        """Whether a request that has waited `waited` decode steps is past its FCFS deadline now."""
        slack = self.config.fcfs_slack
        backlog = self.queued_tokens + sum(map(self._remaining, self.running))
        return slack is not None and past_fcfs_deadline(
            waited, backlog, rows=self.config.max_batch_size, slack=slack
        )

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self) -> OnlineResult:
        cfg, trace = self.config, self.trace
        pending = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
        pos, predicts, swapped = 0, self.policy in ("cb-sjf", "cb-srpt"), False
        on_arrival = cfg.prefill_at_arrival  # cb too: the engine prefills on arrival whatever the order
        while pos < len(pending) or self.heap or self.running or self.arrived:
            if not self.heap and not self.running and not self.arrived:
                self.clock = max(self.clock, trace[pending[pos]].arrival_s)
            while pos < len(pending) and trace[pending[pos]].arrival_s <= self.clock:
                if on_arrival:
                    self.arrived.append(pending[pos])
                else:
                    self.clock += cfg.predict_s if predicts else 0.0
                    self._push(pending[pos])
                pos += 1
            self._prefill_arrivals()
            self._admit(upcoming=len(pending) - pos, force=swapped)
            swapped = False
            if self.running:
                self._step()
                swapped = self._maybe_preempt() > 0  # rows freed for shorter requests: refilled at once
        tokens = sum(self.target)
        return _result(self.policy, trace, self.finish, tokens, self.clock, self.peak, self.preemptions)

    def _width(self, rows) -> int:
        return max(self.trace[i].prompt_len + self.done[i] for i in rows)

    def _admit(self, *, upcoming: int, force: bool = False) -> None:
        free, waiting = self.config.max_batch_size - len(self.running), len(self.heap)
        if not (waiting and free > 0):
            return
        if free < min(self.config.refill_min, waiting + upcoming) and self.running and not force:
            return
        admit = [self._pop() for _ in range(min(free, waiting))]
        # a prefill over prompt (+ tokens kept by a preempted row) yields each row's next token; rows
        # prefilled on arrival bring their KV and their token
        fresh = [i for i in admit if i not in self.kept]
        for i in admit:
            self._unkeep(i)
        if fresh:
            self.clock += self.cost.prefill_time(len(fresh), self._width(fresh))
            self._grow(fresh)
        self.running += [i for i in admit if self.done[i] < self.target[i]]

    def _prefill_arrivals(self) -> None:
        """Prefill on arrival, as the engine: once `refill_min` prompts wait unprefilled or the batch could
        take them now, they are prefilled in `arrival_groups` forwards, each row's first token at the end
        of its own forward; then they wait, predicted, with their KV, queued in arrival order."""
        from ecru.serve.arrival import arrival_groups

        cfg, group = self.config, self.arrived
        if not group or (
            len(group) < cfg.refill_min and len(self.running) + len(self.heap) >= cfg.max_batch_size
        ):
            return
        self.arrived = []
        for part in arrival_groups([self.trace[i].prompt_len for i in group], cfg.max_batch_size):
            rows = [group[k] for k in part]
            self.clock += self.cost.prefill_time(len(rows), self._width(rows))
            held = len(self.running) * self._width(self.running) if self.running else 0
            self.peak = max(self.peak, held + self.kept_tokens + len(rows) * self._width(rows))
            self._grow(rows)
        for i in group:
            if self.done[i] < self.target[i]:
                self._push(i)
                self._keep(i, self.trace[i].prompt_len)
        self._bound_kept()

    def _bound_kept(self) -> None:
        """At most `arrival_kv_requests` waiting requests keep their KV: the longest-predicted loses its
        KV first (the newest of equals), as the engine's `KeptKV`."""
        cfg = self.config
        while len(self.kept) > cfg.arrival_kv_requests:
            self._unkeep(max(reversed(self.kept), key=lambda i: min(self.estimate[i], cfg.max_new_tokens)))

    def _keep(self, i: int, tokens: int) -> None:
        self.kept[i] = tokens
        self.kept_tokens += tokens

    def _unkeep(self, i: int) -> None:
        if i in self.kept:
            self.kept_tokens -= self.kept.pop(i)

    def _step(self) -> None:
        width = self._width(self.running)
        self.peak = max(self.peak, len(self.running) * width + self.kept_tokens)
        self.clock += self.cost.step_time(len(self.running), width)
        self.steps += 1
        self._grow(self.running, decode=True)
        self.running = [i for i in self.running if self.done[i] < self.target[i]]

    def _grow(self, rows, *, decode: bool = False) -> None:
        """One more token for each row; finished rows record their time. cb-srpt re-predicts as the engine
        does: in the decode step that reads the state after k, 2k, ... tokens (and emits the next one)."""
        k, repredicted = self.config.repredict_every, 0
        for i in rows:
            self.done[i] += 1
            if self.done[i] >= self.target[i]:
                self.finish[i] = self.clock
            elif self.policy == "oracle-srpt":
                self.estimate[i], self.since[i] = self.target[i] - self.done[i], self.done[i]
            elif self.policy == "cb-srpt" and decode and self._repredicted(i):
                step, rem = (self.done[i] - 1) // k, self.trace[i].remaining
                if step < len(rem):
                    self.estimate[i], self.since[i] = float(rem[step]), self.done[i] - 1
                    repredicted += 1
        self.clock += repredicted * self.config.repredict_s

    def _repredicted(self, i: int) -> bool:
        """Whether running row i's remaining length was just predicted again: the decode step that made its
        latest token read the state after a multiple of `repredict_every` tokens."""
        return self.done[i] > 1 and (self.done[i] - 1) % self.config.repredict_every == 0

    def _maybe_preempt(self) -> int:
        """SRPT with limited preemption, after a decode step as in the engine: a full batch swaps up to
        `refill_min` of its just re-predicted rows, each the longest-predicted against the next shortest
        waiting request, when the gap exceeds the margin."""
        cfg = self.config
        if not (cfg.preempt and self.policy in ("cb-srpt", "oracle-srpt") and self.heap):
            return 0
        if len(self.running) < cfg.max_batch_size:
            return 0
        now = cfg.aging / cfg.token_s * self.clock
        waiting = [key - now for key, _, _ in heapq.nsmallest(cfg.refill_min, self.heap)]
        ready = [i for i in self.running if self._repredicted(i) and i not in self.overdue
                 and not self._would_be_overdue(self.wait_steps[i])]  # fmt: skip
        victims = sorted(ready, key=self._running_key, reverse=True)
        swapped = [
            v for v, w in zip(victims, waiting, strict=False) if self._running_key(v) - w > cfg.preempt_margin
        ]
        for v in swapped:
            self.running.remove(v)
            self.estimate[v], self.since[v] = self._remaining(v), self.done[v]  # queued by what is left
            self._push(v)
            if cfg.preempt_mode == "keep":  # its newest token is pending, not cached (as in the engine)
                self._keep(v, self.trace[v].prompt_len + self.done[v] - 1)
        self._bound_kept()
        self.preemptions += len(swapped)
        return len(swapped)
