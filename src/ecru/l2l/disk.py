"""The disk tier of the parameter server: fp32 masters and optimizer states of every block on disk.

Layout of `store_dir` (no pickle: safetensors and JSON, through ecru.io):
- `g{group}-s{version}.safetensors`: the group's trainable fp32 masters as one flat tensor (`w`) and its
  optimizer state (`o`: one dict per parameter, as `optimizer.state` holds it);
- `manifest.json`: every committed file with its sha256 and size (checked when the store is opened
  again), and as meta the last complete step, per group the version of its file, and the optimizers'
  hyperparameters (`param_groups`: a learning-rate schedule resumes where it was).

`store_dir` here is the engine's own locked folder (ecru.l2l.workspace): the store deletes only files
whose names it gives. With `fsync=True` each file and the folder entries (renames) are synced.

A streamed block lives in host memory only while it is used: the forward reads its weights (ahead of
use, on an I/O thread), the backward reads weights + optimizer state, the optimizer worker steps it,
writes the new version (temporary name, then `os.replace`) and drops it ("write behind"). The resident
group (stem + head) stays in memory and is written at the end of every step. A step becomes durable
when `manifest.json` is replaced by one naming the new versions; files of an interrupted step are newer
than the manifest and are deleted on resume, so a crash never leaves a block half updated: the store
restarts from the last complete step. A step that fails in a running engine is rolled back the same way
(`rollback`): versions back to the manifest's, newer files deleted, blocks in memory dropped, the
resident group read back.

Frozen parameters (`requires_grad=False`: a LoRA base) are never written: the store keeps the tensor a
frozen parameter came with, as it is (its own dtype, no copy), or, for one on the meta device, reads it
from `frozen` (ecru.l2l.frozen.FolderWeights: memory-mapped from the model folder) each time its block
is installed; where the compute runs on fp32 masters (CPU, float32) a block's frozen tensors are upcast
with it and dropped with it. Host memory and the store's files then grow with the trainable state only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ecru.errors import EcruError
from ecru.io import (
    MANIFEST,
    TMP_MARK,
    file_entry,
    from_json_tree,
    load_state,
    read_manifest,
    save_state,
    to_json_tree,
    verify_manifest,
    write_manifest,
)
from ecru.l2l.config import L2LInputError
from ecru.l2l.frozen import FrozenWeights
from ecru.l2l.store import OptimizerFactory, ParameterStore, ParamGroup

if TYPE_CHECKING:
    from ecru.l2l.collectives import Collectives

FORMAT = "ecru-l2l-disk/3"  # /3: trainable masters only
_FILE = re.compile(r"g(\d+)-s(\d+)\.safetensors")
_HINT = "the store was changed after ecru wrote it; use an empty store_dir"


def _malloc_trim() -> Callable[[], None]:
    """glibc's `malloc_trim(0)`, or a no-op elsewhere. Freed block buffers smaller than glibc's (dynamic,
    up to 32 MiB) mmap threshold stay in the heap arenas; trimming after each eviction hands them back,
    which keeps the host memory of the disk tier flat in depth (measured: ratio 1.54 -> ~1.1 at depth
    32 vs 4 in bench/l2l_memory.py)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0) and None


_trim = _malloc_trim()


