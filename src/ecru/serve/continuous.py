"""Continuous batching's admission pieces, model-free and torch-free: limits (`ContinuousConfig`), how many
waiting requests join (`admissions`), KV reservations and cb-kv's preemption (`Admitter`), prefill grouping
(`prefill_groups`) and prefill on arrival's timing (`arrival_prefill_due`, `arrival_groups`). The scheduler
(`scheduler.Scheduler`) drives them for the engine and every simulator; the running batch itself is
`kv_cache.RunningBatch`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ecru.serve.queues import RequestQueue

KV_ACCOUNTING = ("reserved", "padded")


@dataclass(frozen=True)
class ContinuousConfig:
    """Continuous-batching limits."""

    max_batch_size: int = 16
    """Rows decoded together at most."""
    max_new_tokens: int = 256
    """Cap on generated tokens per request."""
    refill_min: int = 4
    """Admit only when at least this many rows are free (or the batch is empty or nothing else waits):
    prefilling several prompts in one forward is cheaper than one at a time."""
    kv_budget: int | None = None
    """KV-cache tokens the running requests may hold, counted as `kv_accounting` says. None: only
    `max_batch_size` limits the batch. See `Admitter`."""
    kv_accounting: str = "reserved"
    """How `kv_budget` is counted. "reserved": each request's prompt plus the answer tokens reserved for
    it, as a paged cache would hold them (what the simulator models). "padded": what this engine's
    left-padded cache really holds, rows x the widest row (`EngineStats.peak_kv_tokens`, padding
    included), over the reservations' whole future; the measured peak never exceeds the budget."""

    def __post_init__(self):
        if min(self.max_batch_size, self.max_new_tokens, self.refill_min) < 1:
            raise ValueError("max_batch_size, max_new_tokens and refill_min must all be >= 1")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise ValueError(f"kv_budget must be >= 1 token (or None), got {self.kv_budget}")
        if self.kv_accounting not in KV_ACCOUNTING:
            raise ValueError(
                f"kv_accounting must be one of {', '.join(KV_ACCOUNTING)}, got {self.kv_accounting!r}"
            )


@dataclass
class ContinuousResult:
    """Outputs in request order, with slot accounting and per-request completion times."""

    tokens: list[list[int]]
    finish_s: list[float]
    """Seconds from the start of the run to each request's last token."""
    decode_steps: int
    slots: int
    """Token slots computed: one per row per decode step, plus the prefill's first token per request."""
    prefills: int
    admitted_order: list[int] = field(default_factory=list)
    """Requests in the order they were admitted (a preempted one appears again when readmitted)."""
    preemptions: int = 0
    peak_kv_tokens: int = 0
    """Most KV-cache positions held at once, padding included (`EngineStats.peak_kv_tokens`)."""


def kv_budget_config(
    batch_size: int,
    max_new_tokens: int,
    prompt_lens: Sequence[int],
    *,
    refill_min: int = 4,
    row_factor: int = 4,
    accounting: str = "reserved",
) -> ContinuousConfig:
    """`cb-kv`'s limits: the KV tokens `batch_size` requests hold when each reserves the cap (at the longest
    prompt), the memory `cb` runs in, and up to `row_factor` times as many rows when reservations are
    smaller; counted as `accounting` says (`ContinuousConfig.kv_accounting`)."""
    budget = batch_size * (max_new_tokens + max(prompt_lens))
    return ContinuousConfig(batch_size * row_factor, max_new_tokens, refill_min, kv_budget=budget,
                            kv_accounting=accounting)  # fmt: skip


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


def admissions(*, free: int, waiting: int, upcoming: int, running: int, refill_min: int) -> int:
    """How many waiting requests join the batch now: none unless at least `refill_min` rows are free (or
    fewer requests are left than that, or the batch is empty); then as many as fit."""
    if waiting and free > 0 and (free >= min(refill_min, waiting + upcoming) or not running):
        return min(free, waiting)
    return 0


