"""Static scheduling policies: how an offline group of requests is cut into batches, and with what cap.

A policy returns a plan (a list of `Batch`); one executor, `run_plan`, runs it on a `BatchRunner`: the
model (`runner.ModelBatches`) or a trace's lengths on a cost-model clock (`simulator.TraceBatches`), so
their accounting cannot drift apart. FCR batches stop at their predicted cap; the rows that had not
finished by then are failures, rerun after every planned batch at the global cap (`rerun_batches`): from
scratch as in the paper, or resumed from the tokens they already generated (`PlanConfig.resume`).

`fcr+vbs` replaces the paper's hand-tuned batch-size table with a token budget: a batch may grow while
rows x (longest prompt + cap) <= `token_budget`, the KV-cache positions it reserves. The default budget
is what one FCFS batch of `batch_size` reserves at the global cap, batch_size x (longest prompt in the
group + max_new_tokens), so VBS never needs more memory than the baseline and short-predicted batches
grow in proportion to how short they are.

`fcr+vbs+bins` is the paper's whole recipe: predictions rounded up to 50-token bins, batches never mix
bins and run at their bin's top as cap; a bin's leftover rows that would fill less than half of a batch
at its size join the next bin up instead of running as a small batch (a batch's cap is its rows' highest top).

The continuous policies run the same offline group on the engine's scheduler, under the `EngineConfig` a
plan implies (`continuous_config`) with cb-kv's reservations (`reservations`): for real
(`policy_runs.run_policy`) and simulated (`simulator.simulate`) alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ecru.serve.sched.names import ENGINE_POLICY, STATIC_POLICIES
from ecru.serve.sched.scheduler import EngineConfig


@dataclass(frozen=True)
class Batch:
    """One static batch of a plan."""

    rows: tuple[int, ...]
    """Request indices, in the order they enter the batch."""
    cap: int
    """max_new_tokens for this batch."""
    rerun: bool = False
    """True for an FCR recomputation batch."""


@dataclass(frozen=True)
class PlanConfig:
    """Knobs shared by every static policy."""

    batch_size: int = 16
    """Rows per batch (fcfs, sorted, fcr, reruns); VBS's default token budget is derived from it."""
    max_new_tokens: int = 256
    """The global cap on generated tokens per request."""
    token_budget: int | None = None
    """fcr+vbs: max rows x (longest prompt + cap) per batch; None = batch_size x (longest prompt + cap)."""
    max_batch_size: int | None = None
    """fcr+vbs: an optional hard limit on rows per batch (None: only the token budget limits)."""
    bin_width: int = 50
    """fcr+vbs+bins: width of a length bin in tokens (the paper's 50)."""
    resume: bool = False
    """FCR reruns: False recomputes a failed row from scratch (the paper); True keeps the tokens it generated
    before its cap and recomputes only their KV, prefilling prompt + those tokens, then generates the rest
    (vLLM's preemption by recomputation)."""
    keep_kv: bool = False
    """With `resume`: a failed row's KV cache stays in memory (a copy on the model's device) until its rerun,
    which continues it without a prefill; the memory it holds meanwhile, its prompt plus the tokens it had,
    is beyond the batches' token budget."""

    def __post_init__(self):
        for name in ("batch_size", "max_new_tokens", "token_budget", "max_batch_size", "bin_width"):
            value = getattr(self, name)
            if value is not None and value < 1:  # None: token_budget's default, max_batch_size's no limit
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.keep_kv and not self.resume:
            raise ValueError("keep_kv keeps the KV of resumed rows: set resume=True as well")


def _chunks(order: Sequence[int], size: int) -> list[tuple[int, ...]]:
    return [tuple(order[i : i + size]) for i in range(0, len(order), size)]


def predicted_cap(rows: Sequence[int], predicted: Sequence[float], max_new_tokens: int) -> int:
    """An FCR batch's cap: its largest prediction (rounded up), never above the global cap.

    A cap of 0 (every prediction 0) is kept as such: the batch computes nothing and all its rows fail.
    """
    return max(0, min(max_new_tokens, math.ceil(max(predicted[r] for r in rows))))


def vbs_batches(order: Sequence[int], predicted, prompt_lens, config: PlanConfig) -> list[tuple[int, ...]]:
    """Greedy cut of `order` into batches whose rows x (longest prompt + cap) fits the token budget."""
    budget = config.token_budget or config.batch_size * (max(prompt_lens) + config.max_new_tokens)
    batches, rows = [], []
    for r in order:
        grown = rows + [r]
        cost = len(grown) * (
            max(prompt_lens[i] for i in grown) + predicted_cap(grown, predicted, config.max_new_tokens)
        )
        full = config.max_batch_size is not None and len(rows) >= config.max_batch_size
        if rows and (cost > budget or full):
            batches.append(tuple(rows))
            grown = [r]
        rows = grown
    return batches + ([tuple(rows)] if rows else [])


def bin_top(predicted: float, width: int, max_new_tokens: int) -> int:
    """The upper edge of a prediction's bin: rounded up to a multiple of `width`, within 1..max_new_tokens."""
    return min(max_new_tokens, max(width, width * math.ceil(predicted / width)))


