"""A per-step cost model of batched decoding, t_step(batch, context), fitted on the running machine.

Decode step: t = step_base + step_per_row * B + step_per_row_ctx * B * context.
Prefill:     t = prefill_base + prefill_per_token * B * padded_prompt_len.
A static batch of B rows, prompts padded to P, running S >= 1 steps costs one prefill (which yields the
first token) and S - 1 decode steps at contexts P + 1 .. P + S - 1; a batch of 0 steps costs nothing.

Two ways to fit it, both by non-negative least squares on the five coefficients' multipliers (`StepWork`):
`measure_cost_model` times forwards of random tokens at a grid of shapes; `fit_cost_model` takes what a
real serving run computed and how long it took, interval by interval (`record_forwards` catches each
forward's shape), so the simulator can be charged what the engine's steps really cost, overheads
included.
"""

from __future__ import annotations

import json
import math
import statistics
import timeit
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ecru.errors import EcruError
from ecru.io import atomic_write_json

if TYPE_CHECKING:  # torch only where a model is timed: the simulators import this module torch-free
    import torch


@dataclass(frozen=True)
class StepWork:
    """What some forwards computed, as the multipliers of `CostModel`'s five coefficients."""

    decode_steps: int = 0
    """Forwards computing one position per row."""
    decode_rows: int = 0
    """Rows summed over the decode steps."""
    decode_row_ctx: int = 0
    """Rows x positions attended (the padded cache width, the new position included) summed over the
    decode steps: the `context` of `CostModel.step_time`, as the simulators charge it."""
    prefills: int = 0
    """Forwards computing more than one position per row."""
    prefill_tokens: int = 0
    """Rows x padded positions summed over the prefill forwards."""

    @classmethod
    def of_forward(cls, batch: int, new: int, width: int) -> StepWork:
        """One forward of `batch` rows computing `new` positions each, `width` positions in all (cached
        ones included). One new position per row is a decode step, whatever the engine calls it (a prefill
        of a one-token prompt, or one left after a prefix-cache hit, costs what a decode step does); more
        is a prefill, charged over all `width` positions as the simulators charge one (so a cached prefix
        is priced into the fitted prefill coefficient)."""
        if new == 1:
            return cls(1, batch, batch * width)
        return cls(prefills=1, prefill_tokens=batch * width)

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass(frozen=True)
class CostModel:
    """Seconds per forward pass as a linear function of batch size and context."""

    step_base: float
    """Fixed cost of one decode step (weights streamed once per step)."""
    step_per_row: float
    """Added cost per row in a decode step."""
    step_per_row_ctx: float
    """Added cost per row per cached position (attention over the KV cache)."""
    prefill_base: float
    """Fixed cost of one prefill forward."""
    prefill_per_token: float
    """Added cost per padded prompt position at prefill."""
    source: str = "unknown"
    """Where the numbers come from (machine, model)."""

    def __post_init__(self):
        values = astuple(self)[:5]
        if not all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"cost model coefficients must be finite numbers >= 0, got {values}")
        if not isinstance(self.source, str):
            raise ValueError(f"source must be a string, got {self.source!r}")

    def step_time(self, batch: int, context: int) -> float:
        return self.step_base + self.step_per_row * batch + self.step_per_row_ctx * batch * context

    def prefill_time(self, batch: int, prompt_len: int) -> float:
        return self.prefill_base + self.prefill_per_token * batch * prompt_len

    def batch_time(self, batch: int, prompt_len: int, steps: int) -> float:
        """Prefill plus steps - 1 decode steps at contexts prompt_len + 1 .. prompt_len + steps - 1.

        A batch of 0 steps (an FCR batch capped at 0) computes nothing, not even its prefill, as in the
        real runner, which skips it.
        """
        if steps <= 0:
            return 0.0
        return self.prefill_time(batch, prompt_len) + self.decode_time(batch, prompt_len, steps - 1)

    def decode_time(self, batch: int, context: int, steps: int) -> float:
        """`steps` decode steps of `batch` rows at contexts context + 1 .. context + steps (a resumed batch
        whose KV was kept runs only these: its first step feeds each row's pending token)."""
        ctx_sum = steps * context + steps * (steps + 1) // 2
        return steps * (self.step_base + self.step_per_row * batch) + self.step_per_row_ctx * batch * ctx_sum

    def time(self, work: StepWork) -> float:
        """Seconds `work` costs."""
        return float(np.dot(astuple(self)[:5], astuple(work)))

    def scaled(self, factor: float, *, source: str | None = None) -> CostModel:
        """Every coefficient times `factor`: the same shape on a machine `factor` times slower."""
        if factor <= 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        values = [v * factor for v in astuple(self)[:5]]
        return CostModel(*values, source=source or f"{self.source} x {factor:.3g}")

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, asdict(self))

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            return cls(**json.loads(Path(path).read_text(encoding="utf-8-sig")))
        except (OSError, ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            raise EcruError(
                f"cannot read a cost model from {path} ({exc}); write one with `ecru serve cost`"
            ) from exc


# SmolLM2-135M-Instruct, fp32, 1 thread, quiet 2-core CPU (the spec's measurements).
SMOLLM2_CPU = CostModel(0.096, 0.005, 1.66e-5, 0.17, 0.004, source="SmolLM2-135M fp32, 1 CPU thread (spec)")


def _time(fn, reps: int) -> float:
    """The median seconds of `reps` calls of `fn` (the upper one of an even count)."""
    return statistics.median_high(timeit.repeat(fn, number=1, repeat=reps))


def fit_cost_model(work: Sequence[StepWork], seconds: Sequence[float], *, source: str) -> CostModel:
    """The coefficients (each >= 0) that best predict `seconds[i]` from `work[i]`, least squares."""
    from scipy.optimize import nnls

    if len(work) != len(seconds) or not work:
        raise ValueError(f"need as many timings as work items, at least one: {len(work)} vs {len(seconds)}")
    coef, _ = nnls(np.array([astuple(w) for w in work], dtype=np.float64), np.asarray(seconds, np.float64))
    return CostModel(*(float(c) for c in coef), source=source)


@contextmanager
def record_forwards(model: torch.nn.Module) -> Iterator[list[StepWork]]:
    """Within the block, every forward of `model` appends its `StepWork.of_forward` (from its `input_ids` and
    `attention_mask`) to the yielded list; call patterns are untouched."""
    seen: list[StepWork] = []

    def hook(module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        seen.append(StepWork.of_forward(ids.shape[0], ids.shape[1], mask.shape[1]))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def measure_cost_model(
    model,
    *,
    batches=(1, 4, 16),
    contexts=(32, 128, 256),
    prompt_lens=(16, 64),
    reps: int = 3,
    source: str = "",
) -> CostModel:
    """Fit the model by least squares on median timings of real forwards of `model` (random tokens)."""
    import torch

    from ecru.serve.engine.static import forward, new_cache

    with torch.no_grad():
        vocab = model.config.vocab_size
        work, seconds = [], []
        for b in batches:
            for ctx in contexts:
                cache = new_cache(model)
                mask = torch.ones(b, ctx, dtype=torch.long)
                forward(model, torch.randint(vocab, (b, ctx)), mask, cache)
                mask1 = torch.ones(b, ctx + 1, dtype=torch.long)
                tok = torch.randint(vocab, (b, 1))

                def step(cache=cache, tok=tok, mask1=mask1):
                    forward(model, tok, mask1, cache)
                    cache.crop(-1)  # drop the step just cached: every repetition runs at context ctx

                seconds.append(_time(step, reps))
                work.append(StepWork.of_forward(b, 1, ctx + 1))
            for p in prompt_lens:
                ids, mask = torch.randint(vocab, (b, p)), torch.ones(b, p, dtype=torch.long)
                seconds.append(
                    _time(lambda ids=ids, mask=mask: forward(model, ids, mask, new_cache(model)), reps)
                )
                work.append(StepWork.of_forward(b, p, p))
    return fit_cost_model(work, seconds, source=source or f"measured, {torch.get_num_threads()} thread(s)")
