"""The request-level serving engine: continuous batching of requests that arrive, stream and leave.

One engine, several front ends (`ecru serve run`, `ecru serve api`, the benchmarks). Each `step` is nano-vllm's
`LLMEngine.step`: the model-free `scheduler.Scheduler` plans (prefill on arrival, admission, one decode step,
preemption; the policies are described there) and `ModelRunner` runs each plan on the model;
the simulators drive the same scheduler with `simulator.SimulatedRunner`. `RequestEngine` is the front end:
requests (sampling, caps, stop strings, streams, cancellation) and their predicted lengths, by default each
request's own `max_tokens` (`predict`). cb-kv's budget is enforced on the cache the runner really holds
(`EngineStats.peak_kv_tokens` never exceeds it; `scheduler.Admitter`).
cb-srpt re-predicts with a `RemainingPredictor` (a fitted `remaining.RemainingProbe`) from the last hidden
state the decode step computes anyway. Prefill on arrival (`state_predictor`, e.g. a fitted
`ProbePredictor`): a request's prompt is prefilled when it arrives, its length predicted from that forward's
states and its KV kept until admission. Not with cb-kv.

`ModelRunner` (a `scheduler.Runner`): prefill on arrival, admission (kept rows merged without a forward, the
others prefilled in `prefill_groups` with the prefix cache's hits), one decode step of the running batch (with
cb-srpt's re-predictions from the states that step computes), preemption that keeps or drops a row's KV. The
running batch is `kv_cache.RunningBatch`: one left-padded KV cache whose rows keep their own positions, so a
greedy request's tokens equal Hugging Face `generate` whatever else shares the batch.
"""

from __future__ import annotations

import enum
import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from ecru.models.minilm import mean_pool
from ecru.serve.engine.detok import Decoder, TextStream
from ecru.serve.engine.kv_cache import (
    HeadroomLayer,
    KeptKV,
    PrefixHit,
    PrefixStore,
    RunningBatch,
    common_prefix,
    row_kv,
)
from ecru.serve.engine.sampling import SamplingParams, next_token_ids, token_logprobs
from ecru.serve.engine.static import context_length, forward, forward_states, left_pad, new_cache
from ecru.serve.sched.queues import RequestQueue
from ecru.serve.sched.scheduler import (
    PREFILL_OVERHEAD_TOKENS,
    EngineConfig,
    Outcome,
    Scheduler,
    Seq,
    prefill_groups,
)

if TYPE_CHECKING:
    from ecru.serve.predict.predictors import StatePredictor

