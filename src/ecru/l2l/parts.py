"""A model cut into the pieces the engine schedules: a resident stem, streamed blocks, a resident head.

Every piece is an `nn.Module` with a fixed call convention, so the engine binds weights into it with
`torch.func.functional_call` and never needs to know the model family:

- `stem(inputs) -> (hidden, context)`: embeddings and whatever the blocks need per micro-batch (masks,
  rotary cos/sin); `context` carries no gradient.
- `block(hidden, context) -> hidden`: one streamed block.
- `block(hidden, context, output_used=False) -> hidden`, where `ModelParts.output_unused_ok`: the
  backward's recomputation, which only backpropagates through the output and never reads it; the block
  may skip work whose only use is the output's value, as long as every gradient stays exact.
- `head(hidden, targets, weight) -> loss`: the micro-batch's share of the minibatch loss, weighted by the
  adapter (`weight`) so that the shares sum to the loss the model defines for the whole minibatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class MicroBatch:
    """One slice of a minibatch, as the stem and head consume it."""

    inputs: Any
    """What `stem` takes (a tensor or a tuple of tensors)."""
    targets: Any
    """What `head` takes as targets."""
    weight: float | int
    """The adapter's loss weight for this slice (e.g. the number of targets in the whole minibatch)."""

    def to(self, device: torch.device, dtype: torch.dtype) -> MicroBatch:
        return MicroBatch(move(self.inputs, device, dtype), move(self.targets, device, None), self.weight)


@dataclass
class ForwardOutput:
    """What `L2L.forward` returns."""

    loss: float | None
    """The batch's loss as the model defines it (None: no target in the batch)."""
    outputs: torch.Tensor
    """HF: the logits [batch, time, vocab]; a Sequential: its last block's output; on the CPU."""


@dataclass
class ModelParts:
    """A model seen by the engine; `split` validates a batch and cuts it into micro-batches."""

    kind: str
    """"hf" or "sequential" (recorded in checkpoints)."""
    model: nn.Module
    """The user's model; its parameters are the engine's fp32 masters, trained in place."""
    stem: nn.Module
    blocks: list[nn.Module]
    head: nn.Module
    split: Callable[[Any, int], list[MicroBatch]]
    count: Callable[[list[MicroBatch]], float] | None = None
    """The minibatch's loss normaliser (targets or samples) for data parallel weighting; None: a summed
    loss, whose per-rank gradients simply add up."""
    append: Callable[[nn.Module], nn.Module] | None = None
    """Progressive stacking: registers a new block in `model` after the last one, returns it wrapped."""
    output_unused_ok: bool = False
    """Blocks accept `output_used=False` (see the module docstring)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Adapter options a checkpoint must record to rebuild the same parts (e.g. the loss reduction)."""
    logits: nn.Module | None = None
    """`logits(hidden) -> outputs` of the head without the loss (HF: final norm + LM head), for
    `L2L.forward`; None: the last block's output is the model's output."""


def move(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """Tensors in `value` (nested tuples/lists) on `device`; floating ones cast to `dtype` when given."""
    if isinstance(value, torch.Tensor):
        cast = dtype if dtype is not None and value.is_floating_point() else None
        return value.to(device=device, dtype=cast, non_blocking=True)
    if isinstance(value, tuple | list):
        return type(value)(move(v, device, dtype) for v in value)
    return value


def chunks(value: Any, size: int) -> list[Any]:
    """`value` (a tensor or tuple of tensors) cut along dim 0 into pieces of `size` rows."""
    if isinstance(value, torch.Tensor):
        return list(torch.split(value, size))
    parts = [chunks(v, size) if v is not None else None for v in value]
    n = max(len(p) for p in parts if p is not None)
    return [tuple(p[i] if p is not None else None for p in parts) for i in range(n)]
