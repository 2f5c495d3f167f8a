"""The engine core's scheduler: who waits, who runs, who is preempted, whose KV is kept. Model-free, torch-free.

One scheduler drives the real engine (`request_engine.RequestEngine`, run by its `ModelRunner`) and
every continuous-batching simulator (`simulator.SimulatedRunner`: a trace's lengths on a cost-model
clock), so the engine and the simulators decide alike by construction. `Scheduler.step(runner)` is
nano-vllm's `LLMEngine.step` / vLLM v1's EngineCore step, in three phases, each planned here and executed
by the runner:

1. prefill on arrival (`on_arrival`): arrived prompts are prefilled in `arrival_groups` once `refill_min`
   of them wait unprefilled or the batch could take them now; each gets its first token and a predicted
   length, and waits queued with its KV kept (at most `arrival_kv_requests` waiting requests keep KV:
   beyond, the longest-predicted one's is released and it is prefilled again at admission);
2. admission (`EngineConfig.policy`: cb, cb-sjf, cb-srpt, cb-kv; an `Admitter` over a waiting queue, within
   `EngineConfig`'s limits): requests with kept KV rejoin without a forward, the others are
   prefilled (prompt plus the tokens a preempted request kept);
3. one decode step for every running row; then cb-kv's budget preempts the newest rows
   (`Admitter.preempt`) and cb-srpt swaps just re-predicted rows for waiting requests predicted shorter
   (`_srpt_preempt`), keeping or dropping their KV (`preempt_mode`).

The scheduler counts each request's tokens; the runner says which rows ended (EOS, a stop string, the
cap, a trace's length) and gives the predictions (a state predictor at arrival, a remaining-length
predictor at re-prediction points).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ecru.serve.sched.names import DEFAULT_AGING, ENGINE_POLICIES, FCFS_SLACK, PREEMPT_MODES, SJF_POLICIES
from ecru.serve.sched.queues import FCFSQueue, RequestQueue, SJFQueue


def padded_peak(cached: Sequence[int], steps: Sequence[int]) -> int:
    """The most KV positions a left-padded batch holds over its coming decode steps, padding included.

    Row k holds `cached[k]` positions now and runs `steps[k]` more decode steps (rows with none are
    left out). Decode step t feeds one more position to every row still running, so the cache holds
    (rows with steps >= t) x (max of their cached + t): growing in t while no row leaves, hence largest
    at a step where some row runs its last."""
    rows = sorted((s, c) for c, s in zip(cached, steps, strict=True) if s > 0)
    peak, widest = 0, 0
    for k in range(len(rows) - 1, -1, -1):  # longest-running first: rows[k:] are still running at t
        s, c = rows[k]
        widest = max(widest, c)
        if k == 0 or rows[k - 1][0] != s:
            peak = max(peak, (len(rows) - k) * (widest + s))
    return peak


class Admitter:
    """Who joins the running batch, and who leaves it early, under a KV budget (S3-style reservations).

    Waiting requests come from `queue` (its policy decides the order), except requests taken out of it
    and not admitted, or preempted: they wait in `held` and go first. A request is admitted with
    `Seq.reserve` answer tokens reserved (its predicted length, clipped to 1..its cap) if the cache this
    engine really holds stays within `EngineConfig.kv_budget` (`padded_peak`: rows x widest row over the
    reservations' whole future, and the prefill's new cache next to the running one, with the answer
    tokens each request holds, `Seq.generated`: a preempted request may keep its tokens and be prefilled
    with them); the first row of an empty batch always runs. When a running request has generated as
    many tokens as it reserved, its reservation grows to the cap; if the batch then outgrows the budget,
    the newest requests are preempted (their tokens discarded, recomputed from scratch when admitted
    again, as vLLM's recompute preemption does, then reserving the cap) until it fits. Greedy outputs are
    unchanged. Predictions are rounded down. With cb-kv's extra rows (`EngineConfig.kv_row_factor`),
    `refill_min` rarely holds admission back (free rows abound): memory decides when requests join,
    often one prompt per prefill.
    The real loop and the simulator share this object, so they decide alike.
    """

    def __init__(self, queue: RequestQueue, config: EngineConfig, seqs: Mapping[int, Seq]):
        self.queue, self.held, self.config, self.seqs = queue, deque(), config, seqs
        self.reserved: dict[int, int] = {}
        """Answer tokens each running request reserves now."""

    def cap(self, i: int) -> int:
        """Request `i`'s cap: its own max_tokens, at most `config.max_new_tokens`."""
        return min(self.seqs[i].cap, self.config.max_new_tokens)

    def forget(self, i: int) -> None:
        """Request `i` is done for good (finished or cancelled): drop what is kept about it."""
        self.reserved.pop(i, None)
        self.queue.discard(i)

    def __len__(self) -> int:
        return len(self.queue) + len(self.held)

    def admit(self, n: int, *, now: int) -> list[int]:
        """Up to `n` requests that fit the budget, in order (reserved as they are returned); `now`: the
        decode step (the queue's clock)."""
        picked: list[int] = []
        running = list(self.reserved)
        while len(picked) < n and len(self):
            i = self.held.popleft() if self.held else self.queue.pop(now=now)
            if i not in self.seqs:
                continue  # forgotten while it waited (a cancelled request)
            if not self._fits(running, [*picked, i]) and (picked or self.reserved):
                self.held.appendleft(i)
                break
            picked.append(i)
            self.reserved[i] = self.seqs[i].reserve
        return picked

    def _fits(self, running: Sequence[int], new: Sequence[int] = ()) -> bool:
        """Whether `running` rows and `new` ones prefilled now stay within the budget, as really held."""
        if self.config.kv_budget is None:
            return True
        seqs = self.seqs
        # a running row's newest token is not cached yet; a new row is prefilled (prompt and kept tokens), then
        # samples one token
        cached = [seqs[i].prompt_len + seqs[i].generated - 1 for i in running]
        prefilled = [seqs[i].prompt_len + seqs[i].generated for i in new]
        # every row runs the next decode step, even one already at its reservation: reservations grow
        # (and rows may be preempted) only after a decode step
        steps = [max(1, self.reserved[i] - seqs[i].generated) for i in running]
        steps += [max(1, seqs[i].reserve - seqs[i].generated - 1) for i in new]
        held_at_prefill = len(running) * max(cached, default=0) + len(new) * max(prefilled, default=0)
        peak = max(held_at_prefill, padded_peak(cached + prefilled, steps))
        return peak <= self.config.kv_budget

    def leave(self, i: int) -> None:
        """Request `i` finished: its reservation is freed."""
        del self.reserved[i]

    def preempt(self, running: Sequence[int]) -> list[int]:
        """After a decode step (`running`: oldest first): grow exhausted reservations to the cap, then preempt
        the newest requests until the batch fits the budget. Returns the preempted ones; they wait first in
        line, in their admission order."""
        for i in running:
            if self.seqs[i].generated >= self.reserved[i]:
                self.reserved[i] = self.cap(i)
        out, left = [], list(running)
        for i in reversed(running):
            if self._fits(left) or len(self.reserved) == 1:
                break
            left.remove(i)
            del self.reserved[i]
            self.seqs[i].reserve = self.cap(i)  # its prediction proved short: readmit at the cap
            self.held.appendleft(i)
            out.append(i)
        return out


PREFILL_OVERHEAD_TOKENS = 32
"""What one more prefill forward costs, in padded prompt positions: a forward reads every weight once
(SmolLM2-135M on one CPU thread: a 1-row step ~80 ms, a prompt position ~3 ms in a big prefill)."""


def prefill_groups(lengths: Sequence[int], *, overhead: int = PREFILL_OVERHEAD_TOKENS) -> list[list[int]]:
    """Split prompts admitted together into prefill forwards of similar lengths: the partition of the
    length-sorted prompts that minimizes the positions computed (rows x longest prompt, left padding
    included) plus `overhead` per forward. Indices into `lengths`; one group unless splitting saves more
    padding than the extra forwards cost."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best, cut = [0] * (len(order) + 1), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):  # best[end]: the first `end` sorted prompts; cut: their last group
        width = lengths[order[end - 1]]
        best[end], cut[end] = min((best[j] + overhead + (end - j) * width, j) for j in range(end))
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def arrival_groups(lengths: Sequence[int], max_rows: int) -> list[list[int]]:
    """The arrival prefill forwards: `prefill_groups` of the prompt lengths, each cut into consecutive
    pieces (in length order) of at most `max_rows` prompts. Indices into `lengths`."""
    return [g[i : i + max_rows] for g in prefill_groups(lengths) for i in range(0, len(g), max_rows)]


@dataclass(frozen=True)
class EngineConfig:
    """Batching limits and the admission policy: the engine's and every simulator's."""

    policy: str = "cb"
    """Admission: cb (first come first served), cb-sjf (shortest predicted first, aged), cb-srpt (cb-sjf,
    then shortest predicted remaining first: re-prediction while generating and preemption; needs a
    remaining-length predictor), cb-kv (KV reserved by predicted length)."""
    max_batch_size: int = 16
    """Rows decoded together at most (cb-kv: the rows whose cap-length KV memory is shared)."""
    max_new_tokens: int = 256
    """The largest max_tokens a request may ask for (and the default in the front ends)."""
    refill_min: int = 4
    """Admit only when this many rows are free (or the batch is empty, or fewer wait)."""
    aging: float | None = None
    """cb-sjf, cb-srpt: priority tokens gained per decode step waited (no starvation); None: 0 under an FCFS
    deadline (it bounds the wait instead), else `DEFAULT_AGING`."""
    fcfs_slack: float | None = None
    """cb-sjf, cb-srpt: admit the longest-waiting request first once it has waited (1 + fcfs_slack) x the wait
    first-come-first-served would now impose (predicted backlog / max_batch_size decode steps;
    `queues.SJFQueue`); inf: off, aging alone bounds the wait; None: the shipped default, `FCFS_SLACK` for
    cb-srpt, off for cb-sjf."""
    kv_prompt_tokens: int = 128
    """cb-kv: prompt tokens per row in the budget, max_batch_size x (max_new_tokens + this)."""
    kv_row_factor: int = 4
    """cb-kv: rows allowed, as a multiple of max_batch_size, when reservations are small."""
    prefix_cache: int = 16
    """Recently prefilled sequences whose KV is kept for prompts that start alike (`kv_cache.PrefixStore`);
    0 turns prefix caching off. The model runner's; the scheduler ignores it."""
    arrival_kv_requests: int = 256
    """Waiting requests whose KV is kept at most, prefilled on arrival or preempted by cb-srpt (beyond, the
    longest-predicted one's is dropped and it is prefilled again, prompt and tokens, at admission)."""
    repredict_every: int = 16
    """cb-srpt: generated tokens between re-predictions of a running row's remaining length."""
    preempt_margin: float = 64.0
    """cb-srpt: a full batch swaps a just re-predicted row for a waiting request predicted this many tokens
    shorter than the row's remainder (inf: never)."""
    preempt_mode: str = "keep"
    """cb-srpt: a preempted row's KV is kept while it waits (counted in `peak_kv_tokens`; it rejoins
    without a forward) or dropped and recomputed from its prompt and tokens ("recompute")."""

    def __post_init__(self):
        if self.policy not in ENGINE_POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(ENGINE_POLICIES)}")
        ints = ("max_batch_size", "max_new_tokens", "refill_min", "kv_prompt_tokens", "kv_row_factor",
                "arrival_kv_requests", "repredict_every")  # fmt: skip
        for name in ints:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_cache < 0:
            raise ValueError(f"prefix_cache must be >= 0 (0 = off), got {self.prefix_cache}")
        if self.aging_per_step < 0:
            raise ValueError(f"aging must be >= 0, got {self.aging}")
        slack = self.fcfs_slack
        if (slack is not None and slack < 0) or (
            self.deadline is not None and self.policy not in SJF_POLICIES
        ):
            raise ValueError(f"fcfs_slack must be >= 0 and needs policy cb-sjf or cb-srpt (inf: off), got "
                             f"{slack} with {self.policy}")  # fmt: skip
        if self.preempt_margin < 0 or self.preempt_mode not in PREEMPT_MODES:
            raise ValueError(f"preempt_margin must be >= 0 and preempt_mode one of {PREEMPT_MODES}; got "
                             f"{self.preempt_margin}, {self.preempt_mode!r}")  # fmt: skip

    @property
    def deadline(self) -> float | None:
        """The FCFS deadline's slack, None when off (`fcfs_slack`, or the policy's shipped default)."""
        slack = (
            (FCFS_SLACK if self.policy == "cb-srpt" else math.inf)
            if self.fcfs_slack is None
            else self.fcfs_slack
        )
        return None if math.isinf(slack) else slack

    @property
    def aging_per_step(self) -> float:
        """The aging in force (`aging`, or the policy's default)."""
        if self.aging is not None:
            return self.aging
        return DEFAULT_AGING if self.deadline is None else 0.0

    @property
    def max_rows(self) -> int:
        """Rows decoded together at most: `max_batch_size`, times `kv_row_factor` under cb-kv."""
        return self.max_batch_size * (self.kv_row_factor if self.policy == "cb-kv" else 1)

    @property
    def kv_budget(self) -> int | None:
        """cb-kv: the KV-cache tokens the running requests may hold (`Admitter`), max_batch_size x
        (max_new_tokens + kv_prompt_tokens), the memory cb runs in; None (other policies): only
        `max_rows` limits the batch."""
        if self.policy != "cb-kv":
            return None
        return self.max_batch_size * (self.max_new_tokens + self.kv_prompt_tokens)


