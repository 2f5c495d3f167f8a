"""The model runner: the scheduler's plans executed on the model (`scheduler.Runner`).

Prefill on arrival, admission (kept rows merged without a forward, the others prefilled in `prefill_groups`
with the prefix cache's hits), one decode step of the running batch (with cb-srpt's re-predictions from the
states that step computes), preemption that keeps or drops a row's KV. The running batch is
`kv_cache.RunningBatch`: one left-padded KV cache whose rows keep their own positions, so a greedy
request's tokens equal Hugging Face `generate` whatever else shares the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ecru.models.minilm import mean_pool
from ecru.serve.engine import forward, forward_states, left_pad, new_cache
from ecru.serve.kv_cache import (
    HeadroomLayer,
    KeptKV,
    PrefixHit,
    PrefixStore,
    RunningBatch,
    common_prefix,
    row_kv,
)
from ecru.serve.request import EngineStats, RemainingPredictor, Request, RequestStatus
from ecru.serve.sampling import next_token_ids, token_logprobs
from ecru.serve.scheduler import PREFILL_OVERHEAD_TOKENS, Outcome, prefill_groups

if TYPE_CHECKING:
    from ecru.serve.predictors import StatePredictor


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
        """Every layer attends to the whole context: a kept KV (prefill on arrival, cb-srpt's kept
        preemption) and the prefix cache need it."""
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
