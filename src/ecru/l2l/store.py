"""The eager parameter server (EPS): fp32 masters and optimizer state on the host, one group per block.

Per group (a streamed block, or the resident stem + head) the store keeps
- the fp32 masters: the model's own `nn.Parameter`s, updated in place by one `torch.optim.Optimizer`;
- a flat wire copy in the compute dtype (pinned on CUDA), refreshed right after each update; on a CPU
  device in float32 the masters themselves are bound and no copy exists;
- on CUDA, reusable flat device slots that a block's wire copy is streamed into (weights never travel
  back: the device copy is discarded and replaced after the next update).
Gradients are accumulated over micro-batches in one flat fp32 device buffer per block and cross to the
host in one copy (when the masters are bound directly, on a CPU device in float32, they accumulate in
the masters' own `.grad` instead, as in plain training: no buffer, no copy); the optimizer step then
runs in a worker thread, overlapping the backward of the blocks below. Every consumer waits for what
it reads: the backward never reuses a buffer the host is still reading, a block's weights are never
loaded before its update has finished, and the worker reads a gradient only after the event of its
device-to-host copy.
"""

from __future__ import annotations

import collections
import copy
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from ecru.l2l.collectives import Collectives

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class Store(Protocol):
    """What the engine asks of a parameter server (`ParameterStore`, in RAM, and the disk tier
    `ecru.l2l.disk.DiskParameterStore`); every setting is given at construction."""

    groups: list[ParamGroup]
    step: int
    """The last complete step the store holds (0, or a resumed disk tier's)."""
    extra: dict[str, Any]
    """JSON-able state committed with each step where the store is durable (the engine's RNG)."""

    @property
    def binds_masters(self) -> bool: ...
    @property
    def grads_in_params(self) -> bool: ...
    def weights(self, g: int) -> list[torch.Tensor]: ...
    def prefetch(self, g: int) -> None: ...
    def done_with(self, g: int) -> None: ...
    def begin(self, phase: str, order: Sequence[int]) -> None: ...
    def note_grads(self, g: int) -> None: ...
    def add_grads(
        self, g: int, grads: Sequence[torch.Tensor], *, indices: Sequence[int] | None = None
    ) -> None: ...
    def update(self, g: int) -> None: ...
    def collect(self, g: int) -> None: ...
    def step_all(
        self, *, inv_scale: float = 1.0, max_norm: float | None = None
    ) -> tuple[bool, float | None]: ...
    def end_step(self, steps: int) -> None: ...
    def discard_grads(self) -> None: ...
    def rollback(self) -> None: ...
    def add_group(self, params: list[nn.Parameter]) -> int: ...
    def synchronize(self) -> None: ...
    def refresh(self) -> None: ...
    def materialize(self, *, frozen: bool = True) -> None: ...
    def release(self) -> None: ...
    def optimizer_state(self) -> list[dict]: ...
    def load_optimizer_state(self, states: list[dict]) -> None: ...
    def close(self) -> None: ...


_warned: set[str] = set()


def _warn_if_slow(optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
    """Once per process: an Adam/AdamW host optimizer without `fused=True` (measured 5-7x slower on CPU,
    bench/experiments/l2l_optimizer.py); the host update is usually the binding limit of L2L."""
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and not optimizer.defaults.get("fused"):
        name = type(optimizer).__name__
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"the L2L host optimizer {name} runs without fused=True; pass "
                f"functools.partial(torch.optim.{name}, ..., fused=True) for a several times faster "
                "host update (the binding limit of L2L on fast devices)",
                stacklevel=4,
            )


