"""The request-level serving engine: continuous batching of requests that arrive, stream and leave.

One engine, several front ends (`ecru serve run`, `ecru serve api`, the benchmarks). Each `step` is
vLLM v1's three calls: schedule (drop cancelled rows, admit waiting requests through the admission policy),
run the model (prefill the admitted prompts in one forward, then one decode step for every running row),
update (append each row's token, stream its text, finish it on EOS, a stop string or its cap). The running
batch is `continuous.RunningBatch`: one left-padded KV cache whose rows keep their own positions, so a greedy
request's tokens equal Hugging Face `generate` whatever else shares the batch.

Admission (`EngineConfig.policy`) is `continuous.Admitter` over a waiting queue: `cb` first come first
served; `cb-sjf` shortest predicted answer first, aged; `cb-kv` first come first served with KV memory
reserved by predicted length instead of the cap (more rows in the same memory; a row outgrowing its
reservation may preempt the newest rows, which keep their tokens and are re-prefilled when readmitted).
cb-kv's budget is enforced on the cache this engine really holds, rows x widest row with the left padding
(`EngineStats.peak_kv_tokens` never exceeds it; `ContinuousConfig.kv_accounting="padded"`).
The predicted length is `predict(prompt, params)`, by default the request's own `max_tokens`.

`cb-srpt` (shortest predicted remaining first) is `cb-sjf` plus re-prediction while generating: every
`repredict_every` tokens a `RemainingPredictor` (a fitted `remaining.RemainingProbe`) predicts each running
row's remaining length from the last hidden state that decode step computes anyway (a dot product per row),
and a full batch swaps its just re-predicted rows, longest remainder first, for waiting requests predicted
`preempt_margin` tokens shorter. A swapped row keeps its tokens and, by default, its KV (`KeptKV`, counted in
`peak_kv_tokens`): it rejoins without a forward; `preempt_mode="recompute"` drops the KV and prefills the
row again with its tokens. Its wait goes on from where it stopped (`SJFQueue`); rows admitted past their
FCFS deadline are never swapped.

Prefill on arrival (`state_predictor`, e.g. a fitted `ProbePredictor`; `arrival.py`): a request's prompt is
prefilled when it arrives instead of when it is admitted. That one forward gives its first token, the
prompt's mean-pooled last hidden state, from which the state predictor predicts its length (a dot product,
no forward of its own), and its KV cache, kept until admission, which then needs no forward. Arrivals are
prefilled together once `refill_min` of them wait unprefilled or the batch could take them now; at most
`arrival_kv_requests` waiting requests keep their KV (beyond, the longest-predicted one's is dropped and it
is prefilled again at admission). Not with cb-kv.
"""

from __future__ import annotations

import enum
import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from ecru.serve.arrival import KeptKV, arrival_groups, arrival_prefill_due
from ecru.serve.continuous import (
    PREFILL_OVERHEAD_TOKENS,
    Admitter,
    ContinuousConfig,
    ContinuousResult,
    RunningBatch,
    admissions,
    prefill_groups,
)
from ecru.serve.detok import Decoder, TextStream
from ecru.serve.engine import GenerationConfig, forward, forward_pooled, forward_states, left_pad, new_cache
from ecru.serve.kv_cache import HeadroomLayer, row_kv
from ecru.serve.names import ENGINE_POLICIES, PREEMPT_MODES, SJF_POLICIES
from ecru.serve.prefix_cache import PrefixHit, PrefixStore, common_prefix
from ecru.serve.queues import DEFAULT_AGING, FCFSQueue, RequestQueue, SJFQueue
from ecru.serve.sampling import SamplingParams, next_token_ids, token_logprobs

if TYPE_CHECKING:
    from ecru.serve.predictors import StatePredictor


PredictLength = Callable[[Sequence[int], SamplingParams], float]
"""A request's predicted answer length from its prompt ids and sampling (cb-sjf's and cb-srpt's queue key;
cb-kv's reservation), e.g. a fitted `EmbeddingPredictor`'s `engine_predict`."""