@dataclass
class Seq:
    """The scheduler's view of one request."""

    key: int
    prompt_len: int
    cap: int
    """Its max_tokens."""
    predicted: float | None = None
    """Its predicted answer length, at most `cap` (its queue key; cb-srpt: its tokens so far plus its latest
    predicted remainder)."""
    generated: int = 0
    """Answer tokens it holds (a preempted request keeps them unless the scheduler discards preempted work)."""
    reserve: int = 0
    """cb-kv: answer tokens it reserves when admitted (`Admitter`): its prediction, then its cap once
    preempted."""


@dataclass
class Outcome:
    """What a runner reports after executing one phase of a step."""

    ended: set[int] = field(default_factory=set)
    """Rows whose answer ended with the token just computed."""
    predicted: Mapping[int, float] = field(default_factory=dict)
    """Prefill on arrival: each prefilled request's predicted answer length; decode: each re-predicted
    row's predicted remaining tokens (rows missing: not re-predicted)."""


class Runner(Protocol):
    """Executes the scheduler's plans: on the model (`request_engine.ModelRunner`) or on a cost-model clock
    (`simulator.SimulatedRunner`). Rows are request keys; the runner's batch holds the running rows in the
    order the scheduler's `running` lists them."""

    def prefill_arrivals(self, groups: list[list[int]]) -> Outcome:
        """Prefill each group in one forward (first token, predicted length); keep the KV of rows that go on."""
        ...

    def admit(self, kept: list[int], fresh: list[int]) -> Outcome:
        """Join the batch: `kept` rows with their kept KV (no forward), then `fresh` rows prefilled (prompt and
        the tokens they hold, one new token each; those that go on join in this order)."""
        ...

    def decode(self, rows: list[int], repredict: list[int]) -> Outcome:
        """One decode step of `rows`; predict the remaining tokens of `repredict` from this step's states."""
        ...

    def preempt(self, keys: list[int], *, keep_kv: bool, discard: bool) -> None:
        """Rows `keys` leave the batch, their KV kept (`keep_kv`) or dropped; `discard`: their tokens too."""
        ...

    def release(self, keys: list[int]) -> None:
        """Drop the kept KV of waiting requests `keys` (they are prefilled again at admission)."""
        ...