def binned_batches(order: Sequence[int], predicted, prompt_lens, config: PlanConfig) -> list[Batch]:
    """VBS within bins of `config.bin_width` predicted tokens, each batch capped at its rows' highest bin top;
    small leftovers merge into the next bin."""
    tops = [bin_top(p, config.bin_width, config.max_new_tokens) for p in predicted]
    bins: dict[int, list[int]] = {}
    for r in order:
        bins.setdefault(tops[r], []).append(r)
    batches, carry = [], []
    for top in sorted(bins):
        rows = carry + bins[top]
        cut = vbs_batches(rows, {r: top for r in rows}, prompt_lens, config)
        full = len(cut[0])
        carry = list(cut.pop()) if top != max(bins) and len(cut[-1]) * 2 < full else []
        batches += [Batch(group, max(tops[r] for r in group)) for group in cut]
    return batches


def plan_batches(
    policy: str, *, predicted: Sequence[float] | None, prompt_lens: Sequence[int], config: PlanConfig
) -> list[Batch]:
    """First-attempt batches of a static policy ("oracle" is "sorted" given the true lengths)."""
    n, cap = len(prompt_lens), config.max_new_tokens
    if policy not in STATIC_POLICIES:
        raise ValueError(f"unknown static policy {policy!r}; choose one of {', '.join(STATIC_POLICIES)}")
    if policy == "fcfs":
        return [Batch(rows, cap) for rows in _chunks(range(n), config.batch_size)]
    if predicted is None or len(predicted) != n:
        raise ValueError(f"policy {policy!r} needs one predicted length per request")
    order = sorted(range(n), key=lambda i: predicted[i])  # stable: ties keep arrival order
    if policy in ("sorted", "oracle"):
        return [Batch(rows, cap) for rows in _chunks(order, config.batch_size)]
    if policy == "fcr+vbs+bins":
        return binned_batches(order, predicted, prompt_lens, config)
    groups = (
        _chunks(order, config.batch_size)
        if policy == "fcr"
        else vbs_batches(order, predicted, prompt_lens, config)
    )
    return [Batch(rows, predicted_cap(rows, predicted, cap)) for rows in groups]


def rerun_batches(
    failed: Sequence[int], *, batch_size: int, max_new_tokens: int, generated: Mapping[int, int] | None = None
) -> list[Batch]:
    """FCR recomputation: failures in the order they failed, in batches of `batch_size`, at the global cap.

    `generated` (resumed reruns, `PlanConfig.resume`): the tokens each failed row already has; a batch's cap
    is then the largest budget left to one of its rows, max_new_tokens - generated."""
    batches = _chunks(list(failed), batch_size)
    if generated is None:
        return [Batch(rows, max_new_tokens, rerun=True) for rows in batches]
    return [Batch(rows, max(max_new_tokens - generated[r] for r in rows), rerun=True) for rows in batches]


class BatchRunner(Protocol):
    """Executes the static batches of a plan: on the model (`runner.ModelBatches`) or on a cost-model clock
    with a trace's lengths (`simulator.TraceBatches`)."""

    def run(self, batch: Batch) -> set[int]:
        """Run `batch` (a rerun's rows continue from what `collect` kept of them); the rows whose answer
        ended within it (an FCR row that did not is cut at the batch's cap)."""
        ...

    def collect(self, batch: Batch, cut: list[int]) -> None:
        """The rows of `batch` not in `cut` are complete now; those in `cut` wait for their rerun, keeping
        their tokens (`PlanConfig.resume`) and KV (`PlanConfig.keep_kv`)."""
        ...


def run_plan(plan: Sequence[Batch], runner: BatchRunner, config: PlanConfig) -> list[int]:
    """Execute `plan` on `runner`, then the FCR reruns of the rows cut at a predicted cap (`rerun_batches`:
    from scratch, or resumed with `config.resume`); returns those rows (the failures) in the order they failed."""
    queue, failed, generated = list(plan), [], {}
    while queue:
        batch = queue.pop(0)
        ended = runner.run(batch)
        capped = not batch.rerun and batch.cap < config.max_new_tokens
        cut = [r for r in batch.rows if r not in ended] if capped else []
        runner.collect(batch, cut)
        failed += cut
        generated |= {r: batch.cap for r in cut}  # a cut row has its batch's cap of tokens
        if not queue and failed and not batch.rerun:
            queue = rerun_batches(failed, batch_size=config.batch_size, max_new_tokens=config.max_new_tokens,
                                  generated=generated if config.resume else None)  # fmt: skip
    return failed


def reservations(policy: str, predicted: Sequence[float] | None) -> Sequence[float] | None:
    """The answer tokens each request reserves: its predicted length under `cb-kv`, none (the cap) under
    the other continuous policies."""
    if policy != "cb-kv":
        return None
    if predicted is None or any(p is None for p in predicted):
        raise ValueError("cb-kv reserves KV memory by predicted length: give a prediction for every request")
    return predicted


def continuous_config(
    policy: str, plan: PlanConfig, prompt_lens: Sequence[int], *, refill_min: int = 4
) -> EngineConfig:
    """The `EngineConfig` of an offline run: rows of `plan.batch_size` (cb, cb-sjf, cb-ljf); for cb-kv the KV
    memory those rows hold reserving the cap at the longest prompt, counted on the cache really held."""
    return EngineConfig(ENGINE_POLICY[policy], plan.batch_size, plan.max_new_tokens, refill_min,
                        kv_prompt_tokens=max([1, *prompt_lens]))  # fmt: skip