class RemainingPredictor(Protocol):
    """Predicts a running row's remaining answer tokens from its last hidden state [N, H] after `t` [N]
    generated tokens (`remaining.RemainingProbe`)."""

    def predict(self, states: torch.Tensor, t: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class EngineConfig:
    """Batching limits and the admission policy."""

    policy: str = "cb"
    """Admission: cb (first come first served), cb-sjf (shortest predicted first, aged), cb-srpt (cb-sjf,
    then shortest predicted remaining first: re-prediction while generating and preemption; needs a
    `RemainingPredictor`), cb-kv (KV reserved by predicted length)."""
    max_batch_size: int = 16
    """Rows decoded together at most (cb-kv: the rows whose cap-length KV memory is shared)."""
    max_new_tokens: int = 256
    """The largest max_tokens a request may ask for (and the default in the front ends)."""
    refill_min: int = 4
    """Admit only when this many rows are free (or the batch is empty, or fewer wait)."""
    aging: float = DEFAULT_AGING
    """cb-sjf, cb-srpt: priority tokens gained per decode step waited (no starvation)."""
    fcfs_slack: float | None = None
    """cb-sjf, cb-srpt: admit the longest-waiting request first once it has waited (1 + fcfs_slack) x the wait
    first-come-first-served would now impose (predicted backlog / max_batch_size decode steps;
    `queues.SJFQueue`); None: aging alone bounds the wait. With it, set aging to 0."""
    kv_prompt_tokens: int = 128
    """cb-kv: prompt tokens per row in the budget, max_batch_size x (max_new_tokens + this)."""
    kv_row_factor: int = 4
    """cb-kv: rows allowed, as a multiple of max_batch_size, when reservations are small."""
    prefix_cache: int = 16
    """Recently prefilled sequences whose KV is kept for prompts that start alike (`prefix_cache`
    module); 0 turns prefix caching off."""
    arrival_kv_requests: int = 256
    """Waiting requests whose KV is kept at most, prefilled on arrival or preempted by cb-srpt (beyond, the
    longest-predicted one's is dropped and it is prefilled again, prompt and tokens, at admission)."""
    repredict_every: int = 16
    """cb-srpt: generated tokens between re-predictions of a running row's remaining length."""
    preempt_margin: float = 64.0
    """cb-srpt: a full batch swaps a just re-predicted row for a waiting request predicted this many tokens
    shorter than the row's remainder."""
    preempt_mode: str = "keep"
    """cb-srpt: a preempted row's KV is kept while it waits (`KeptKV`, counted in `peak_kv_tokens`; it
    rejoins without a forward) or dropped and recomputed from its prompt and tokens ("recompute")."""

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
        if self.aging < 0:
            raise ValueError(f"aging must be >= 0, got {self.aging}")
        if self.fcfs_slack is not None and (self.fcfs_slack < 0 or self.policy not in SJF_POLICIES):
            raise ValueError(f"fcfs_slack must be >= 0 and needs policy cb-sjf or cb-srpt (None: off), got "
                             f"{self.fcfs_slack} with {self.policy}")  # fmt: skip
        if self.preempt_margin < 0 or self.preempt_mode not in PREEMPT_MODES:
            raise ValueError(f"preempt_margin must be >= 0 and preempt_mode one of {PREEMPT_MODES}; got "
                             f"{self.preempt_margin}, {self.preempt_mode!r}")  # fmt: skip

    def continuous(self) -> ContinuousConfig:
        """The admitter's limits."""
        if self.policy != "cb-kv":
            return ContinuousConfig(self.max_batch_size, self.max_new_tokens, self.refill_min)
        budget = self.max_batch_size * (self.max_new_tokens + self.kv_prompt_tokens)
        rows = self.max_batch_size * self.kv_row_factor
        return ContinuousConfig(rows, self.max_new_tokens, self.refill_min, kv_budget=budget,
                                kv_accounting="padded")  # fmt: skip


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
    predicted: float | None = None
    """Its predicted answer length, at most max_tokens (the key it was queued with; with prefill on
    arrival also set for a request that ended at its first token and was never queued; cb-srpt: its tokens
    so far plus its latest predicted remainder, which is its key when preempted)."""
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


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


class RequestEngine:
    """Continuous batching of requests with per-request sampling, caps, stop strings and cancellation."""

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
        self.model, self.config = model, config or EngineConfig()
        self.eos, self.pad = torch.tensor(sorted(set(eos_token_ids))), pad_token_id
        self.decode = Decoder(tokenizer) if tokenizer is not None else None
        self.context_len = context_len or getattr(model.config, "max_position_embeddings", None) or 2048
        self.predict = predict or (lambda prompt, params: float(params.max_tokens))
        self._predicted: dict[int, float] = {}
        self.remaining, self._swapped = remaining, False
        if queue is None:
            queue = self._sjf_queue() if self.config.policy in SJF_POLICIES else FCFSQueue()
        self.admitter = Admitter(queue, [], limits or self.config.continuous(),
                                 generated=lambda i: len(self.requests[i].output))  # fmt: skip
        self.discard_preempted = discard_preempted
        self.upcoming = 0
        """Requests the caller will add later: admission waits for `refill_min` of them (offline runs)."""
        self.admission_log: list[int] | None = None
        """When a list, the keys of admitted requests are appended in admission order."""
        self.run, self.stats = RunningBatch(model), EngineStats()
        full_attention = all(type(ly) is HeadroomLayer for ly in self.run.cache.layers)
        self.prefixes = (
            PrefixStore(self.config.prefix_cache) if self.config.prefix_cache and full_attention else None
        )
        self.state_predictor = state_predictor
        self._arrived: dict[int, None] = {}  # arrived, not yet prefilled (prefill on arrival), in order
        self.kept = KeptKV(self.config.arrival_kv_requests)
        if state_predictor is not None:
            self._check_arrival(predict)
        self._check_srpt(remaining, discard_preempted)
        self.requests: dict[int, Request] = {}  # unfinished, by seq
        self._ids: dict[str, int] = {}
        self._seq = itertools.count()

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
        if reserve is not None and self.state_predictor is not None:
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
        req.stream = TextStream(self.decode, params.stop) if self.decode is not None else None
        arriving = self.state_predictor is not None  # prefilled, predicted and queued by a coming step
        # predicted before the request is registered: a predictor that raises leaves no request behind
        predicted = None if arriving else self.predict(req.prompt, params) if reserve is None else reserve
        self.requests[seq], self._ids[request_id] = req, seq
        if arriving:
            self._arrived[seq] = None
        else:
            self._enqueue(req, predicted)
        return req

    def _enqueue(self, req: Request, predicted: float) -> None:
        seq = req.seq
        req.predicted = min(float(req.params.max_tokens), predicted)
        self.admitter.add(seq, len(req.prompt), req.predicted, cap=req.params.max_tokens)
        self._push(seq, req.predicted)

    def _push(self, seq: int, key: float) -> None:
        """Queue request `seq` with `key` as its predicted length (the queue reads it on push)."""
        self._predicted[seq] = key
        self.admitter.queue.push(seq, now=self.stats.decode_steps)
        del self._predicted[seq]

    def _check_arrival(self, predict) -> None:
        if predict is not None:
            raise ValueError("give either predict or state_predictor: with prefill on arrival the state "
                             "predictor predicts every length")  # fmt: skip
        if self.admitter.config.kv_budget is not None:
            raise ValueError("prefill on arrival (state_predictor) does not support a KV budget (cb-kv): "
                             "use policy cb or cb-sjf")  # fmt: skip
        if not all(type(ly) is HeadroomLayer for ly in self.run.cache.layers):
            raise ValueError("prefill on arrival (state_predictor) needs a model whose layers all attend to the "
                             "whole context (its kept KV would be cut to a sliding window)")  # fmt: skip

    def _check_srpt(self, remaining, discard_preempted: bool) -> None:
        if (remaining is None) != (self.config.policy != "cb-srpt"):
            raise ValueError("policy cb-srpt needs a remaining-length predictor (remaining=, e.g. a fitted "
                             "RemainingProbe), and only it takes one")  # fmt: skip
        if remaining is None:
            return
        if not isinstance(self.admitter.queue, SJFQueue) or self.admitter.config.kv_budget is not None:
            raise ValueError("cb-srpt preempts by priority in an SJFQueue, without a KV budget: give no queue "
                             "and no limits with a kv_budget")  # fmt: skip
        if discard_preempted:
            raise ValueError("cb-srpt's preempted rows keep their tokens: discard_preempted is for cb-kv")
        keep = self.config.preempt_mode == "keep"
        if keep and not all(type(ly) is HeadroomLayer for ly in self.run.cache.layers):
            raise ValueError("preempt_mode keep needs a model whose layers all attend to the whole context (a "
                             "kept KV would be cut to a sliding window): use preempt_mode recompute")  # fmt: skip

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Why a request cannot be served (ValueError), before it is queued."""
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        cap = self.admitter.config.max_new_tokens
        if params.max_tokens > cap:
            raise ValueError(f"max_tokens {params.max_tokens} is above this server's cap of {cap}")
        if len(prompt) + params.max_tokens > self.context_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.context_len} tokens; shorten the prompt or lower max_tokens"
            )
        limits = self.admitter.config
        if limits.kv_budget is not None and limits.kv_accounting == "padded":
            if len(prompt) + params.max_tokens > limits.kv_budget:
                raise ValueError(
                    f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the KV-cache "
                    f"budget of {limits.kv_budget} tokens; shorten the prompt or lower max_tokens"
                )
        if params.stop and self.decode is None:
            raise ValueError("stop strings need a tokenizer: give the engine one")

    def abort(self, request_id: str) -> bool:
        """Cancel a request (between steps): a waiting one never runs, a running one leaves the batch now."""
        seq = self._ids.get(request_id)
        if seq is None:
            return False
        self._finish(self.requests[seq], "abort")
        self._drop_finished_rows()
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _sjf_queue(self) -> SJFQueue:
        cfg = self.config
        return SJFQueue(self._predicted, aging=cfg.aging, fcfs_slack=cfg.fcfs_slack, rows=cfg.max_batch_size,
                        running_tokens=self._running_tokens)  # fmt: skip

    def _running_tokens(self) -> float:
        """The running rows' predicted remaining tokens (the FCFS deadline's share of the backlog)."""
        rows = (self.requests.get(i) for i in self.run.ids)  # a cancelled row leaves at the next step
        return sum(max(0.0, r.predicted - len(r.output)) for r in rows if r and r.predicted is not None)

    @property
    def num_waiting(self) -> int:
        return sum(r.status is RequestStatus.WAITING for r in self.requests.values())

    @property
    def num_running(self) -> int:
        return len(self.run.ids)

    @property
    def max_rows(self) -> int:
        return self.admitter.config.max_batch_size

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]):
        """Serve `prompts` to completion (offline use); the finished requests in input order."""
        many = params if isinstance(params, Sequence) else [params] * len(prompts)
        reqs = [self.add_request(p, s) for p, s in zip(prompts, many, strict=True)]
        while self.has_unfinished():
            self.step()
        return reqs

    # ---- one iteration: schedule, run the model, update ----------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Request]:
        """One iteration; returns the requests that finished in it."""
        finished: list[Request] = []
        self._drop_finished_rows()
        if self._arrival_due():
            self._prefill_arrivals(finished)
        admitted = self._admit_kept(self._schedule())
        if admitted:
            self._prefill(admitted, finished)
        if self.run.ids:
            self._decode(finished)
        self.stats.steps += 1
        return finished

    def _schedule(self) -> list[Request]:
        free = self.max_rows - len(self.run.ids)
        n = admissions(
            free=free,
            waiting=len(self.admitter),
            upcoming=self.upcoming,
            running=len(self.run.ids),
            refill_min=self.admitter.config.refill_min,
        )
        if self._swapped:  # rows cb-srpt freed for shorter requests are refilled at once
            n, self._swapped = min(free, len(self.admitter)), False
        keys = self.admitter.admit(n, now=self.stats.decode_steps)
        if self.admission_log is not None:
            self.admission_log += keys
        admitted = [self.requests[i] for i in keys]
        for req in admitted:
            req.status = RequestStatus.RUNNING
        return admitted

    def _arrival_due(self) -> bool:
        return arrival_prefill_due(arrived=len(self._arrived), running=len(self.run.ids),
                                   waiting=self.num_waiting - len(self._arrived), max_batch_size=self.max_rows,
                                   refill_min=self.admitter.config.refill_min)  # fmt: skip

    def _prefill_arrivals(self, finished: list[Request]) -> None:
        """Prefill on arrival: the arrived prompts (`arrival_groups`), each group in one forward
        that gives their first tokens, their KV (kept) and the state predictor's features; then queue the
        ones still running by their predicted lengths."""
        arrived = [self.requests[i] for i in self._arrived]
        self._arrived.clear()
        rows_of: dict[int, tuple] = {}  # a request still running: its prefill cache and row there
        for group in arrival_groups([len(r.prompt) for r in arrived], self.max_rows):
            rows = [arrived[i] for i in group]
            ids, mask = left_pad([r.prompt for r in rows], self.pad)
            cache = new_cache(self.model)
            logits, pooled = forward_pooled(self.model, ids, mask, cache)
            self.stats.arrival_prefill_forwards += 1
            self.stats.observe_kv(self.run.mask.numel() + self.kept.tokens + mask.numel())
            for req, p in zip(rows, self.state_predictor.predict_states(pooled), strict=True):
                req.predicted = min(float(req.params.max_tokens), p)
            running = self._update(rows, self._sample(logits, rows), finished).tolist()
            rows_of |= {req.seq: (cache, b) for b, req in enumerate(rows) if running[b]}
        for req in arrived:  # kept and queued in arrival order, whatever order the forwards took them in
            if req.seq in rows_of:  # a request that ended at its first token is never queued
                cache, b = rows_of[req.seq]
                self.kept.keep(
                    req.seq, cache, b, len(req.prompt), pending=req.output[-1], predicted=req.predicted
                )
                self._enqueue(req, req.predicted)
        self.kept.drop_over_bound()

    def _admit_kept(self, admitted: list[Request]) -> list[Request]:
        """Merge the admitted requests whose KV was kept at arrival into the batch (no forward); the others."""
        kept = [r.seq for r in admitted if r.seq in self.kept]
        if kept:
            self.run.merge(kept, *self.kept.take(self.model, kept))
        return [r for r in admitted if r.seq not in kept]

    def _prefill(self, admitted: list[Request], finished: list[Request]) -> None:
        """Prefill the admitted requests (similar lengths together, `prefill_groups`), then merge the
        ones still running into the batch in admission order. A preempted request keeps its tokens: its
        prompt and answer so far are prefilled together."""
        seqs = [r.prompt + r.output for r in admitted]
        hits = self._prefix_hits(seqs)
        fresh, order, tok, held = RunningBatch(self.model), [], [], self.run.mask.numel() + self.kept.tokens
        for group in prefill_groups([len(s) - h.length for s, h in zip(seqs, hits, strict=True)]):
            rows = [seqs[i] for i in group]
            ids, mask, cache = self._prefill_inputs(rows, [hits[i] for i in group])
            tok.append(self._sample(forward(self.model, ids, mask, cache), [admitted[i] for i in group]))
            held += mask.numel()
            self.stats.prefill_forwards += 1
            if self.prefixes is not None:
                for r, seq in enumerate(rows):
                    self.prefixes.insert(seq, row_kv(cache, r, len(seq)))
                self.stats.prefix_store_tokens = self.prefixes.tokens
            fresh.merge(group, tok[-1], mask, cache)
            order += group
        self.stats.observe_kv(held)  # the running cache and the new ones
        self.stats.prefills += 1
        back = torch.tensor(order).argsort()  # group order -> admission order
        alive = self._update(admitted, torch.cat(tok)[back], finished)
        if alive.any():
            fresh.select(back[alive])  # one copy: the live rows, in admission order
            self.run.merge([admitted[i].seq for i in fresh.ids], fresh.pending, fresh.mask, fresh.cache)

    def _prefix_hits(self, seqs: list[list[int]]) -> list[PrefixHit]:
        """Each sequence's longest stored prefix. Sequences admitted together that share a start no entry
        holds (the first requests after a start: a chat template's system prompt) get it computed once,
        in a forward of its own, when that saves more prompt positions than a forward costs."""
        if self.prefixes is None:
            return [PrefixHit()] * len(seqs)
        hits = [self.prefixes.lookup(s) for s in seqs]
        missing = [seqs[i] for i, h in enumerate(hits) if not h.length]
        if len(missing) >= 2:
            shared = min(min(common_prefix(missing[0], m) for m in missing[1:]), min(map(len, missing)) - 1)
            if shared >= self.prefixes.min_prefix and (len(missing) - 1) * shared > PREFILL_OVERHEAD_TOKENS:
                start = missing[0][:shared]
                ids, mask = left_pad([start], self.pad)
                cache = new_cache(self.model)
                forward(self.model, ids, mask, cache)
                self.stats.prefill_forwards += 1
                self.prefixes.insert(start, row_kv(cache, 0, shared))
                hits = [self.prefixes.lookup(s) for s in seqs]
        return hits

    def _prefill_inputs(self, rows: list[list[int]], hits: list[PrefixHit]):
        """`(input_ids, attention_mask, cache)` of one prefill forward: every row computes its last `new`
        tokens (the most any row must, after its cached prefix), its earlier ones come from the prefix
        cache, right-aligned after left padding."""
        new = max(len(s) - h.length for s, h in zip(rows, hits, strict=True))
        cached = [max(0, len(s) - new) for s in rows]
        ids, mask = left_pad([s[c:] for s, c in zip(rows, cached, strict=True)], self.pad)
        cache, width = new_cache(self.model), max(cached)
        if width:
            for layer in range(len(cache.layers)):
                cache.update(*self.prefixes.prefix_kv(hits, cached, layer), layer)
            before = (torch.arange(width) >= width - torch.tensor(cached)[:, None]).long()
            mask = torch.cat([before, mask], dim=1)
            self.stats.prefix_hit_tokens += sum(cached)
        return ids, mask, cache

    def _decode(self, finished: list[Request]) -> None:
        run = self.run
        rows = [self.requests[i] for i in run.ids]
        run.mask = torch.cat([run.mask, torch.ones_like(run.mask[:, :1])], dim=1)
        due = self._repredict_due(rows)
        if due:
            logits, states = forward_states(self.model, run.pending[:, None], run.mask, run.cache)
            self._repredict([rows[b] for b in due], states[due, -1])
        else:
            logits = forward(self.model, run.pending[:, None], run.mask, run.cache)
        tok = self._sample(logits, rows)
        self.stats.observe_kv(run.mask.numel() + self.kept.tokens)
        self.stats.decode_steps += 1
        alive = self._update(rows, tok, finished)
        run.pending = tok
        run.keep(alive)
        preempted = self.admitter.preempt(run.ids, [len(self.requests[i].output) for i in run.ids])
        if preempted:
            for i in preempted:
                self.requests[i].status = RequestStatus.WAITING
                if self.discard_preempted:
                    self.requests[i].output.clear()
            self.stats.preemptions += len(preempted)
            run.keep(torch.tensor([i not in preempted for i in run.ids]))
        if due:
            self._srpt_preempt([rows[b].seq for b in due if not rows[b].finished])

    # ---- cb-srpt: re-prediction while generating, preemption ---------------------------------------------
    def _repredict_due(self, rows: list[Request]) -> list[int]:
        """Batch rows whose remaining length is predicted again at this decode step: every
        `repredict_every` generated tokens (the step's state is the one that emits the next token)."""
        if self.remaining is None:
            return []
        k = self.config.repredict_every
        return [b for b, r in enumerate(rows) if r.output and len(r.output) % k == 0]

    def _repredict(self, rows: list[Request], states: torch.Tensor) -> None:
        """Each row's predicted answer length becomes its tokens so far plus its predicted remainder."""
        t = torch.tensor([len(r.output) for r in rows])
        left = self.remaining.predict(states.float(), t).tolist()
        for r, n, rem in zip(rows, t.tolist(), left, strict=True):
            r.predicted = min(float(r.params.max_tokens), n + rem)

    def _srpt_preempt(self, repredicted: list[int]) -> None:
        """A full batch swaps its just re-predicted rows, highest priority key first (predicted remainder
        less the aging it earned waiting), for waiting requests whose key is `preempt_margin` lower, one for
        one, at most `refill_min`. Rows admitted past their FCFS deadline stay, and so do rows that would be
        past it as soon as they waited again (the deadline would readmit them at once)."""
        queue, cfg = self.admitter.queue, self.config
        if len(self.run.ids) < self.max_rows or not len(queue) or not repredicted:
            return
        left = {seq: self.requests[seq].predicted - len(self.requests[seq].output) for seq in repredicted}
        key = {seq: left[seq] - cfg.aging * queue.waited(seq) for seq in repredicted}
        stay = queue.past_deadline | {s for s in repredicted if queue.would_be_overdue(queue.waited(s))}
        victims = sorted((s for s in repredicted if s not in stay), key=key.get, reverse=True)
        waiting = queue.smallest(self.admitter.config.refill_min, now=self.stats.decode_steps)
        out = [v for v, w in zip(victims, waiting, strict=False) if key[v] - w > cfg.preempt_margin]
        for seq in out:
            self._preempt(seq, left[seq])
        if out:
            self._swapped = True
            self.run.keep(torch.tensor([i not in out for i in self.run.ids]))
            self.kept.drop_over_bound()  # a dropped row is prefilled again (prompt and tokens) when admitted

    def _preempt(self, seq: int, left: float) -> None:
        """Send running request `seq` back to the queue with its predicted remainder `left` as its key,
        its KV kept (`preempt_mode` keep; its newest token is the pending one) or dropped."""
        req = self.requests[seq]
        if self.config.preempt_mode == "keep":
            row, cached = self.run.ids.index(seq), len(req.prompt) + len(req.output) - 1
            self.kept.keep(seq, self.run.cache, row, cached, pending=req.output[-1], predicted=left)
        self.admitter.leave(seq)
        req.status = RequestStatus.WAITING
        self._push(seq, left)
        self.stats.preemptions += 1

    def _sample(self, logits: torch.Tensor, rows: list[Request]) -> torch.Tensor:
        tok = next_token_ids(
            logits, [r.params for r in rows], [r.output for r in rows], [r.generator for r in rows]
        )
        for row, (req, t) in enumerate(zip(rows, tok.tolist(), strict=True)):
            if req.params.logprobs is not None:
                req.logprobs.append(token_logprobs(logits[row], t, req.params.logprobs))
        return tok

    def _update(self, rows: list[Request], tok: torch.Tensor, finished: list[Request]) -> torch.Tensor:
        """Append each row's token, stream its text, finish the rows that ended; the rows still running."""
        ended = torch.isin(tok, self.eos).tolist()
        now = time.perf_counter()
        for req, t, eos in zip(rows, tok.tolist(), ended, strict=True):
            req.output.append(t)
            req.first_token_s = req.first_token_s or now
            piece = req.stream.push(t) if req.stream is not None else ""
            req.text += piece
            reason = self._reason(req, eos=eos)
            if req.listener is not None and piece:
                req.listener(req, piece)
            if reason:
                self._finish(req, reason)
                finished.append(req)
        self.stats.tokens += len(rows)
        return torch.tensor([not r.finished for r in rows])

    def _reason(self, req: Request, *, eos: bool) -> str | None:
        if eos or (req.stream is not None and req.stream.stopped):
            return "stop"
        if len(req.output) >= req.params.max_tokens or len(req.prompt) + len(req.output) >= self.context_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        req.status, req.finish_reason, req.finish_s = RequestStatus.FINISHED, reason, time.perf_counter()
        piece = req.stream.finish() if req.stream is not None else ""
        req.text += piece
        self.admitter.forget(req.seq)
        self._arrived.pop(req.seq, None)
        self.kept.drop(req.seq)
        del self.requests[req.seq], self._ids[req.request_id]
        if req.listener is not None:
            req.listener(req, piece)

    def _drop_finished_rows(self) -> None:
        """Rows of requests cancelled since the last step leave the batch now."""
        if any(i not in self.requests for i in self.run.ids):
            self.run.keep(torch.tensor([i in self.requests for i in self.run.ids]))

    def fail_all(self, reason: str = "error") -> list[Request]:
        """End every unfinished request (the model raised): the engine starts afresh."""
        failed = list(self.requests.values())
        for req in failed:
            self._finish(req, reason)
        self.run = RunningBatch(self.model)
        return failed


def generate_continuous(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    queue: RequestQueue,
    gen: GenerationConfig,
    config: ContinuousConfig,
    arrivals: Sequence[int] | None = None,
    reserve: Sequence[float] | None = None,
) -> ContinuousResult:
    """Serve every prompt on the request engine; request i joins `queue` at decode step `arrivals[i]` (all
    at 0 by default). With `config.kv_budget`, requests reserve `reserve[i]` answer tokens (default: the
    cap; see `Admitter`); a preempted request restarts from its prompt, as the simulator models it."""
    if gen.temperature != 0:
        raise ValueError("continuous batching here is greedy only (temperature=0)")
    if reserve is not None and len(reserve) != len(prompts):
        raise ValueError(f"reserve has {len(reserve)} entries for {len(prompts)} prompts")
    # no prefix caching: the static baselines and the simulator this front end is compared with have none
    engine = RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id,
                           config=EngineConfig(prefix_cache=0), context_len=10**9, queue=queue, limits=config,
                           discard_preempted=True)  # fmt: skip
    engine.admission_log = []
    arrivals = list(arrivals) if arrivals is not None else [0] * len(prompts)
    incoming = deque(sorted(range(len(prompts)), key=lambda i: arrivals[i]))
    params, requests = SamplingParams(max_tokens=config.max_new_tokens), {}
    start = time.perf_counter()
    while incoming or engine.has_unfinished():
        step = engine.stats.decode_steps
        while incoming and arrivals[incoming[0]] <= step:
            i = incoming.popleft()
            extra = {} if reserve is None else {"reserve": reserve[i]}
            requests[i] = engine.add_request(prompts[i], params, key=i, **extra)
        engine.upcoming = len(incoming)
        engine.step()
        if (
            engine.stats.decode_steps == step
            and incoming
            and not engine.num_waiting
            and not engine.num_running
        ):
            engine.stats.decode_steps = max(step + 1, arrivals[incoming[0]])  # idle until the next arrival
    reqs = [requests[i] for i in range(len(prompts))]
    s = engine.stats
    return ContinuousResult([r.output for r in reqs], [r.finish_s - start for r in reqs], s.decode_steps,
                            s.tokens, s.prefills, engine.admission_log, s.preemptions, s.peak_kv_tokens)  # fmt: skip