class Scheduler:
    """Waiting and running requests, admission, preemption, kept KV; `step(runner)` runs one iteration."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        queue: RequestQueue | None = None,
        discard_preempted: bool = False,
        srpt: bool = False,
        on_arrival: bool = False,
    ):
        """`queue` replaces the one `config` implies (offline measurements bring their own);
        `discard_preempted`: a preempted request restarts from its prompt; `srpt`: cb-srpt's re-prediction
        (the runner predicts remaining lengths); `on_arrival`: prefill on arrival (the runner predicts each
        length from that prefill)."""
        self.config, self.srpt, self.on_arrival = config, srpt, on_arrival
        self.discard_preempted = discard_preempted
        self.seqs: dict[int, Seq] = {}
        self._predicted: dict[int, float] = {}
        if queue is None:
            queue = self._sjf_queue() if config.policy in SJF_POLICIES else FCFSQueue()
        self.admitter = Admitter(queue, config, self.seqs)
        self.running: list[int] = []
        self.arrived: dict[int, None] = {}  # arrived, not yet prefilled (prefill on arrival), in order
        self.kept: dict[int, tuple[int, float]] = {}  # waiting with KV kept: (positions, predicted), in order
        self.steps = 0
        """Decode steps so far: the queues' clock."""
        self.upcoming = 0
        """Requests the caller will add later: admission waits for `refill_min` of them (offline runs)."""
        self.preemptions = 0
        self.admission_log: list[int] | None = None
        """When a list, the keys of admitted requests are appended in admission order."""
        self._swapped = False
        self._check()

    def _check(self) -> None:
        if self.on_arrival and self.config.kv_budget is not None:
            raise ValueError("prefill on arrival (state_predictor) does not support a KV budget (cb-kv): "
                             "use policy cb or cb-sjf")  # fmt: skip
        if self.srpt != (self.config.policy == "cb-srpt"):
            raise ValueError("policy cb-srpt needs a remaining-length predictor (remaining=, e.g. a fitted "
                             "RemainingProbe), and only it takes one")  # fmt: skip
        if not self.srpt:
            return
        if not isinstance(self.admitter.queue, SJFQueue):
            raise ValueError("cb-srpt preempts by priority in an SJFQueue: give no queue")
        if self.discard_preempted:
            raise ValueError("cb-srpt's preempted rows keep their tokens: discard_preempted is for cb-kv")

    @property
    def num_waiting(self) -> int:
        return len(self.seqs) - len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def skip_to(self, step: int) -> None:
        """Nothing runs until decode step `step` (an idle gap before the next arrival): the clock jumps there."""
        self.steps = max(self.steps, step)

    # ---- requests come and go ------------------------------------------------------------------------
    def add(self, key: int, prompt_len: int, cap: int, predicted: float | None = None) -> Seq:
        """Register request `key` (its `predicted` length queues it; with prefill on arrival the runner's
        prediction does, at the arrival prefill)."""
        if key in self.seqs:
            raise ValueError(f"request key {key} is already in use")
        seq = self.seqs[key] = Seq(key, prompt_len, cap)
        if self.on_arrival:
            self.arrived[key] = None
        else:
            self._enqueue(seq, float(cap) if predicted is None else predicted)
        return seq

    def finish(self, key: int) -> None:
        """Request `key` is done (finished or cancelled): forget it everywhere."""
        self.admitter.forget(key)
        self.arrived.pop(key, None)
        self.kept.pop(key, None)
        if key in self.running:
            self.running.remove(key)
        self.seqs.pop(key, None)

    def _enqueue(self, seq: Seq, predicted: float) -> None:
        seq.predicted = min(float(seq.cap), predicted)
        seq.reserve = min(self.admitter.cap(seq.key), max(1, int(seq.predicted)))
        self._push(seq.key, seq.predicted)

    def _push(self, key: int, value: float) -> None:
        """Queue request `key` with `value` as its predicted length (the queue reads it on push)."""
        self._predicted[key] = value
        self.admitter.queue.push(key, now=self.steps)
        del self._predicted[key]

    def _sjf_queue(self) -> SJFQueue:
        cfg = self.config
        return SJFQueue(self._predicted, aging=cfg.aging_per_step, fcfs_slack=cfg.deadline, rows=cfg.max_batch_size,
                        running_tokens=self._running_tokens)  # fmt: skip

    def _running_tokens(self) -> float:
        """The running rows' predicted remaining tokens (the FCFS deadline's share of the backlog)."""
        rows = (self.seqs[k] for k in self.running)
        return sum(max(0.0, s.predicted - s.generated) for s in rows if s.predicted is not None)

    # ---- one iteration ---------------------------------------------------------------------------------
    def step(self, runner: Runner) -> list[int]:
        """One iteration on `runner`; the keys of the requests that finished in it."""
        finished: list[int] = []
        if self._arrival_due():
            finished += self._prefill_arrivals(runner)
        kept, fresh = self._schedule()
        if kept or fresh:
            finished += self._admitted(kept, fresh, runner.admit(kept, fresh).ended)
        if self.running:
            finished += self._decode(runner)
        return finished

    def _arrival_due(self) -> bool:
        """Whether the arrived (unprefilled) requests are prefilled now: `refill_min` of them have arrived, or
        the batch could take them now (the running rows and the prefilled waiting requests leave room)."""
        arrived = len(self.arrived)
        return arrived > 0 and (
            arrived >= self.config.refill_min or len(self.seqs) - arrived < self.config.max_rows
        )

    def _prefill_arrivals(self, runner: Runner) -> list[int]:
        """Prefill on arrival; the requests still running wait queued, in arrival order, with their KV."""
        arrived = list(self.arrived)
        self.arrived.clear()
        lengths = [self.seqs[k].prompt_len for k in arrived]
        out = runner.prefill_arrivals(
            [[arrived[i] for i in g] for g in arrival_groups(lengths, self.config.max_rows)]
        )
        finished = []
        for key in arrived:
            seq = self.seqs[key]
            seq.generated += 1
            seq.predicted = min(float(seq.cap), out.predicted[key])
            if key in out.ended:  # ended at its first token: never queued
                self.finish(key)
                finished.append(key)
            else:
                self.kept[key] = (seq.prompt_len, seq.predicted)
                self._enqueue(seq, seq.predicted)
        runner.release(self._drop_over_bound())
        return finished

    def _schedule(self) -> tuple[list[int], list[int]]:
        """The admitted requests: those whose KV is kept, then those to prefill."""
        free, waiting = self.config.max_rows - len(self.running), len(self.admitter)
        # none join unless `refill_min` rows are free (or fewer requests are left, or the batch is empty)
        due = free >= min(self.config.refill_min, waiting + self.upcoming) or not self.running
        n = min(free, waiting) if free > 0 and due else 0
        if self._swapped:  # rows cb-srpt freed for shorter requests are refilled at once
            n, self._swapped = min(free, len(self.admitter)), False
        keys = self.admitter.admit(n, now=self.steps)
        if self.admission_log is not None:
            self.admission_log += keys
        kept = [k for k in keys if self.kept.pop(k, None) is not None]
        return kept, [k for k in keys if k not in kept]

    def _admitted(self, kept: list[int], fresh: list[int], ended: set[int]) -> list[int]:
        self.running += kept
        for key in fresh:
            self.seqs[key].generated += 1
        self.running += [k for k in fresh if k not in ended]
        finished = [k for k in fresh if k in ended]
        for key in finished:
            self.finish(key)
        return finished

    def _decode(self, runner: Runner) -> list[int]:
        rows = list(self.running)
        due = self._repredict_due(rows)
        out = runner.decode(rows, due)
        self.steps += 1
        for key, left in out.predicted.items():  # the state read after `generated` tokens
            seq = self.seqs[key]
            seq.predicted = min(float(seq.cap), seq.generated + left)
        for key in rows:
            self.seqs[key].generated += 1
        finished = [k for k in rows if k in out.ended]
        for key in finished:
            self.finish(key)
        self._kv_preempt(runner)
        repredicted = [k for k in due if k in out.predicted and k not in out.ended]
        if repredicted:
            self._srpt_preempt(repredicted, runner)
        return finished

    def _repredict_due(self, rows: list[int]) -> list[int]:
        """cb-srpt: rows whose remaining length is predicted again at this decode step, every
        `repredict_every` generated tokens (the step's state is the one that emits the next token)."""
        if not self.srpt:
            return []
        k = self.config.repredict_every
        return [key for key in rows if self.seqs[key].generated and self.seqs[key].generated % k == 0]

    # ---- preemption --------------------------------------------------------------------------------------
    def _kv_preempt(self, runner: Runner) -> None:
        """cb-kv: reservations that outgrew the budget preempt the newest rows (`Admitter.preempt`)."""
        out = self.admitter.preempt(self.running)
        if not out:
            return
        runner.preempt(out, keep_kv=False, discard=self.discard_preempted)
        for key in out:
            self.running.remove(key)
            if self.discard_preempted:
                self.seqs[key].generated = 0
        self.preemptions += len(out)

    def _srpt_preempt(self, repredicted: list[int], runner: Runner) -> None:
        """A full batch swaps its just re-predicted rows, highest priority key first (predicted remainder
        less the aging it earned waiting), for waiting requests whose key is `preempt_margin` lower, one for
        one, at most `refill_min`. Rows admitted past their FCFS deadline stay, and so do rows that would be
        past it as soon as they waited again (the deadline would readmit them at once)."""
        queue, cfg = self.admitter.queue, self.config
        if len(self.running) < self.config.max_rows or not len(queue):
            return
        left = {k: self.seqs[k].predicted - self.seqs[k].generated for k in repredicted}
        key = {k: left[k] - cfg.aging_per_step * queue.waited(k) for k in repredicted}
        stay = queue.past_deadline | {k for k in repredicted if queue.would_be_overdue(queue.waited(k))}
        victims = sorted((k for k in repredicted if k not in stay), key=key.get, reverse=True)
        waiting = queue.smallest(self.config.refill_min, now=self.steps)
        out = [v for v, w in zip(victims, waiting, strict=False) if key[v] - w > cfg.preempt_margin]
        if not out:
            return
        keep = cfg.preempt_mode == "keep"
        runner.preempt(out, keep_kv=keep, discard=False)
        for k in out:  # its newest token is pending: not in the kept cache
            seq = self.seqs[k]
            if keep:
                self.kept[k] = (seq.prompt_len + seq.generated - 1, left[k])
            self.admitter.leave(k)
            self.running.remove(k)
            self._push(k, left[k])
        self.preemptions += len(out)
        self._swapped = True
        runner.release(self._drop_over_bound())  # a dropped row is prefilled again (prompt and tokens)

    def _drop_over_bound(self) -> list[int]:
        """At most `arrival_kv_requests` waiting requests keep their KV: the longest-predicted ones (the
        newest among equals) lose it first; their keys."""
        dropped = []
        while len(self.kept) > self.config.arrival_kv_requests:
            key = max(reversed(self.kept), key=lambda k: self.kept[k][1])
            del self.kept[key]
            dropped.append(key)
        return dropped


def run_in_steps(
    scheduler: Scheduler,
    arrivals: Sequence[float],
    add: Callable[[int], None],
    step: Callable[[], object],
    *,
    clock: Callable[[], float] | None = None,
    wait: Callable[[float], None] | None = None,
) -> None:
    """Drive `scheduler` until every request is served: request i is added (`add(i)`) once the clock reaches
    `arrivals[i]`, `step()` runs one iteration. The clock counts decode steps (`Scheduler.steps`) unless
    `clock` reads another one (a simulator's seconds); when nothing is left to serve, `wait(t)` skips the
    idle gap to the next arrival (default `Scheduler.skip_to`)."""
    clock = clock or (lambda: scheduler.steps)
    wait = wait or scheduler.skip_to
    incoming = deque(sorted(range(len(arrivals)), key=lambda i: arrivals[i]))
    while incoming or scheduler.has_unfinished():
        if not scheduler.has_unfinished():
            wait(arrivals[incoming[0]])
        while incoming and arrivals[incoming[0]] <= clock():
            add(incoming.popleft())
        scheduler.upcoming = len(incoming)
        step()