class Admitter:
    """Who joins the running batch, and who leaves it early, under a KV budget (S3-style reservations).

    Waiting requests come from `queue` (its policy decides the order), except requests taken out of it
    and not admitted, or preempted: they wait in `held` and go first. A request is admitted with
    `reserve[i]` answer tokens reserved (a predicted length, clipped to 1..max_new_tokens; the cap when no
    prediction is given) if its prompt plus that reservation fits what the running requests leave of
    `kv_budget`; the first row of an empty batch always runs. When a running request has generated as many
    tokens as it reserved, its reservation grows to the cap; if the reservations then overflow the
    budget, the newest requests are preempted (their tokens discarded, recomputed from scratch when
    admitted again, as vLLM's recompute preemption does, then reserving the cap) until they fit. Greedy
    outputs are unchanged.
    Units: a reservation of r counts r answer tokens, although the last token never enters the cache; the
    budget counts the cap per row the same way. So a row reaching r tokens unfinished grows to the cap even
    when it will end at token r + 1 (which prompt + r would hold): one token of slack per row, on both
    sides. Predictions are rounded down. With `kv_budget_config`'s
    extra rows, `refill_min` rarely holds admission back (free rows abound): memory decides when
    requests join, often one prompt per prefill.
    The real loop and the simulator share this object, so they decide alike.

    With `kv_accounting="padded"` the budget is checked on the cache this engine really holds
    (`padded_peak`: rows x widest row over the reservations' whole future, and the prefill's new cache
    next to the running one); the caller tells how many answer tokens each request has (`generated`: a
    preempted request may keep its tokens and be prefilled with them). The simulator sets `generated`
    too, so it decides alike.
    """

    def __init__(self, queue: RequestQueue, prompt_lens: Sequence[int], config: ContinuousConfig,
                 reserve: Sequence[float] | None = None, *,
                 generated: Callable[[int], int] = lambda i: 0):  # fmt: skip
        if reserve is not None and len(reserve) != len(prompt_lens):
            raise ValueError(f"reserve has {len(reserve)} entries for {len(prompt_lens)} prompts")
        self.queue, self.held, self.config = queue, deque(), config
        self.prompt_lens: dict[int, int] = {}
        self.initial: dict[int, int] = {}
        self.caps: dict[int, int] = {}
        for i, n in enumerate(prompt_lens):
            self.add(i, n, None if reserve is None else reserve[i])
        self.reserved: dict[int, int] = {}
        self.preemptions = 0
        self.generated = generated
        """Answer tokens request i holds so far (padded accounting); the engine and the simulator give it."""

    def add(self, i: int, prompt_len: int, reserve: float | None = None, *, cap: int | None = None) -> None:
        """Register request `i` (before it is pushed to the queue): its prompt length, the answer tokens
        it reserves (None: the cap) and its own cap (None: `config.max_new_tokens`). Requests may be added
        while others run (a server's arrivals)."""
        cap = self.config.max_new_tokens if cap is None else min(cap, self.config.max_new_tokens)
        self.prompt_lens[i], self.caps[i] = prompt_len, cap
        self.initial[i] = cap if reserve is None else min(cap, max(1, int(reserve)))

    def forget(self, i: int) -> None:
        """Request `i` is done for good (finished or cancelled): drop what is kept about it."""
        self.reserved.pop(i, None)
        self.queue.discard(i)
        for table in (self.prompt_lens, self.initial, self.caps):
            table.pop(i, None)

    def __len__(self) -> int:
        return len(self.queue) + len(self.held)

    def _left(self) -> float:
        if self.config.kv_budget is None:
            return float("inf")
        return self.config.kv_budget - sum(self.prompt_lens[i] + r for i, r in self.reserved.items())

    def admit(self, n: int, *, now: int) -> list[int]:
        """Up to `n` requests that fit the budget, in order (reserved as they are returned); `now`: the
        decode step (the queue's clock)."""
        picked, left = [], self._left()
        running = list(self.reserved)
        while len(picked) < n and len(self):
            i = self.held.popleft() if self.held else self.queue.pop(now=now)
            if i not in self.prompt_lens:
                continue  # forgotten while it waited (a cancelled request)
            need = self.prompt_lens[i] + self.initial[i]
            fits = self._fits_padded(running, [*picked, i]) if self._padded else need <= left
            if not fits and (picked or self.reserved):
                self.held.appendleft(i)
                break
            picked.append(i)
            left -= need
            self.reserved[i] = self.initial[i]
        return picked

    @property
    def _padded(self) -> bool:
        return self.config.kv_budget is not None and self.config.kv_accounting == "padded"

    def _fits_padded(self, running: Sequence[int], new: Sequence[int] = (), gen: dict | None = None) -> bool:
        """Whether `running` rows and `new` ones prefilled now stay within the budget, as really held
        (`gen`: answer tokens per request; default `generated`)."""
        gen = gen if gen is not None else {i: self.generated(i) for i in [*running, *new]}
        cached = [self.prompt_lens[i] + gen[i] - 1 for i in running]  # the newest token is not cached yet
        prefilled = [self.prompt_lens[i] + gen[i] for i in new]  # prompt (and kept tokens), then one token
        # every row runs the next decode step, even one already at its reservation: reservations grow
        # (and rows may be preempted) only after a decode step
        steps = [max(1, self.reserved[i] - gen[i]) for i in running]
        steps += [max(1, self.initial[i] - gen[i] - 1) for i in new]
        held_at_prefill = len(running) * max(cached, default=0) + len(new) * max(prefilled, default=0)
        peak = max(held_at_prefill, padded_peak(cached + prefilled, steps))
        return peak <= self.config.kv_budget

    def leave(self, i: int) -> None:
        """Request `i` finished: its reservation is freed."""
        del self.reserved[i]

    def preempt(self, running: Sequence[int], generated: Sequence[int]) -> list[int]:
        """After a decode step (`generated[k]` tokens so far for `running[k]`, oldest first): grow exhausted
        reservations to the cap, then preempt the newest requests until the reservations fit the budget.
        Returns the preempted ones; they wait first in line, in their admission order."""
        for i, g in zip(running, generated, strict=True):
            if g >= self.reserved[i]:
                self.reserved[i] = self.caps[i]
        out, left, gen = [], list(running), dict(zip(running, generated, strict=True))
        for i in reversed(running):
            fits = self._fits_padded(left, gen=gen) if self._padded else self._left() >= 0
            if fits or len(self.reserved) == 1:
                break
            left.remove(i)
            del self.reserved[i]
            self.initial[i] = self.caps[i]  # its prediction proved short: readmit at the cap
            self.held.appendleft(i)
            out.append(i)
        self.preemptions += len(out)
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


def arrival_prefill_due(
    *, arrived: int, running: int, waiting: int, max_batch_size: int, refill_min: int
) -> bool:
    """Whether the `arrived` (unprefilled) requests are prefilled now: `refill_min` of them have arrived,
    or the batch could take them now (`running` rows + `waiting` prefilled requests < `max_batch_size`)."""
    return arrived > 0 and (arrived >= refill_min or running + waiting < max_batch_size)


def arrival_groups(lengths: Sequence[int], max_rows: int) -> list[list[int]]:
    """The arrival prefill forwards: `prefill_groups` of the prompt lengths, each cut into consecutive
    pieces (in length order) of at most `max_rows` prompts. Indices into `lengths`."""
    return [g[i : i + max_rows] for g in prefill_groups(lengths) for i in range(0, len(g), max_rows)]
