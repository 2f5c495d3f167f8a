"""One served request's state, the engine's counters and the protocols of its collaborators."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ecru.serve.detok import TextStream
from ecru.serve.sampling import SamplingParams
from ecru.serve.scheduler import Seq


class RemainingPredictor(Protocol):
    """Predicts a running row's remaining answer tokens from its last hidden state [N, H] after `t` [N]
    generated tokens (`remaining.RemainingProbe`)."""

    def predict(self, states: torch.Tensor, t: torch.Tensor) -> torch.Tensor: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Listener(Protocol):
    """Called after each token a request generates (with the text it released) and once when it ends."""

    def __call__(self, request: Request, piece: str) -> None: ...


@dataclass(eq=False)
class Request:
    """One request's state; `text` is what its stream released (the answer once finished)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seq: int
    listener: Listener | None = None
    stream: TextStream | None = None
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    """With `params.logprobs` set: per output token, its log-probability and the most likely (id, logprob)."""
    text: str = ""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    """stop (EOS or a stop string), length (max_tokens or the context), abort, error."""
    state: Seq | None = None
    """The scheduler's view of it."""
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def predicted(self) -> float | None:
        """Its predicted answer length, at most max_tokens (the key it was queued with; with prefill on
        arrival also set for a request that ended at its first token and was never queued; cb-srpt: its
        tokens so far plus its latest predicted remainder)."""
        return None if self.state is None else self.state.predicted


@dataclass
class EngineStats:
    """Counters since the engine started."""

    steps: int = 0
    decode_steps: int = 0
    prefills: int = 0
    """Admissions prefilled (each in one or more forwards)."""
    prefill_forwards: int = 0
    """Admission prefill forwards: prompts of very different lengths admitted together go in separate
    ones (with prefill on arrival, only requests whose kept KV was dropped are prefilled at admission)."""
    arrival_prefill_forwards: int = 0
    """Prefill-on-arrival forwards (prompts, first tokens and the state predictor's features)."""
    tokens: int = 0
    """Token slots computed: one per admitted request per prefill, one per running row per decode step."""
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    """Prompt positions not recomputed at prefill: their keys and values came from the prefix cache."""
    prefix_store_tokens: int = 0
    """KV positions the prefix cache holds now (at most `EngineConfig.prefix_cache` sequences), memory
    beside `peak_kv_tokens`."""
    peak_kv_tokens: int = 0
    """Most KV-cache positions held at once (rows x cache width, left padding included, plus the KV kept
    for waiting requests): the memory the engine really used, which a policy's reservations may
    understate."""

    def observe_kv(self, tokens: int) -> None:
        self.peak_kv_tokens = max(self.peak_kv_tokens, tokens)
