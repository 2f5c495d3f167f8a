"""The request-level serving engine: continuous batching of requests that arrive, stream and leave.

One engine, several front ends (`ecru serve run`, `ecru serve api`, the benchmarks). Each `step` is nano-vllm's
`LLMEngine.step`: the model-free `scheduler.Scheduler` plans (prefill on arrival, admission, one decode step,
preemption; the policies are described there) and `model_runner.ModelRunner` runs each plan on the model;
the simulators drive the same scheduler with `simulator.SimulatedRunner`. `RequestEngine` is the front end:
requests (sampling, caps, stop strings, streams, cancellation) and their predicted lengths, by default each
request's own `max_tokens` (`predict`). cb-kv's budget is enforced on the cache the runner really holds
(`EngineStats.peak_kv_tokens` never exceeds it; `ContinuousConfig.kv_accounting="padded"`).
cb-srpt re-predicts with a `RemainingPredictor` (a fitted `remaining.RemainingProbe`) from the last hidden
state the decode step computes anyway. Prefill on arrival (`state_predictor`, e.g. a fitted
`ProbePredictor`): a request's prompt is prefilled when it arrives, its length predicted from that forward's
states and its KV kept until admission. Not with cb-kv.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ecru.serve.detok import Decoder, TextStream
from ecru.serve.model_runner import ModelRunner
from ecru.serve.queues import RequestQueue
from ecru.serve.request import EngineStats, Listener, RemainingPredictor, Request, RequestStatus
from ecru.serve.sampling import SamplingParams
from ecru.serve.scheduler import ContinuousConfig, EngineConfig, Scheduler

if TYPE_CHECKING:
    from ecru.serve.predictors import StatePredictor

__all__ = [
    "EngineConfig",
    "EngineStats",
    "Listener",
    "RemainingPredictor",
    "Request",
    "RequestEngine",
    "RequestStatus",
]

PredictLength = Callable[[Sequence[int], SamplingParams], float]
"""A request's predicted answer length from its prompt ids and sampling (cb-sjf's and cb-srpt's queue key;
cb-kv's reservation), e.g. a fitted `EmbeddingPredictor`'s `engine_predict`."""


class RequestEngine:
    """Continuous batching of requests with per-request sampling, caps, stop strings and cancellation: one
    `Scheduler` and one `ModelRunner`."""

    def __init__(
        self,
        model,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        config: EngineConfig | None = None,
        tokenizer=None,
        context_len: int | None = None,
        predict: PredictLength | None = None,
        queue: RequestQueue | None = None,
        limits: ContinuousConfig | None = None,
        discard_preempted: bool = False,
        state_predictor: StatePredictor | None = None,
        remaining: RemainingPredictor | None = None,
    ):
        """`queue` and `limits` replace the ones `config` implies (offline measurements bring their own);
        `discard_preempted`: a preempted request restarts from its prompt (its tokens are recomputed, as
        the simulator models) instead of keeping them; only for requests that stream nothing.
        `state_predictor`: prefill on arrival, lengths predicted from the prefill's states (not `predict`).
        `remaining`: cb-srpt's re-prediction of running rows' remaining lengths (required by it, only there)."""
        if state_predictor is not None and predict is not None:
            raise ValueError("give either predict or state_predictor: with prefill on arrival the state "
                             "predictor predicts every length")  # fmt: skip
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(self.config, queue=queue, limits=limits, discard_preempted=discard_preempted,
                                   srpt=remaining is not None, on_arrival=state_predictor is not None)  # fmt: skip
        self.requests: dict[int, Request] = {}  # unfinished, by seq
        context_len = context_len or getattr(model.config, "max_position_embeddings", None) or 2048
        self.runner = ModelRunner(model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                                  context_len=context_len, prefix_cache=self.config.prefix_cache,
                                  requests=self.requests, finish=self._finish, state_predictor=state_predictor,
                                  remaining=remaining)  # fmt: skip
        self._check_layers()
        self.detok = Decoder(tokenizer) if tokenizer is not None else None
        self.predict = predict or (lambda prompt, params: float(params.max_tokens))
        self._ids: dict[str, int] = {}
        self._seq = itertools.count()
        self._finished: list[Request] = []

    def _check_layers(self) -> None:
        """A kept KV would be cut to a sliding window: prefill on arrival and kept preemption need every layer
        to attend to the whole context."""
        if self.runner.full_attention:
            return
        if self.runner.state_predictor is not None:
            raise ValueError("prefill on arrival (state_predictor) needs a model whose layers all attend to the "
                             "whole context (its kept KV would be cut to a sliding window)")  # fmt: skip
        if self.runner.remaining is not None and self.config.preempt_mode == "keep":
            raise ValueError("preempt_mode keep needs a model whose layers all attend to the whole context (a "
                             "kept KV would be cut to a sliding window): use preempt_mode recompute")  # fmt: skip

    @property
    def stats(self) -> EngineStats:
        return self.runner.stats

    # ---- front-end API -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        listener: Listener | None = None,
        key: int | None = None,
        reserve: float | None = None,
    ) -> Request:
        """Queue a request; raises ValueError when it cannot be served (checked before it waits).
        `key`: its key in the queue (offline runs pass the request's index, which their queue's
        predictions are indexed by; default: a counter). `reserve`: cb-kv answer tokens it reserves
        (default: `predict`, at most max_tokens)."""
        self.check(prompt, params)
        if reserve is not None and self.runner.state_predictor is not None:
            raise ValueError("reserve is a cb-kv reservation: not with prefill on arrival (state_predictor)")
        seq = next(self._seq) if key is None else key
        if seq in self.requests:
            raise ValueError(f"request key {seq} is already in use")
        request_id = request_id if request_id is not None else f"req-{seq}"
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already running")
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
        req = Request(request_id, list(prompt), params, seq, listener)
        req.generator = None if params.greedy else torch.Generator().manual_seed(seed)
        req.stream = TextStream(self.detok, params.stop) if self.detok is not None else None
        # predicted before the request is registered: a predictor that raises leaves no request behind
        predicted = None
        if self.runner.state_predictor is None:  # with it: prefilled, predicted and queued by a coming step
            predicted = self.predict(req.prompt, params) if reserve is None else reserve
        req.state = self.scheduler.add(seq, len(req.prompt), params.max_tokens, predicted)
        self.requests[seq], self._ids[request_id] = req, seq
        return req

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Why a request cannot be served (ValueError), before it is queued."""
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        limits = self.scheduler.limits
        if params.max_tokens > limits.max_new_tokens:
            raise ValueError(
                f"max_tokens {params.max_tokens} is above this server's cap of {limits.max_new_tokens}"
            )
        if len(prompt) + params.max_tokens > self.runner.context_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.runner.context_len} tokens; shorten the prompt or lower max_tokens"
            )
        if limits.kv_budget is not None and limits.kv_accounting == "padded":
            if len(prompt) + params.max_tokens > limits.kv_budget:
                raise ValueError(
                    f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the KV-cache "
                    f"budget of {limits.kv_budget} tokens; shorten the prompt or lower max_tokens"
                )
        if params.stop and self.detok is None:
            raise ValueError("stop strings need a tokenizer: give the engine one")

    def abort(self, request_id: str) -> bool:
        """Cancel a request (between steps): a waiting one never runs, a running one leaves the batch now."""
        seq = self._ids.get(request_id)
        if seq is None:
            return False
        self._drop(seq)
        self._finish(self.requests[seq], "abort")
        return True

    def _drop(self, seq: int) -> None:
        """Forget request `seq` in the scheduler and the runner."""
        self.scheduler.finish(seq)
        self.runner.drop(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return len(self.runner.run.ids)

    @property
    def max_rows(self) -> int:
        return self.scheduler.max_rows

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]):
        """Serve `prompts` to completion (offline use); the finished requests in input order."""
        many = params if isinstance(params, Sequence) else [params] * len(prompts)
        reqs = [self.add_request(p, s) for p, s in zip(prompts, many, strict=True)]
        while self.has_unfinished():
            self.step()
        return reqs

    @torch.no_grad()
    def step(self) -> list[Request]:
        """One iteration (the scheduler's plan, run on the model); returns the requests that finished in it."""
        self._finished = []
        self.scheduler.step(self.runner)
        self.stats.steps += 1
        return self._finished

    def _finish(self, req: Request, reason: str) -> None:
        """The request side of its end (the scheduler forgets it itself, or `_drop` tells it)."""
        req.status, req.finish_reason, req.finish_s = RequestStatus.FINISHED, reason, time.perf_counter()
        piece = req.stream.finish() if req.stream is not None else ""
        req.text += piece
        del self.requests[req.seq], self._ids[req.request_id]
        self._finished.append(req)
        if req.listener is not None:
            req.listener(req, piece)

    def fail_all(self, reason: str = "error") -> list[Request]:
        """End every unfinished request (the model raised): the engine starts afresh."""
        failed = list(self.requests.values())
        for req in failed:
            self._drop(req.seq)
            self._finish(req, reason)
        self.runner.reset()
        return failed
