"""The request-level serving engine: continuous batching of requests that arrive, stream and leave.

One engine, several front ends (`ecru serve run`, `ecru serve api`, the benchmarks). `RequestEngine` is the
front end (requests, sampling, streams, cancellation) and the model runner of the model-free
`scheduler.Scheduler`, which plans each step (prefill on arrival, admission, one decode step, preemption;
see there for the policies); the simulators drive the same scheduler with `sim_runner.SimulatedRunner`.
The running batch is `kv_cache.RunningBatch`: one left-padded KV cache whose rows keep their own
positions, so a greedy request's tokens equal Hugging Face `generate` whatever else shares the batch.
cb-kv's budget is enforced on the cache this engine really holds, rows x widest row with the left padding
(`EngineStats.peak_kv_tokens` never exceeds it; `ContinuousConfig.kv_accounting="padded"`).
The predicted length is `predict(prompt, params)`, by default the request's own `max_tokens`.

cb-srpt re-predicts with a `RemainingPredictor` (a fitted `remaining.RemainingProbe`) from the last hidden
state the decode step computes anyway (a dot product per row). A swapped row keeps its tokens and, by
default, its KV (`arrival.KeptKV`, counted in `peak_kv_tokens`): it rejoins without a forward.
Prefill on arrival (`state_predictor`, e.g. a fitted `ProbePredictor`): a request's prompt is prefilled when
it arrives; that forward gives its first token, the prompt's mean-pooled last hidden state (from which the
state predictor predicts its length, a dot product) and its KV, kept until admission. Not with cb-kv.
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

from ecru.serve.arrival import KeptKV
from ecru.serve.continuous import PREFILL_OVERHEAD_TOKENS, ContinuousConfig, ContinuousResult, prefill_groups
from ecru.serve.detok import Decoder, TextStream
from ecru.serve.engine import GenerationConfig, forward, forward_pooled, forward_states, left_pad, new_cache
from ecru.serve.kv_cache import HeadroomLayer, RunningBatch, row_kv
from ecru.serve.prefix_cache import PrefixHit, PrefixStore, common_prefix
from ecru.serve.queues import RequestQueue
from ecru.serve.sampling import SamplingParams, next_token_ids, token_logprobs
from ecru.serve.scheduler import EngineConfig, Outcome, Scheduler, Seq, run_in_steps

if TYPE_CHECKING:
    from ecru.serve.predictors import StatePredictor

__all__ = ["EngineConfig", "EngineStats", "Request", "RequestEngine", "generate_continuous"]

PredictLength = Callable[[Sequence[int], SamplingParams], float]
"""A request's predicted answer length from its prompt ids and sampling (cb-sjf's and cb-srpt's queue key;
cb-kv's reservation), e.g. a fitted `EmbeddingPredictor`'s `engine_predict`."""


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


class RequestEngine:
    """Continuous batching of requests with per-request sampling, caps, stop strings and cancellation: the
    front end (requests, streams) and the model runner (`scheduler.Runner`) of one `Scheduler`."""

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
        self.model, self.config = model, config or EngineConfig()
        self.scheduler = Scheduler(self.config, queue=queue, limits=limits, discard_preempted=discard_preempted,
                                   srpt=remaining is not None, on_arrival=state_predictor is not None)  # fmt: skip
        self.eos, self.pad = torch.tensor(sorted(set(eos_token_ids))), pad_token_id
        self.detok = Decoder(tokenizer) if tokenizer is not None else None
        self.context_len = context_len or getattr(model.config, "max_position_embeddings", None) or 2048
        self.predict = predict or (lambda prompt, params: float(params.max_tokens))
        self.state_predictor, self.remaining = state_predictor, remaining
        self.run, self.stats, self.kept = RunningBatch(model), EngineStats(), KeptKV()
        full_attention = all(type(ly) is HeadroomLayer for ly in self.run.cache.layers)
        self._check_layers(full_attention)
        self.prefixes = (
            PrefixStore(self.config.prefix_cache) if self.config.prefix_cache and full_attention else None
        )
        self.requests: dict[int, Request] = {}  # unfinished, by seq
        self._ids: dict[str, int] = {}
        self._seq = itertools.count()
        self._finished: list[Request] = []

    def _check_layers(self, full_attention: bool) -> None:
        """A kept KV would be cut to a sliding window: prefill on arrival and kept preemption need every layer
        to attend to the whole context."""
        if full_attention:
            return
        if self.state_predictor is not None:
            raise ValueError("prefill on arrival (state_predictor) needs a model whose layers all attend to the "
                             "whole context (its kept KV would be cut to a sliding window)")  # fmt: skip
        if self.remaining is not None and self.config.preempt_mode == "keep":
            raise ValueError("preempt_mode keep needs a model whose layers all attend to the whole context (a "
                             "kept KV would be cut to a sliding window): use preempt_mode recompute")  # fmt: skip

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
        req.stream = TextStream(self.detok, params.stop) if self.detok is not None else None
        # predicted before the request is registered: a predictor that raises leaves no request behind
        predicted = None
        if self.state_predictor is None:  # with it: prefilled, predicted and queued by a coming step
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
        if len(prompt) + params.max_tokens > self.context_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.context_len} tokens; shorten the prompt or lower max_tokens"
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
        """Forget request `seq` in the scheduler, its row and its kept KV."""
        self.scheduler.finish(seq)
        self.kept.drop(seq)
        if seq in self.run.ids:
            self.run.keep(torch.tensor([i != seq for i in self.run.ids]))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def admitter(self):
        return self.scheduler.admitter

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return len(self.run.ids)

    @property
    def max_rows(self) -> int:
        return self.scheduler.max_rows

    @property
    def admission_log(self) -> list[int] | None:
        """When a list, the keys of admitted requests are appended in admission order."""
        return self.scheduler.admission_log

    @admission_log.setter
    def admission_log(self, log: list[int] | None) -> None:
        self.scheduler.admission_log = log

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
        self.scheduler.step(self)
        self.stats.steps += 1
        return self._finished

    # ---- the model runner: the scheduler's plans on the model -------------------------------------------
    def prefill_arrivals(self, groups: list[list[int]]) -> Outcome:
        """Prefill on arrival: each group in one forward that gives their first tokens, their KV (kept for
        the ones still running) and the state predictor's features."""
        ended, predicted, keep = set(), {}, []
        for group in groups:
            rows = [self.requests[k] for k in group]
            ids, mask = left_pad([r.prompt for r in rows], self.pad)
            cache = new_cache(self.model)
            logits, pooled = forward_pooled(self.model, ids, mask, cache)
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
                self._finish(req, reason)
        self.stats.tokens += len(rows)
        return torch.tensor([not r.finished for r in rows])

    def _reason(self, req: Request, *, eos: bool) -> str | None:
        if eos or (req.stream is not None and req.stream.stopped):
            return "stop"
        if len(req.output) >= req.params.max_tokens or len(req.prompt) + len(req.output) >= self.context_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        """The request side of an end (the scheduler forgets it itself, or `_drop` tells it)."""
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
        self.run, self.kept = RunningBatch(self.model), KeptKV()
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
    params, requests = SamplingParams(max_tokens=config.max_new_tokens), {}

    def add(i: int) -> None:
        requests[i] = engine.add_request(
            prompts[i], params, key=i, reserve=None if reserve is None else reserve[i]
        )

    start = time.perf_counter()
    run_in_steps(engine.scheduler, [0] * len(prompts) if arrivals is None else arrivals, add, engine.step)
    reqs = [requests[i] for i in range(len(prompts))]
    s = engine.stats
    return ContinuousResult([r.output for r in reqs], [r.finish_s - start for r in reqs], engine.scheduler.steps,
                            s.tokens, s.prefills, engine.admission_log, s.preemptions, s.peak_kv_tokens)  # fmt: skip
