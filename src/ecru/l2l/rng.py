"""Random-number state of every device involved, captured per (block, micro-batch) and replayed.

The backward recomputes each block from its stashed input; dropout there must draw the very masks of
the forward. Capturing only the CPU generator is a known bug of other ports: on CUDA the device
generator draws the masks, so both are captured and replayed. `replay` forks the generators, so the
recomputation leaves the global random stream exactly where it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RngState:
    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...]
    devices: tuple[int, ...]


def capture(devices: tuple[int, ...] = ()) -> RngState:
    """The current CPU generator state and that of each CUDA device index in `devices`."""
    return RngState(torch.get_rng_state(), tuple(torch.cuda.get_rng_state(d) for d in devices), devices)


@contextmanager
def replay(state: RngState) -> Iterator[None]:
    """Run the body with the generators set to `state`; restore the surrounding state afterwards."""
    with torch.random.fork_rng(devices=list(state.devices), device_type="cuda"):
        torch.set_rng_state(state.cpu)
        for device, cuda_state in zip(state.devices, state.cuda, strict=True):
            torch.cuda.set_rng_state(cuda_state, device)
        yield