class DiskParameterStore(ParameterStore):
    """`ParameterStore` whose streamed groups live on disk; see the module docstring."""

    def __init__(
        self,
        groups: Sequence[list[nn.Parameter]],
        *,
        directory: str | os.PathLike,
        optimizer: OptimizerFactory,
        device: torch.device,
        dtype: torch.dtype,
        resident: int = 0,
        slots: int = 2,
        max_pending: int = 2,
        read_ahead: int = 1,
        fsync: bool = True,
        frozen: FrozenWeights | None = None,
        comm: Collectives | None = None,
    ):
        self.directory = Path(directory)
        self.frozen = frozen
        # frozen parameter (id) -> the tensor it came with (those not on the meta device)
        self._held: dict[int, torch.Tensor] = {}
        self.frozen_bytes_read = 0  # bytes of frozen tensors read from `frozen`
        self.read_ahead, self.fsync = read_ahead, fsync
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ecru-l2l-io")
        self._reads: dict[int, tuple[bool, Future]] = {}
        self._entries: dict[str, dict] = {}  # file name -> sha256 and size, taken when written
        self._flat: dict[int, torch.Tensor] = {}  # groups in memory: their flat trainable fp32 masters
        self._phase, self._order = "forward", []
        self.bytes_read = self.bytes_written = 0
        super().__init__(
            groups,
            optimizer=optimizer,
            device=device,
            dtype=dtype,
            resident=resident,
            slots=slots,
            max_pending=max_pending,
            comm=comm,  # no snapshots: the committed files are the snapshot of a step
        )
        for p, t in zip(self._frozen_params(resident), self._frozen_tensors(resident), strict=True):
            p.data = t
        if (self.directory / MANIFEST).is_file():
            self._resume()
        else:
            self.step, self.extra = 0, {}
            self.versions = [0] * len(self.groups)
            for g in range(len(self.groups)):
                self._write_group(g, 0)
            self._commit(0)
            for g in range(len(self.groups)):
                if g != resident:
                    self._evict(g)
        self._refresh_wire(resident)

    def _make_group(
        self, params: list[nn.Parameter], factory: OptimizerFactory, *, needs_wire: bool
    ) -> ParamGroup:
        """A group without a wire copy yet (made when the group is installed); its frozen tensors held
        as they are, or (on the meta device) left to `frozen`."""
        for p in params:
            if not p.requires_grad and not p.is_meta:
                self._held[id(p)] = p.data
            elif p.is_meta and (p.requires_grad or self.frozen is None):
                raise L2LInputError(
                    "a parameter on the meta device has no values: give L2LConfig(frozen_weights=FOLDER), "
                    "the model folder holding them, and materialize the trainable ones"
                )
        group = super()._make_group(params, factory, needs_wire=False)  # (shapes taken first)
        for p in params:
            if p.is_meta:  # the same Parameter object on the CPU, empty until its block is installed
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty(0), requires_grad=False))
        return group

    # ---- files ------------------------------------------------------------------------------------
    def _path(self, g: int, version: int) -> Path:
        return self.directory / f"g{g:05d}-s{version:09d}.safetensors"

    def _write_group(self, g: int, version: int) -> None:
        group = self.groups[g]
        flat = self._flat.get(g)
        if flat is None:
            trainable = group.trainable_params
            flat = torch.cat([p.detach().reshape(-1) for p in trainable]) if trainable else torch.empty(0)
        state = [dict(group.optimizer.state.get(p, {})) for p in group.params] if group.optimizer else []
        # its manifest entry (file_entry, below) is its checksum
        path = save_state(self._path(g, version), {"w": flat, "o": state}, fsync=self.fsync, checksum=False)
        self._entries[path.name] = file_entry(path)
        self.bytes_written += flat.numel() * 4 + sum(
            t.numel() * t.element_size() for st in state for t in st.values() if isinstance(t, torch.Tensor)
        )

    def _read_group(self, g: int, with_state: bool):
        pending = self.groups[g].pending
        if pending is not None:  # a read never overtakes the update (and write) of the same group
            pending.result()
        version = self.versions[g]
        saved = load_state(self._path(g, version), hint=_HINT)
        flat, state = saved["w"], (saved["o"] if with_state else None)
        self.bytes_read += flat.numel() * 4 + sum(
            t.numel() * t.element_size()
            for st in (state or [])
            for t in st.values()
            if isinstance(t, torch.Tensor)
        )
        return flat, state

    def _commit(self, steps: int) -> None:
        """Make the current versions the durable state of step `steps`, then delete older files."""
        self.step = steps
        meta = {
            "format": FORMAT,
            "step": steps,
            "versions": list(self.versions),
            "numels": [g.numel for g in self.groups],
            "extra": to_json_tree(self.extra),
            "param_groups": to_json_tree([_hyperparameters(g.optimizer) for g in self.groups]),
        }
        names = [self._path(g, v).name for g, v in enumerate(self.versions)]
        write_manifest(self.directory, {n: self._entries[n] for n in names}, meta=meta)
        self._committed = list(self.versions)
        self._clean()
        self._entries = {n: self._entries[n] for n in names}

    def _clean(self) -> None:
        for path in self.directory.iterdir():
            m = _FILE.fullmatch(path.name)
            if m and (int(m[1]) >= len(self.versions) or int(m[2]) != self.versions[int(m[1])]):
                path.unlink(missing_ok=True)
            elif TMP_MARK in path.name:
                path.unlink(missing_ok=True)

    def _resume(self) -> None:
        try:
            manifest = read_manifest(self.directory)
        except EcruError as exc:
            raise L2LInputError(str(exc)) from None
        payload = manifest["meta"]
        if payload.get("format") != FORMAT:
            raise L2LInputError(f"{self.directory} holds no {FORMAT} store; pick an empty store_dir")
        numels = [g.numel for g in self.groups]
        if payload["numels"] != numels:
            raise L2LInputError(
                f"the store in {self.directory} holds groups of sizes {payload['numels']} but this model has "
                f"{numels}: resume with the model the store was made for (same depth and widths), or use "
                "an empty store_dir"
            )
        self.step, self.versions = payload["step"], list(payload["versions"])
        self.extra = from_json_tree(payload["extra"])
        self._committed = list(self.versions)
        self._clean()  # files of an interrupted step are newer than the manifest
        try:
            verify_manifest(self.directory)  # every committed file as written: O(model) once, on opening
        except EcruError as exc:
            raise L2LInputError(f"{exc}; use an empty store_dir") from None
        self._entries = dict(manifest["files"])
        for group, saved in zip(self.groups, from_json_tree(payload["param_groups"]), strict=False):
            if group.optimizer is not None and saved is not None:
                for live, hyper in zip(group.optimizer.param_groups, saved, strict=True):
                    live.update(hyper)
        for g in range(len(self.groups)):
            if g == self.resident:
                self._install(g, *self._read_group(g, True))
                self._flat.pop(g, None)
            else:
                self._evict(g)

    # ---- residency --------------------------------------------------------------------------------
    def _read_block(self, g: int, with_state: bool, *, frozen: bool = True):
        """(flat, state, frozen tensors) of streamed group `g`: what `_install` takes (on the I/O thread,
        so the frozen tensors are paged in and upcast while the device works on another block)."""
        return *self._read_group(g, with_state), self._frozen_tensors(g) if frozen else None

    def _install(
        self, g: int, flat: torch.Tensor, state: list[dict] | None, frozen: list[torch.Tensor] | None = None
    ) -> None:
        """Group `g`'s trainable masters from `flat` (and optimizer `state`), a streamed group's `frozen`
        tensors (from `_frozen_tensors`; None: left empty, no wire) and the wire copy."""
        group = self.groups[g]
        if g == self.resident:
            with torch.no_grad():
                for p, v in zip(group.trainable_params, group.grad_views(flat), strict=True):
                    p.copy_(v)
        else:
            self._flat[g] = flat
            for p, v in zip(group.trainable_params, group.grad_views(flat), strict=True):
                p.data = v
            if frozen is not None:
                for p, t in zip(self._frozen_params(g), frozen, strict=True):
                    p.data = t
        if state is not None and group.optimizer is not None:
            for p, st in zip(group.params, state, strict=True):
                if st:
                    group.optimizer.state[p] = st
        if g == self.resident or frozen is not None:
            self._refresh_wire(g)

    def _frozen_params(self, g: int) -> list[nn.Parameter]:
        group = self.groups[g]
        trainable = set(group.trainable)
        return [p for i, p in enumerate(group.params) if i not in trainable]

    def _frozen_tensors(self, g: int) -> list[torch.Tensor]:
        """Group `g`'s frozen tensors: held ones as they are, the others read from `frozen` (memory-mapped),
        upcast where the compute uses the fp32 masters themselves."""
        params = self._frozen_params(g)
        unheld = [p for p in params if id(p) not in self._held]
        read = dict(zip(map(id, unheld), self.frozen.read(unheld), strict=True)) if unheld else {}
        self.frozen_bytes_read += sum(t.numel() * t.element_size() for t in read.values())
        tensors = [self._held[id(p)] if id(p) in self._held else read[id(p)] for p in params]
        return [t.float() if self.binds_masters else t for t in tensors]

    def _refresh_wire(self, g: int) -> None:
        group = self.groups[g]
        if self.cuda or self.dtype != torch.float32:
            if group.wire is None or group.wire.numel() != group.numel:
                group.wire = torch.empty(group.numel, dtype=self.dtype, pin_memory=self.cuda)
            group.refresh_wire()

    def _evict(self, g: int) -> None:
        group = self.groups[g]
        empty = torch.empty(0)
        for p in group.params:
            p.data = empty
            if group.optimizer is not None:
                group.optimizer.state.pop(p, None)
        group.wire = None
        if self._flat.pop(g, None) is not None:
            _trim()

    def _request(self, g: int, with_state: bool) -> None:
        if g != self.resident and g not in self._flat and g not in self._reads and self.groups[g].numel:
            self._reads[g] = (with_state, self._io.submit(self._read_block, g, with_state))

    # ---- the ParameterStore interface ----------------------------------------------------------------
    def add_group(self, params: list[nn.Parameter]) -> int:
        g = super().add_group(params)
        self.versions.append(self.step)
        self._write_group(g, self.step)
        self._commit(self.step)
        self._evict(g)
        return g

    def begin(self, phase: str, order: Sequence[int]) -> None:
        self._phase, self._order = phase, list(order)
        for g in list(self._reads):  # reads of the other phase (e.g. weights without optimizer state)
            self._reads.pop(g)[1].result()
        for g in self._order[: self.read_ahead]:
            self._request(g, phase == "backward")

    def weights(self, g: int) -> list[torch.Tensor]:
        self.wait(g)
        if g != self.resident and g not in self._flat and self.groups[g].numel:
            with_state = self._phase == "backward"
            if g in self._reads and self._reads[g][0] != with_state:
                self._reads.pop(g)[1].result()
            self._request(g, with_state)
            self._install(g, *self._reads.pop(g)[1].result())
        if g in self._order:  # read the next blocks of this phase while this one computes
            k = self._order.index(g)
            for nxt in self._order[k + 1 : k + 1 + self.read_ahead]:
                self._request(nxt, self._phase == "backward")
        return super().weights(g)

    def prefetch(self, g: int) -> None:
        if self.cuda and 0 <= g < len(self.groups) and (g == self.resident or g in self._flat):
            super().prefetch(g)

    def done_with(self, g: int) -> None:
        super().done_with(g)
        if self._phase == "forward" and g != self.resident:
            self._evict(g)  # unchanged: nothing to write

    def _apply(self, g: int, host: torch.Tensor, copied) -> None:
        super()._apply(g, host, copied)
        if g != self.resident:  # write behind, then free the block
            self.versions[g] = self.step + 1
            self._write_group(g, self.step + 1)
            self._evict(g)

    def end_step(self, steps: int) -> None:
        self.synchronize()
        if self.groups[self.resident].params:
            self.versions[self.resident] = steps
            self._write_group(self.resident, steps)
        self._commit(steps)

    def rollback(self) -> None:
        """Undo a failed step: back to the committed versions (see the module docstring)."""
        self._drain()
        for g in list(self._reads):
            try:
                self._reads.pop(g)[1].result()
            except BaseException:  # noqa: BLE001, S110 - the failed step is being undone
                pass
        self.versions = list(self._committed)
        for g in list(self._flat):
            self._evict(g)
        resident = self.groups[self.resident]
        if resident.params:
            if resident.optimizer is not None:
                resident.optimizer.state.clear()
            self._install(self.resident, *self._read_group(self.resident, True))
        self._clean()
        self._updated.clear()  # every update of the step is undone: nothing to warn about
        super().rollback()

    def resident_groups(self) -> list[int]:
        """Streamed groups in memory now (the tests check that it stays O(a few blocks))."""
        return sorted(self._flat)

    def materialize(self, *, frozen: bool = True) -> None:
        """Read every streamed group's masters into memory (for `state_dict`; O(model)); without `frozen`
        the trainable ones only (an adapter's export), frozen parameters left empty."""
        self.synchronize()
        for g in range(len(self.groups)):
            if g != self.resident and g not in self._flat and self.groups[g].numel:
                self._install(g, *self._read_block(g, False, frozen=frozen))

    def release(self) -> None:
        """Drop what `materialize` read."""
        for g in list(self._flat):
            self._evict(g)

    def optimizer_state(self) -> list[dict]:
        raise L2LInputError(
            "the disk tier keeps optimizer states in store_dir; it is its own checkpoint: "
            "build the engine again over the same store_dir to resume"
        )

    def refresh(self) -> None:
        raise L2LInputError(
            "the disk tier cannot load a state dict into a running engine; write the weights "
            "into the model before building the engine over an empty store_dir"
        )

    def close(self) -> None:
        try:
            super().close()
        finally:
            for _, fut in self._reads.values():
                fut.cancel()
            self._io.shutdown(wait=True)


def _hyperparameters(optimizer: torch.optim.Optimizer | None) -> list[dict] | None:
    """The optimizer's param_groups without their parameters (learning rate, betas, weight decay, ...)."""
    if optimizer is None:
        return None
    return [{k: v for k, v in pg.items() if k != "params"} for pg in optimizer.param_groups]