__all__ = [
    "EngineConfig",
    "EngineStats",
    "Listener",
    "ModelRunner",
    "RemainingPredictor",
    "Request",
    "RequestEngine",
    "RequestStatus",
]


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
        discard_preempted: bool = False,
        state_predictor: StatePredictor | None = None,
        remaining: RemainingPredictor | None = None,
    ):
        """`queue` replaces the one `config` implies (offline measurements bring their own);
        `discard_preempted`: a preempted request restarts from its prompt (its tokens are recomputed, as
        the simulator models) instead of keeping them; only for requests that stream nothing.
        `state_predictor`: prefill on arrival, lengths predicted from the prefill's states (not `predict`).
        `remaining`: cb-srpt's re-prediction of running rows' remaining lengths (required by it, only there)."""
        if state_predictor is not None and predict is not None:
            raise ValueError("give either predict or state_predictor: with prefill on arrival the state "
                             "predictor predicts every length")  # fmt: skip
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(self.config, queue=queue, discard_preempted=discard_preempted,
                                   srpt=remaining is not None, on_arrival=state_predictor is not None)  # fmt: skip
        self.requests: dict[int, Request] = {}  # unfinished, by seq
        context_len = context_len or context_length(model)
        self.runner = ModelRunner(model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                                  context_len=context_len, prefix_cache=self.config.prefix_cache,
                                  requests=self.requests, finish=self._finish, state_predictor=state_predictor,
                                  remaining=remaining)  # fmt: skip
        self.stats = self.runner.stats
        self._check_layers()
        self.detok = Decoder(tokenizer) if tokenizer is not None else None
        self.predict = predict or (lambda prompt, params: float(params.max_tokens))
        self._ids: dict[str, int] = {}
        self._seq = itertools.count()
        self._finished: list[Request] = []

    def _check_layers(self) -> None:
        """A kept KV needs layers that keep a request's whole KV (`kv_cache.WHOLE_CONTEXT`: full and sliding-window
        attention; a chunked or linear-attention layer holds only part of it or a state): prefill on arrival and
        kept preemption need every layer to be one."""
        if self.runner.full_attention:
            return
        if self.runner.state_predictor is not None:
            raise ValueError("prefill on arrival (state_predictor) needs a model whose layers all keep their whole KV "
                             "(full or sliding-window attention; this one has chunked or linear attention)")  # fmt: skip
        if self.runner.remaining is not None and self.config.preempt_mode == "keep":
            raise ValueError("preempt_mode keep needs a model whose layers all keep their whole KV (full or sliding-"
                             "window attention; this one has chunked or linear attention): use preempt_mode "
                             "recompute")  # fmt: skip

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
        request_id = request_id if request_id is not None else f"req-{seq}"
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already running")
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
        req = Request(request_id, list(prompt), params, seq, listener)
        req.generator = None if params.greedy else torch.Generator().manual_seed(seed)
        req.stream = TextStream(self.detok, params.stop) if self.detok is not None else None
        # predicted before the request is registered (the scheduler refuses a key in use): a predictor that raises
        # leaves no request behind
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
        config = self.config
        if params.max_tokens > config.max_new_tokens:
            raise ValueError(
                f"max_tokens {params.max_tokens} is above this server's cap of {config.max_new_tokens}"
            )
        if len(prompt) + params.max_tokens > self.runner.context_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.runner.context_len} tokens; shorten the prompt or lower max_tokens"
            )
        if config.kv_budget is not None and len(prompt) + params.max_tokens > config.kv_budget:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the KV-cache "
                f"budget of {config.kv_budget} tokens; shorten the prompt or lower max_tokens"
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


