"""Block inputs kept from the forward for the recomputing backward, on the device or on the host.

"host" is the constant-device-memory variant: each input is copied to (pinned) host memory on a side
stream as soon as it is produced and copied back when its block's backward needs it; the copy back
waits on the event of the copy out, so it never reads an unfinished transfer. "disk" keeps host memory
flat in depth too: each input is written to its own file (synchronously) in the engine's own folder
(ecru.l2l.workspace) and read back, then deleted, in the backward. Only a tensor's own bytes are saved
(`torch.save` of a view writes its whole storage: a micro-batch slice of a batch tensor would carry the
batch), and only files the stash created are ever deleted.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


class ActivationStash:
    """`put(block, j, x)` in the forward, `pop(block, j)` (once) in the backward."""

    def __init__(self, place: str, device: torch.device, directory: str | os.PathLike | None = None):
        self.place, self.device = place, device
        self.directory = Path(directory) if place == "disk" else None
        if self.directory is not None:  # the engine's own (locked) folder: leftovers are an old run's
            for path in self.directory.glob("b*-m*.pt"):
                path.unlink()
        self.cuda = device.type == "cuda"
        self._items: dict[tuple[int, int], tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._stream = torch.cuda.Stream(device) if self.cuda and place == "host" else None

    def _file(self, block: int, j: int) -> Path:
        return self.directory / f"b{block:05d}-m{j:05d}.pt"

    def put(self, block: int, j: int, x: torch.Tensor) -> None:
        if self.place == "disk":
            torch.save(own_bytes(x.detach().cpu()), self._file(block, j))
            self._items[(block, j)] = (None, None)
            return
        if self.place == "device":
            self._items[(block, j)] = (x, None)
            return
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.cuda)
        if not self.cuda:
            self._items[(block, j)] = (host.copy_(x), None)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(x, non_blocking=True)
            x.record_stream(self._stream)  # keep x's memory alive until the copy has read it
            done = torch.cuda.Event()
            done.record(self._stream)
        self._items[(block, j)] = (host, done)

    def pop(self, block: int, j: int) -> torch.Tensor:
        x, done = self._items.pop((block, j))
        if self.place == "disk":
            path = self._file(block, j)
            x = torch.load(path, weights_only=True).to(self.device)
            path.unlink()
            return x
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return x.to(self.device, non_blocking=True) if self.place == "host" else x

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x, _ in self._items.values() if x is not None)

    def close(self) -> None:
        """Delete what is left and the stash folder itself when it is empty."""
        self.clear()
        if self.directory is not None and self.directory.is_dir() and not any(self.directory.iterdir()):
            self.directory.rmdir()

    def clear(self) -> None:
        if self.place == "disk":
            for block, j in self._items:
                self._file(block, j).unlink(missing_ok=True)
        self._items.clear()


def own_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when it owns exactly its storage, else a compact copy (what `torch.save` should write)."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)
