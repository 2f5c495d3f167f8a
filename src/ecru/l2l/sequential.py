"""An `nn.Sequential` cut into blocks (one per child) with a user loss `loss_fn(output, target)`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ecru.l2l.config import L2LInputError
from ecru.l2l.parts import MicroBatch, ModelParts, chunks

REDUCTIONS = ("mean", "sum")


class InputStem(nn.Module):
    """No weights: the micro-batch's inputs are the first block's input."""

    def forward(self, inputs: torch.Tensor):
        return inputs, None


class ChildBlock(nn.Module):
    """One child of the Sequential."""

    def __init__(self, child: nn.Module):
        super().__init__()
        self.child = child

    def forward(self, hidden: torch.Tensor, context: None) -> torch.Tensor:
        return self.child(hidden)


class WeightedLoss(nn.Module):
    """`loss_fn(output, target) * weight`: a micro-batch's share of the minibatch loss."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, output: torch.Tensor, target: torch.Tensor, weight: float) -> torch.Tensor:
        return self.loss_fn(output, target) * weight


def sequential_parts(seq: nn.Module, loss_fn: Callable, *, reduction: str = "mean") -> ModelParts:
    """Blocks = the children of `seq`. `reduction` says how `loss_fn` reduces over samples: "mean" (the
    default of torch losses: each micro-batch is weighted by its share of the samples) or "sum"."""
    if not isinstance(seq, nn.Sequential) or len(seq) == 0:
        raise L2LInputError(f"from_sequential needs a non-empty nn.Sequential, got {type(seq).__name__}")
    if reduction not in REDUCTIONS:
        raise L2LInputError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(loss_fn, nn.Module) and any(True for _ in loss_fn.parameters()):
        raise L2LInputError("loss_fn has parameters; make them the last child of the Sequential instead")
    return ModelParts(
        kind="sequential",
        model=seq,
        stem=InputStem(),
        blocks=[ChildBlock(c) for c in seq],
        head=WeightedLoss(loss_fn),
        split=lambda batch, size: split_pairs(batch, size, reduction=reduction),
        options={"reduction": reduction},
        count=(lambda micro: float(sum(mb.inputs.shape[0] for mb in micro))) if reduction == "mean" else None,
        append=lambda child: (seq.append(child), ChildBlock(child))[1],
    )


def split_pairs(batch: Any, size: int, *, reduction: str) -> list[MicroBatch]:
    """Validate an `(inputs, targets)` batch and cut it into micro-batches of `size` samples."""
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise L2LInputError("a Sequential batch is a tuple (inputs, targets) of tensors")
    inputs, targets = batch
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise L2LInputError("a Sequential batch is a tuple (inputs, targets) of tensors")
    if inputs.dim() == 0 or inputs.shape[0] == 0:
        raise L2LInputError("the batch is empty: inputs need a leading batch dimension of size >= 1")
    if targets.dim() == 0 or targets.shape[0] != inputs.shape[0]:
        raise L2LInputError(
            f"inputs have {inputs.shape[0]} samples but targets have shape {tuple(targets.shape)}; "
            "both need the same leading batch dimension"
        )
    total = inputs.shape[0]
    return [
        MicroBatch(x, y, x.shape[0] / total if reduction == "mean" else 1.0)
        for x, y in zip(chunks(inputs, size), chunks(targets, size), strict=True)
    ]