class ModelRunner:
    """Runs the scheduler's plans on `model` for the front end's `requests` (by key); `finish(request,
    reason)` ends one (its stream, its listener) when its answer ends."""

    def __init__(
        self,
        model,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        context_len: int,
        prefix_cache: int,
        requests: dict[int, Request],
        finish: Callable[[Request, str], None],
        state_predictor: StatePredictor | None = None,
        remaining: RemainingPredictor | None = None,
    ):
        self.model, self.requests, self.finish = model, requests, finish
        self.eos, self.pad = torch.tensor(sorted(set(eos_token_ids))), pad_token_id
        self.context_len = context_len
        self.state_predictor, self.remaining = state_predictor, remaining
        self.run, self.stats, self.kept = RunningBatch(model), EngineStats(), KeptKV()
        self.full_attention = all(type(ly) is HeadroomLayer for ly in self.run.cache.layers)
        """Every layer keeps a request's whole KV (`kv_cache.WHOLE_CONTEXT`): a kept KV (prefill on arrival,
        cb-srpt's kept preemption) and the prefix cache need it."""
        self.prefixes = PrefixStore(prefix_cache) if prefix_cache and self.full_attention else None

    def drop(self, key: int) -> None:
        """Request `key` is cancelled: its row and its kept KV go."""
        self.kept.drop(key)
        if key in self.run.ids:
            self.run.keep(torch.tensor([i != key for i in self.run.ids]))

    def reset(self) -> None:
        """An empty batch and no kept KV (after the model raised)."""
        self.run, self.kept = RunningBatch(self.model), KeptKV()

    def prefill_arrivals(self, groups: list[list[int]]) -> Outcome:
        """Prefill on arrival: each group in one forward that gives their first tokens, their KV (kept for
        the ones still running) and the state predictor's features."""
        ended, predicted, keep = set(), {}, []
        for group in groups:
            rows = [self.requests[k] for k in group]
            ids, mask = left_pad([r.prompt for r in rows], self.pad)
            cache = new_cache(self.model)
            logits, states = forward_states(self.model, ids, mask, cache)
            pooled = mean_pool(states, mask)  # `ProbePredictor`'s features
            self.stats.arrival_prefill_forwards += 1
            self.stats.observe_kv(self.run.mask.numel() + self.kept.tokens + mask.numel())
            predicted |= dict(zip(group, self.state_predictor.predict_states(pooled), strict=True))
            running = self._update(rows, self._sample(logits, rows), ended).tolist()
            keep += [(req, cache, b) for b, req in enumerate(rows) if running[b]]
        for req, cache, b in keep:
            self.kept.keep(req.seq, cache, b, len(req.prompt), pending=req.output[-1])
        return Outcome(ended, predicted)

    def admit(self, kept: list[int], fresh: list[int]) -> Outcome:
        for key in (*kept, *fresh):
            self.requests[key].status = RequestStatus.RUNNING
        if kept:
            self.run.merge(kept, *self.kept.take(self.model, kept))
        ended: set[int] = set()
        if fresh:
            self._prefill([self.requests[k] for k in fresh], ended)
        return Outcome(ended)

    def decode(self, rows: list[int], repredict: list[int]) -> Outcome:
        run, reqs = self.run, [self.requests[i] for i in rows]
        run.mask = torch.cat([run.mask, torch.ones_like(run.mask[:, :1])], dim=1)
        predicted = {}
        if repredict:
            logits, states = forward_states(self.model, run.pending[:, None], run.mask, run.cache)
            due = [rows.index(k) for k in repredict]
            t = torch.tensor([len(reqs[b].output) for b in due])
            predicted = dict(
                zip(repredict, self.remaining.predict(states[due, -1].float(), t).tolist(), strict=True)
            )
        else:
            logits = forward(self.model, run.pending[:, None], run.mask, run.cache)
        tok = self._sample(logits, reqs)
        self.stats.observe_kv(run.mask.numel() + self.kept.tokens)
        self.stats.decode_steps += 1
        ended: set[int] = set()
        alive = self._update(reqs, tok, ended)
        run.pending = tok
        run.keep(alive)
        return Outcome(ended, predicted)

    def preempt(self, keys: list[int], *, keep_kv: bool, discard: bool) -> None:
        for key in keys:
            req = self.requests[key]
            req.status = RequestStatus.WAITING
            if keep_kv:  # its newest token is the pending one, not yet cached
                row, cached = self.run.ids.index(key), len(req.prompt) + len(req.output) - 1
                self.kept.keep(key, self.run.cache, row, cached, pending=req.output[-1])
            if discard:
                req.output.clear()
        self.stats.preemptions += len(keys)
        self.run.keep(torch.tensor([i not in keys for i in self.run.ids]))

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self.kept.drop(key)

    def _prefill(self, admitted: list[Request], ended: set[int]) -> None:
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
        alive = self._update(admitted, torch.cat(tok)[back], ended)
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

    def _sample(self, logits: torch.Tensor, rows: list[Request]) -> torch.Tensor:
        tok = next_token_ids(
            logits, [r.params for r in rows], [r.output for r in rows], [r.generator for r in rows]
        )
        for row, (req, t) in enumerate(zip(rows, tok.tolist(), strict=True)):
            if req.params.logprobs is not None:
                req.logprobs.append(token_logprobs(logits[row], t, req.params.logprobs))
        return tok

    def _update(self, rows: list[Request], tok: torch.Tensor, ended: set[int]) -> torch.Tensor:
        """Append each row's token, stream its text, finish the rows that ended (their keys go to `ended`);
        the rows still running."""
        eos = torch.isin(tok, self.eos).tolist()
        now = time.perf_counter()
        for req, t, e in zip(rows, tok.tolist(), eos, strict=True):
            req.output.append(t)
            req.first_token_s = req.first_token_s or now
            piece = req.stream.push(t) if req.stream is not None else ""
            req.text += piece
            reason = self._reason(req, eos=e)
            if req.listener is not None and piece:
                req.listener(req, piece)
            if reason:
                ended.add(req.seq)
                self.finish(req, reason)
        self.stats.tokens += len(rows)
        return torch.tensor([not r.finished for r in rows])

    def _reason(self, req: Request, *, eos: bool) -> str | None:
        if eos or (req.stream is not None and req.stream.stopped):
            return "stop"
        if len(req.output) >= req.params.max_tokens or len(req.prompt) + len(req.output) >= self.context_len:
            return "length"
        return None
