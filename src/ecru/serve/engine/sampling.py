"""Per-request sampling: `SamplingParams` (validated on construction) and the next-token maths.

Greedy rows take the argmax of the raw logits, exactly as Hugging Face `generate` does, so a greedy
request's output does not depend on what else is in the batch. Sampled rows apply, in this order, OpenAI's
presence/frequency penalties, the temperature, top-k and top-p (Hugging Face's own logits warpers), then
draw from their own seeded generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded and when it ends."""

    max_tokens: int = 256
    """Cap on generated tokens (EOS included)."""
    temperature: float = 0.0
    """0: greedy (argmax); > 0 samples from softmax(logits / temperature). OpenAI's range, 0..2."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1: off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: off)."""
    seed: int | None = None
    """Seed of this request's sampling generator (None: a fresh random seed)."""
    stop: tuple[str, ...] = ()
    """Strings that end the answer; the answer's text stops before the first one found."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated (OpenAI, -2..2)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated (OpenAI, -2..2)."""

    logprobs: int | None = None
    """None: no log-probabilities; k >= 0: each sampled token's log-probability under the model's raw
    logits (log-softmax, before penalties and temperature) and the k most likely tokens' (k <= 20)."""

    def __post_init__(self):
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be a number in [0, 2], got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(self.stop)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """Greedy without penalties: the argmax of the raw logits."""
        return self.greedy and self.presence_penalty == 0 and self.frequency_penalty == 0


def penalize(
    logits: torch.Tensor, output: Sequence[int], *, presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's penalties on one row of logits [V]: logit[t] -= presence * (count[t] > 0) + frequency * count[t]."""
    if not output or (presence == 0 and frequency == 0):
        return logits
    counts = torch.bincount(torch.as_tensor(list(output)), minlength=logits.shape[-1])[: logits.shape[-1]]
    counts = counts.to(logits.dtype)
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def sample_row(
    logits: torch.Tensor, params: SamplingParams, output: Sequence[int], generator: torch.Generator | None
) -> int:
    """The next token of one request from its logits [V] and the tokens it generated so far."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = penalize(
        logits.float(), output, presence=params.presence_penalty, frequency=params.frequency_penalty
    )
    if params.greedy:
        return int(scores.argmax())
    scores = (scores / params.temperature)[None]
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def next_token_ids(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Next token per row of `logits` [B, V]; all-plain batches take one batched argmax."""
    if all(p.plain for p in params):
        return logits.argmax(-1)
    rows = zip(logits, params, outputs, generators, strict=True)
    return torch.tensor([sample_row(lg, p, o, g) for lg, p, o, g in rows], dtype=torch.long)


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-softmax of one row of raw logits [V] at `token`, and the `top` most likely (id, logprob)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(top)  # top 0: empty
    return float(logp[token]), [
        (int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)
    ]
