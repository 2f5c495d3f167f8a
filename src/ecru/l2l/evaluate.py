"""`L2L.forward`: evaluation layer by layer, as the training step streams the model, without autograd.

It executes the forward phase of a training step's plan (ecru.l2l.plan): each block's weights are
loaded once and run over every micro-batch (the disk tier reads them and drops them again), so a model
larger than memory can be evaluated too. The model is in eval mode meanwhile (no dropout); weights,
optimizer states, the step count and the random stream are untouched.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ecru.l2l.parts import ForwardOutput, MicroBatch
from ecru.l2l.plan import RESIDENT, Begin, Evict, Fetch, Forward, PlanConfig, Prefetch, StemForward, step_plan

if TYPE_CHECKING:
    from ecru.l2l.engine import L2L


def forward(engine: L2L, batch: Any, *, order: list[int]) -> ForwardOutput:
    engine.store.synchronize()
    micro = [mb.to(engine.device, engine.config.dtype) for mb in _split(engine, batch)]
    modes = {m: m.training for m in engine.model.modules()}
    engine.model.eval()
    try:
        hidden = _through_blocks(engine, micro, order)
        return _head(engine, hidden, micro)
    finally:
        for m, training in modes.items():
            m.training = training


def _split(engine: L2L, batch: Any) -> list[MicroBatch]:
    """The engine's split; an HF batch without labels gets all-ignored labels (logits only)."""
    if engine.parts.kind == "hf" and isinstance(batch, dict) and batch.get("labels") is None:
        batch = {**batch, "labels": torch.full_like(batch["input_ids"], -100)}
    return engine.parts.split(batch, engine.config.micro_batch_size)


def _through_blocks(engine: L2L, micro: list[MicroBatch], order: list[int]) -> list[torch.Tensor]:
    """The forward phase of a step's plan (same fetches, prefetches and evictions), without stashing."""
    config = PlanConfig(blocks=tuple(order), micro_batches=len(micro), prefetch=engine.config.prefetch)
    weights: dict[int, list[torch.Tensor]] = {}
    hidden, contexts = [None] * len(micro), [None] * len(micro)
    for op in step_plan(config).phases[0].ops:
        match op:
            case Begin(phase=phase, groups=groups):
                engine.store.begin(phase, list(groups))
            case Fetch(group=g):
                weights[g] = engine.store.weights(g)
            case Prefetch(group=g):
                engine.store.prefetch(g)
            case Evict(group=g):
                engine.store.done_with(g)
                del weights[g]
            case StemForward(micro=j):
                hidden[j], contexts[j] = engine.run_stem(weights[RESIDENT], micro[j].inputs)
            case Forward(block=i, micro=j):
                hidden[j] = engine.run_block(i, weights[i + 1], hidden[j], contexts[j])
    return hidden


def _head(engine: L2L, hidden: list[torch.Tensor], micro: list[MicroBatch]) -> ForwardOutput:
    weights = engine.store.weights(RESIDENT)
    count = engine.parts.count(micro) if engine.parts.count is not None else 1.0
    loss = None
    if count:
        loss = sum(float(engine.run_head(weights, h, mb)) for h, mb in zip(hidden, micro, strict=True))
    outputs = hidden
    if engine.parts.logits is not None:
        outputs = [engine.run_logits(weights, h) for h in hidden]
    engine.store.done_with(RESIDENT)
    return ForwardOutput(loss, torch.cat([o.float().cpu() for o in outputs]))


def heldout_loss(engine: L2L, batches: Iterable[dict[str, torch.Tensor]]) -> float:
    """The mean loss per target token over `batches` (causal-LM dicts), each run by `engine.forward`: the
    same block executor as a training step, nothing of the training state touched."""
    total, count = 0.0, 0
    for batch in batches:
        n = int((batch["labels"][:, 1:] != -100).sum())  # the targets the model's mean loss divides by
        if n:
            total += float(engine.forward(batch).loss) * n
            count += n
    if not count:
        raise ValueError("the held-out texts hold no target token")
    return total / count