class ParamGroup:
    """Masters, optimizer and wire copy of one group; `version` counts the updates submitted. Only the
    parameters with `requires_grad` (`trainable`, fixed at construction) get a gradient, optimizer state
    and updates; frozen ones travel on the wire only and are never written."""

    def __init__(
        self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, wire: torch.Tensor | None
    ):
        self.params, self.optimizer, self.wire = params, optimizer, wire
        self.sizes = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]  # kept: the disk tier empties evicted parameters
        self.numel = sum(self.sizes)
        self.trainable = [i for i, p in enumerate(params) if p.requires_grad]
        self.grad_numel = sum(self.sizes[i] for i in self.trainable)
        self.version = 0
        self.pending: Future | None = None

    @property
    def trainable_params(self) -> list[nn.Parameter]:
        return [self.params[i] for i in self.trainable]

    def grad_views(self, flat: torch.Tensor, indices: Sequence[int] | None = None) -> list[torch.Tensor]:
        """`flat` (a gradient buffer: trainable parameters only, packed) cut into one view per trainable
        parameter, or per parameter index in `indices` (each trainable)."""
        sizes = [self.sizes[i] for i in self.trainable]
        views = [
            v.view(self.shapes[i])
            for v, i in zip(flat[: self.grad_numel].split(sizes), self.trainable, strict=True)
        ]
        if indices is None:
            return views
        pos = {i: k for k, i in enumerate(self.trainable)}
        return [views[pos[i]] for i in indices]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` cut into tensors shaped like the group's parameters."""
        return [
            v.view(shape) for v, shape in zip(flat[: self.numel].split(self.sizes), self.shapes, strict=True)
        ]

    def refresh_wire(self, *, trainable_only: bool = False) -> None:
        """Copy the masters into the wire (after an update only the trainable ones changed)."""
        if self.wire is not None:
            views = self.views(self.wire)
            with torch.no_grad():
                for i in self.trainable if trainable_only else range(len(self.params)):
                    views[i].copy_(self.params[i])


class _Slot:
    """A reusable device buffer holding one group's weights (CUDA)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.flat = torch.empty(numel, dtype=dtype, device=device)
        self.owner: tuple[int, int] | None = None  # (group, version) whose weights it holds
        self.ready = torch.cuda.Event()
        self.free: torch.cuda.Event | None = None  # recorded after the last kernel that read it


class _BufferPool:
    """Flat fp32 buffers reused across blocks; thread-safe (the worker gives buffers back)."""

    def __init__(self, numel: int, device: torch.device, *, pin: bool):
        self.numel, self.device, self.pin = numel, device, pin
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._lock = threading.Lock()

    def take(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return torch.empty(self.numel, dtype=torch.float32, device=self.device, pin_memory=self.pin), None

    def give(self, buf: torch.Tensor, after: torch.cuda.Event | None = None) -> None:
        with self._lock:
            self._free.append((buf, after))


class ParameterStore:
    """The EPS. Group `resident` (the stem and head) stays on the device; the others are streamed.

    With `snapshots` (L2LConfig.rollback) a step is all or nothing: before a group's first update in a
    step its trainable masters and optimizer state are copied aside, and `rollback` puts them back when
    the step fails. The copies cost host memory up to the trainable masters and optimizer states (2x the
    training state of a full fine-tune at the end of a step; little for LoRA), so the RAM tier makes
    them only on request; without them `rollback` leaves the engine usable and warns when some groups
    were already updated. The disk tier needs no copies: its committed files are the snapshot.

    `comm` (data parallel, ecru.l2l.collectives) sums block gradients over the ranks before updates;
    `shard` = (rank, world size) shards the optimizer states (ZeRO-1)."""

    def __init__(
        self,
        groups: Sequence[list[nn.Parameter]],
        *,
        optimizer: OptimizerFactory,
        device: torch.device,
        dtype: torch.dtype,
        resident: int = 0,
        slots: int = 2,
        max_pending: int = 2,
        comm: Collectives | None = None,
        shard: tuple[int, int] | None = None,
        snapshots: bool = False,
    ):
        self.device, self.dtype, self.resident = device, dtype, resident
        self.cuda = device.type == "cuda"
        self._factory, self._slot_count = optimizer, slots
        self.comm, self.shard, self.snapshots = comm, shard, snapshots
        self.step, self.extra = 0, {}
        needs_wire = self.cuda or dtype != torch.float32
        self.groups = [self._make_group(list(ps), optimizer, needs_wire=needs_wire) for ps in groups]
        self._make_pools()
        self._acc: dict[int, torch.Tensor] = {}
        # the resident group's buffers persist: its update is waited for before the next step touches them
        n_res = self.groups[resident].grad_numel
        self._resident_acc = torch.empty(n_res, dtype=torch.float32, device=device)
        self._resident_host = torch.empty(n_res, dtype=torch.float32, pin_memory=True) if self.cuda else None
        self._collected: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._undo: dict[int, tuple[list[torch.Tensor], dict]] = {}  # group -> masters, optimizer state
        self._updated: set[int] = set()  # groups updated in the step in flight
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ecru-l2l-optimizer")
        self._queue: collections.deque[Future] = collections.deque()
        self._max_pending = max_pending
        if self.cuda:
            self._h2d, self._d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self._resident_slot = _Slot(self.groups[resident].numel, dtype, device)

    def _make_pools(self) -> None:
        """Gradient buffers and device slots sized for the largest streamed group."""
        streamed = max([g.numel for i, g in enumerate(self.groups) if i != self.resident] or [0])
        grads = max([g.grad_numel for i, g in enumerate(self.groups) if i != self.resident] or [0])
        self._acc_pool = _BufferPool(grads, self.device, pin=False)
        self._host_pool = _BufferPool(grads, torch.device("cpu"), pin=self.cuda)
        if self.cuda:
            self._slots = [_Slot(streamed, self.dtype, self.device) for _ in range(self._slot_count)]

    def add_group(self, params: list[nn.Parameter]) -> int:
        """Append a streamed group (progressive stacking) with a fresh optimizer; returns its index."""
        self.synchronize()
        needs_wire = self.cuda or self.dtype != torch.float32
        self.groups.append(self._make_group(list(params), self._factory, needs_wire=needs_wire))
        if self.groups[-1].numel > self._acc_pool.numel or self.groups[-1].grad_numel > self._acc_pool.numel:
            self._make_pools()
        return len(self.groups) - 1

    # ---- step boundaries (hooks of the disk tier) ---------------------------------------------------
    def begin(self, phase: str, order: Sequence[int]) -> None:
        """The engine starts its "forward" or "backward" over the streamed groups `order`."""

    def end_step(self, steps: int) -> None:
        """The step is complete on the device: wait for every update (the disk tier commits it). With
        sharded optimizer states, each group's owner then broadcasts its updated weights."""
        self.synchronize()
        self.step = steps
        self._undo.clear()
        self._updated.clear()
        if self.shard is not None:
            for g, group in enumerate(self.groups):
                if group.trainable:
                    self.comm.broadcast_([p.data for p in group.trainable_params], src=self.owner(g))
                    if self.owner(g) != self.shard[0]:
                        group.version += 1
                        group.refresh_wire(trainable_only=True)

    def owner(self, g: int) -> int:
        """The rank that holds group `g`'s optimizer state: round robin over the groups with trainable
        parameters."""
        if self.shard is None:
            return 0
        return sum(1 for group in self.groups[:g] if group.trainable) % self.shard[1]

    def _make_group(
        self, params: list[nn.Parameter], factory: OptimizerFactory, *, needs_wire: bool
    ) -> ParamGroup:
        numel = sum(p.numel() for p in params)
        wire = torch.empty(numel, dtype=self.dtype, pin_memory=self.cuda) if needs_wire and params else None
        trainable = [p for p in params if p.requires_grad]
        group = ParamGroup(params, factory(trainable) if trainable else None, wire)
        _warn_if_slow(group.optimizer, self.device)
        group.refresh_wire()
        return group

    @property
    def binds_masters(self) -> bool:
        """True when the device weights are the fp32 masters themselves (CPU device, float32 compute)."""
        return not self.cuda and self.dtype == torch.float32

    @property
    def grads_in_params(self) -> bool:
        """True when gradients accumulate in the masters' own `.grad` (bound masters, one process): the
        engine lets autograd accumulate there (see `note_grads`) and no flat buffer is used. Data parallel
        keeps the flat buffer: one all-reduce per block."""
        return self.binds_masters and self.comm is None

    # ---- weights: host -> device -------------------------------------------------------------------
    def weights(self, g: int) -> list[torch.Tensor]:
        """Group `g`'s weights on the device in the compute dtype, usable on the current stream (the
        masters themselves when `binds_masters`, frozen low-precision ones as fp32 copies)."""
        group = self.groups[g]
        self.wait(g)
        if not self.cuda:
            if group.wire is not None:
                return group.views(group.wire)
            # the masters themselves; a frozen low-precision weight upcast while its block computes
            return [p if p.requires_grad or p.dtype == torch.float32 else p.float() for p in group.params]
        slot = self._load(g)
        torch.cuda.current_stream(self.device).wait_event(slot.ready)
        return group.views(slot.flat)

    def prefetch(self, g: int) -> None:
        """Start copying group `g` to the device (CUDA; a no-op on CPU, where the host is the device)."""
        if self.cuda and 0 <= g < len(self.groups):
            self.wait(g)
            self._load(g)

    def done_with(self, g: int) -> None:
        """The current stream has queued its last read of group `g`'s device weights for now."""
        if self.cuda:
            slot = self._find(g)
            if slot is not None:
                slot.free = torch.cuda.Event()
                slot.free.record(torch.cuda.current_stream(self.device))

    def _find(self, g: int) -> _Slot | None:
        if g == self.resident:
            return self._resident_slot
        return next((s for s in self._slots if s.owner is not None and s.owner[0] == g), None)

    def _load(self, g: int) -> _Slot:
        group, key = self.groups[g], (g, self.groups[g].version)
        slot = self._find(g)
        if g != self.resident:  # least recently used first; with prefetch + 2 slots it is never in use
            slot = slot or self._slots[0]
            self._slots.remove(slot)
            self._slots.append(slot)
        if slot.owner == key:
            return slot
        with torch.cuda.stream(self._h2d):
            if slot.free is not None:
                self._h2d.wait_event(slot.free)  # never overwrite weights a queued kernel still reads
            slot.flat[: group.numel].copy_(group.wire, non_blocking=True)
            slot.ready.record(self._h2d)
        slot.owner = key
        return slot

    # ---- gradients: device accumulation, one transfer, host update -----------------------------------
    def note_grads(self, g: int) -> None:
        """With `grads_in_params`: group `g`'s masters are receiving gradients in their `.grad` (autograd
        accumulates them); `update` steps on them, `discard_grads` drops them."""
        self._acc[g] = None

    def add_grads(
        self, g: int, grads: Sequence[torch.Tensor], *, indices: Sequence[int] | None = None
    ) -> None:
        """Accumulate one micro-batch's gradients of group `g` (or of its parameters `indices`) in fp32 on
        the device. The resident group is zeroed on first touch: stem and head each fill only a part."""
        if self.grads_in_params:  # into the masters' .grad (the engine lets autograd accumulate there)
            self.note_grads(g)
            group = self.groups[g]
            for p, grad in zip(
                [group.params[i] for i in (group.trainable if indices is None else indices)],
                grads,
                strict=True,
            ):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.add_(grad)
            return
        first = g not in self._acc
        if first:
            if g == self.resident:
                buf = self._resident_acc.zero_()
            else:
                buf, reusable = self._acc_pool.take()
                if reusable is not None:  # its previous gradient may still be on its way to the host
                    torch.cuda.current_stream(self.device).wait_event(reusable)
            self._acc[g] = buf
        targets = self.groups[g].grad_views(self._acc[g], indices)
        copy = first and g != self.resident
        for view, grad in zip(targets, grads, strict=True):
            view.copy_(grad) if copy else view.add_(grad)

    def discard_grads(self) -> None:
        """Drop gradients of an interrupted step (an error mid-step must not leak into the next one)."""
        for g, acc in self._acc.items():
            if acc is None:  # gradients in the masters' .grad
                for p in self.groups[g].params:
                    p.grad = None
            elif g != self.resident:
                self._acc_pool.give(acc)
        self._acc.clear()

    def _all_reduce(self, g: int) -> None:
        """Data parallel: sum group `g`'s gradient over the ranks (each rank pre-weighted its share); to
        the group's owner only when optimizer states are sharded."""
        if self.comm is not None:
            grad = self._acc[g][: self.groups[g].grad_numel]
            if self.shard is None:
                self.comm.all_reduce_(grad)
            else:
                self.comm.reduce_(grad, dst=self.owner(g))

    def update(self, g: int) -> None:
        """Send group `g`'s gradient to the host once and step its optimizer in the worker thread."""
        self._all_reduce(g)
        if self.shard is not None and self.owner(g) != self.shard[0]:
            acc = self._acc.pop(g)  # another rank updates this group and broadcasts it at the step's end
            if g != self.resident:
                self._acc_pool.give(acc)
            return
        host, copied = self._to_host(g)
        group = self.groups[g]
        group.version += 1
        while len(self._queue) >= self._max_pending:  # bounds the host gradient buffers in flight
            self._queue.popleft().result()
        group.pending = self._worker.submit(self._apply, g, host, copied)
        self._queue.append(group.pending)

    def collect(self, g: int) -> None:
        """Send group `g`'s gradient to the host and keep it for `step_all` (clipping, loss scaling)."""
        self._all_reduce(g)
        self._collected[g] = self._to_host(g)

    def _to_host(self, g: int) -> tuple[torch.Tensor | None, torch.cuda.Event | None]:
        acc = self._acc.pop(g)
        if not self.cuda:
            return acc, None  # the host is the device: the accumulator (None: the .grad) is the host gradient
        host = self._resident_host if g == self.resident else self._host_pool.take()[0]
        done = torch.cuda.Event()
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            n = self.groups[g].grad_numel
            host[:n].copy_(acc[:n], non_blocking=True)
            done.record(self._d2h)
        if g != self.resident:
            self._acc_pool.give(acc, done)
        return host, done

    def _apply(self, g: int, host: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        if copied is not None:
            copied.synchronize()  # never read a non-blocking device-to-host copy before it has landed
        group = self.groups[g]
        self._snapshot(g)
        if host is not None:  # else the gradients are in the masters' .grad already
            for p, grad in zip(group.trainable_params, group.grad_views(host), strict=True):
                p.grad = grad
        group.optimizer.step()
        self._updated.add(g)
        for p in group.params:
            p.grad = None
        group.refresh_wire(trainable_only=True)
        self._give_back(g, host)

    def _give_back(self, g: int, host: torch.Tensor | None) -> None:
        if (
            host is not None and g != self.resident
        ):  # on CPU the host gradient is the device accumulator itself
            (self._host_pool if self.cuda else self._acc_pool).give(host)

    def step_all(self, *, inv_scale: float = 1.0, max_norm: float | None = None) -> tuple[bool, float | None]:
        """Update every collected group at once. Gradients are unscaled by `inv_scale`; if any is not
        finite nothing is updated. Returns (updated, total gradient norm before clipping)."""
        order = sorted(self._collected)
        for g in order:
            host, copied = self._collected[g]
            if copied is not None:
                copied.synchronize()
            params = self.groups[g].trainable_params
            for p, grad in zip(
                params,
                self.groups[g].grad_views(host) if host is not None else [p.grad for p in params],
                strict=True,
            ):
                p.grad = grad.mul_(inv_scale) if inv_scale != 1.0 and grad is not None else grad
        params = [p for g in order for p in self.groups[g].trainable_params]
        grads = [p.grad for p in params if p.grad is not None]  # None: a parameter the step did not use
        finite = all(bool(torch.isfinite(gr).all()) for gr in grads)
        norm = None
        if finite and max_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        for g in order:
            group = self.groups[g]
            if finite:
                self._snapshot(g)
                group.optimizer.step()
                self._updated.add(g)
                group.version += 1
                group.refresh_wire(trainable_only=True)
            for p in group.params:
                p.grad = None
            self._give_back(g, self._collected.pop(g)[0])
        return finite, norm

    # ---- all or nothing -----------------------------------------------------------------------------
    def _snapshot(self, g: int) -> None:
        """Copy group `g`'s trainable masters and optimizer state aside before its first update this step."""
        if self.snapshots and g not in self._undo:
            group = self.groups[g]
            masters = [p.detach().clone() for p in group.trainable_params]
            self._undo[g] = (masters, copy.deepcopy(group.optimizer.state_dict()))

    def _drain(self) -> None:
        """Wait for every submitted update, dropping their errors (the step that failed re-raises its own)."""
        for group in self.groups:
            if group.pending is not None:
                try:
                    group.pending.result()
                except BaseException:  # noqa: BLE001, S110 - the failed step is being undone
                    pass
                group.pending = None
        self._queue.clear()

    def rollback(self) -> None:
        """Undo a failed step: masters and optimizer states as before it, no gradient left, engine usable."""
        self._drain()
        lost = self._updated - set(self._undo)
        self._updated.clear()
        if lost:
            warnings.warn(
                f"the failed step had already updated {len(lost)} of {len(self.groups)} parameter groups "
                "(RAM tier without L2LConfig(rollback=True)); they keep the update, the others do not",
                stacklevel=3,
            )
        with torch.no_grad():
            for g, (masters, state) in self._undo.items():
                group = self.groups[g]
                for p, saved in zip(group.trainable_params, masters, strict=True):
                    p.copy_(saved)
                group.optimizer.load_state_dict(state)
        self._undo.clear()
        self.discard_grads()
        for g in list(self._collected):
            self._give_back(g, self._collected.pop(g)[0])
        for group in self.groups:  # device copies may hold updated weights: reload them
            for p in group.params:
                p.grad = None
            group.version += 1
            group.refresh_wire()

    # ---- synchronisation and state ----------------------------------------------------------------
    def wait(self, g: int) -> None:
        """Block until group `g`'s submitted update has finished (re-raises its error)."""
        pending = self.groups[g].pending
        if pending is not None:
            pending.result()
            self.groups[g].pending = None

    def synchronize(self) -> None:
        for g in range(len(self.groups)):
            self.wait(g)
        self._queue.clear()

    def refresh(self) -> None:
        """Masters were changed from outside (a loaded state dict): rebuild wire copies and device slots."""
        self.synchronize()
        for group in self.groups:
            group.version += 1
            group.refresh_wire()

    def materialize(self, *, frozen: bool = True) -> None:
        """Every group's masters in host memory (they always are here; the disk tier reads them back, with
        `frozen=False` the trainable ones only)."""
        self.synchronize()

    def release(self) -> None:
        """Drop what `materialize` read (nothing here)."""

    def optimizer_state(self) -> list[dict]:
        """Every group's optimizer `state_dict`; with sharded states (ZeRO-1) each is sent from its owner,
        so every rank returns the whole optimizer state (a collective: all ranks call it)."""
        self.synchronize()
        states = [g.optimizer.state_dict() if g.optimizer is not None else {} for g in self.groups]
        if self.shard is not None:
            states = [
                self.comm.broadcast_object(state, src=self.owner(g)) if self.groups[g].trainable else state
                for g, state in enumerate(states)
            ]
        return states

    def load_optimizer_state(self, states: list[dict]) -> None:
        """Load `optimizer_state()`'s list; with sharded states a rank keeps only the groups it owns."""
        self.synchronize()
        if len(states) != len(self.groups):
            raise ValueError(f"optimizer state has {len(states)} groups, this engine {len(self.groups)}")
        for g, (group, state) in enumerate(zip(self.groups, states, strict=True)):
            owned = self.shard is None or self.owner(g) == self.shard[0]
            if group.optimizer is not None and owned:
                group.optimizer.load_state_dict(state)

    def close(self) -> None:
        """Finish pending updates (re-raising a failed one) and stop the worker thread."""
        try:
            self.synchronize()
        finally:
            for group in self.groups:
                group.pending = None
            self._worker.shutdown(wait=True)
