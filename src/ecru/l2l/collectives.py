"""The data-parallel collectives of L2L, each run on the device its process group's backend needs.

NCCL takes CUDA tensors only, gloo CPU tensors (and a few CUDA ops): every collective here moves its
tensor to `Collectives.device` (the engine's CUDA device for NCCL, the CPU otherwise), runs, and copies
the result back in place. Parameters are broadcast as one flat buffer per call, not one call per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ecru.l2l.config import L2LInputError


def data_parallel_group():
    """The default process group when torch.distributed is initialised (any world size), else None."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


class Collectives:
    """Collectives over `group` on the device its backend takes."""

    def __init__(self, group, engine_device: torch.device):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend and engine_device.type != "cuda":
            raise L2LInputError(
                "the process group uses NCCL, which needs CUDA tensors; give L2LConfig a CUDA device or "
                "initialise torch.distributed with the gloo backend for CPU training"
            )
        self.device = engine_device if "nccl" in backend else torch.device("cpu")

    def _on(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def all_reduce_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return float(t)

    def all_reduce_(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place."""
        work = self._on(t)
        dist.all_reduce(work, group=self.group)
        if work is not t:
            t.copy_(work)

    def reduce_(self, t: torch.Tensor, dst: int) -> None:
        """Sum `t` over the ranks into rank `dst`'s `t`."""
        work = self._on(t)
        dist.reduce(work, dst=dst, group=self.group)
        if work is not t:
            t.copy_(work)

    @torch.no_grad()
    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Every rank's `tensors` become rank `src`'s, in place (one flat buffer per dtype)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for same in by_dtype.values():
            flat = _flatten_dense_tensors([self._on(t) for t in same])
            dist.broadcast(flat, src=src, group=self.group)
            for t, v in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
                t.copy_(v)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Rank `src`'s `obj` on every rank (pickled; tensors inside travel on the CPU)."""
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.group, device=self.device)
        return box[0]
