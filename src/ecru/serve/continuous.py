"""Iteration-level (continuous) batching with static-batch efficiency: finished rows are refilled.

The running batch is one left-padded KV cache. When rows finish they leave the batch at once (their
cache rows are dropped); when enough rows are free, waiting requests are admitted: their prompts are
prefilled together in a fresh cache, which is left-padded to the running cache's width (or the other way
round) and concatenated on the batch axis. Every row keeps its own positions (from its attention mask),
so outputs equal unbatched generation; columns that are padding in every row are trimmed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ecru.serve.engine import GenerationConfig, forward, left_pad, new_cache, next_tokens
from ecru.serve.queues import RequestQueue


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

    def __post_init__(self):
        if min(self.max_batch_size, self.max_new_tokens, self.refill_min) < 1:
            raise ValueError("max_batch_size, max_new_tokens and refill_min must all be >= 1")


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


def admissions(*, free: int, waiting: int, upcoming: int, running: int, refill_min: int) -> int:
    """How many waiting requests join the batch now: none unless at least `refill_min` rows are free (or
    fewer requests are left than that, or the batch is empty); then as many as fit."""
    if waiting and free > 0 and (free >= min(refill_min, waiting + upcoming) or not running):
        return min(free, waiting)
    return 0


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero-pad `t` on the left of dimension `dim` (-1 or -2) up to `width`."""
    return F.pad(t, (0, 0) * (-dim - 1) + (width - t.shape[dim], 0))


class _Running:
    """The running batch: request ids, pending (not yet cached) tokens, attention mask, KV cache."""

    def __init__(self, model):
        self.ids: list[int] = []
        self.pending = torch.empty(0, dtype=torch.long)
        self.mask = torch.empty(0, 0, dtype=torch.long)
        self.cache = new_cache(model)

    def merge(self, ids: list[int], pending: torch.Tensor, mask: torch.Tensor, cache) -> None:
        if not self.ids:
            self.ids, self.pending, self.mask, self.cache = ids, pending, mask, cache
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width, -2), _pad_left(new.keys, width, -2)])
            old.values = torch.cat([_pad_left(old.values, width, -2), _pad_left(new.values, width, -2)])
        self.mask = torch.cat([_pad_left(self.mask, width, -1), _pad_left(mask, width, -1)])
        self.ids, self.pending = self.ids + ids, torch.cat([self.pending, pending])

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (a bool mask), then drop cache columns that are padding in every row.

        Nothing is copied when every row stays: re-indexing would copy the whole KV cache at every
        decode step, a cost of the order of the step's own attention.
        """
        if bool(rows.all()):
            return
        index = rows.nonzero().flatten()
        self.ids = [self.ids[i] for i in index.tolist()]
        self.pending, self.mask = self.pending[index], self.mask[index]
        if not self.ids:
            return
        first = int(self.mask.any(0).nonzero()[0])
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index, :, first:], layer.values[index, :, first:]


@torch.no_grad()
def generate_continuous(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    queue: RequestQueue,
    gen: GenerationConfig,
    config: ContinuousConfig,
    arrivals: Sequence[int] | None = None,
) -> ContinuousResult:
    """Serve every prompt; request i joins `queue` at decode step `arrivals[i]` (all at 0 by default)."""
    if gen.temperature != 0:
        raise ValueError("continuous batching here is greedy only (temperature=0)")
    n = len(prompts)
    arrivals = list(arrivals) if arrivals is not None else [0] * n
    incoming = sorted(range(n), key=lambda i: arrivals[i])
    eos = torch.tensor(gen.eos_token_ids)
    out: list[list[int]] = [[] for _ in range(n)]
    finish = [0.0] * n
    run, step, slots, prefills, order, start = _Running(model), 0, 0, 0, [], time.perf_counter()

    def record(ids: list[int], tok: torch.Tensor) -> torch.Tensor:
        for i, t in zip(ids, tok.tolist(), strict=True):
            out[i].append(t)
        alive = ~torch.isin(tok, eos) & torch.tensor([len(out[i]) < config.max_new_tokens for i in ids])
        now = time.perf_counter() - start
        for i, a in zip(ids, alive.tolist(), strict=True):
            if not a:
                finish[i] = now
        return alive

    while incoming or len(queue) or run.ids:
        while incoming and arrivals[incoming[0]] <= step:
            queue.push(incoming.pop(0), now=step)
        n_admit = admissions(
            free=config.max_batch_size - len(run.ids),
            waiting=len(queue),
            upcoming=len(incoming),
            running=len(run.ids),
            refill_min=config.refill_min,
        )
        if n_admit:
            admit = [queue.pop() for _ in range(n_admit)]
            order += admit
            ids, mask = left_pad([prompts[i] for i in admit], gen.pad_token_id)
            cache = new_cache(model)
            tok = next_tokens(forward(model, ids, mask, cache), temperature=0.0, generator=None)
            prefills, slots = prefills + 1, slots + len(admit)
            alive = record(admit, tok)
            if alive.any():
                index = alive.nonzero().flatten()
                cache.batch_select_indices(index)
                run.merge([admit[i] for i in index.tolist()], tok[index], mask[index], cache)
        if not run.ids:
            if incoming and not len(queue):
                step = max(step + 1, arrivals[incoming[0]])
            continue
        run.mask = torch.cat([run.mask, torch.ones_like(run.mask[:, :1])], dim=1)
        tok = next_tokens(
            forward(model, run.pending[:, None], run.mask, run.cache), temperature=0.0, generator=None
        )
        slots += len(run.ids)
        alive = record(run.ids, tok)
        run.pending = tok
        run.keep(alive)
        step += 1
    return ContinuousResult(out, finish, step, slots, prefills, order)
