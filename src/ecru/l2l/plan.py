"""The step plan: what one L2L training step does, in which order, as data (policy apart from mechanism).

`step_plan(PlanConfig(...))` is a pure function of the schedule's settings (the blocks and their order,
the number of micro-batches, the prefetch depth, the blocks that keep their forward graph, the update
mode, which groups train) that returns the step as phases of small frozen ops; the engine
(ecru.l2l.engine) executes them one by one and decides nothing about their order. Groups are the
parameter server's: 0 is the resident stem + head, block i is group i + 1.

  forward    fetch the resident group and run the stem over every micro-batch; then per block: fetch it,
             prefetch the next `prefetch` blocks, run every micro-batch (stashing its input, or keeping
             its graph), evict it.
  head       each micro-batch's loss and its gradient, then announce the backward's order to the store.
  backward   per block in reverse: fetch it (a kept block has its graph's own weights), prefetch the
             `prefetch` blocks below (those without a kept graph), backpropagate every micro-batch,
             evict it, hand its gradient to the host optimizer: `Update` at once ("overlapped": the host
             steps while the device works on the blocks below) or `Collect` for one `StepAll` after the
             backward ("after_step": global clipping, float16 overflow checks).
  stem       the stem's backward when it trains, then the resident group's update.
  finish     `StepAll` (after_step), then wait for the host updates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

RESIDENT = 0
UPDATE_MODES = ("overlapped", "after_step")


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """The settings a step's plan depends on; validated on construction."""

    blocks: tuple[int, ...]
    """The step's blocks in forward order (block i is group i + 1); each at most once."""
    micro_batches: int
    """Micro-batches of the step (>= 1)."""
    prefetch: int = 1
    """Blocks whose weights are requested ahead of the executing one, in the direction of the phase."""
    keep_graph_blocks: int = 0
    """The last k blocks of the forward keep their graph per micro-batch; their backward recomputes nothing."""
    update: str = "overlapped"
    """"overlapped": each group is updated as soon as its gradient is complete; "after_step": gradients
    are collected and every group is stepped together after the backward."""
    trainable: frozenset[int] = frozenset()
    """The groups with trainable parameters (only these get an update)."""
    stem_trains: bool = False
    """Whether the stem has trainable parameters: its backward runs, and the first block's input needs a
    gradient."""

    def __post_init__(self) -> None:
        if len(set(self.blocks)) != len(self.blocks) or any(i < 0 for i in self.blocks):
            raise ValueError(f"blocks must be distinct indices >= 0, got {self.blocks}")
        if self.micro_batches < 1 or self.prefetch < 0 or self.keep_graph_blocks < 0:
            raise ValueError("micro_batches must be >= 1, prefetch and keep_graph_blocks >= 0")
        if self.update not in UPDATE_MODES:
            raise ValueError(f"update must be one of {UPDATE_MODES}, got {self.update!r}")

    @property
    def kept(self) -> frozenset[int]:
        """The blocks that keep their forward graph: the last `keep_graph_blocks` of the order."""
        return frozenset(self.blocks[len(self.blocks) - min(self.keep_graph_blocks, len(self.blocks)) :])

    def input_grad(self, pos: int) -> bool:
        """Whether the block at position `pos` of the order passes a gradient to its input."""
        return pos > 0 or self.stem_trains


@dataclass(frozen=True, slots=True)
class Begin:
    """Tell the store the order in which the phase will fetch `groups` (the disk tier reads ahead)."""

    phase: str
    groups: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Fetch:
    """Make `group`'s weights available on the device for the ops that follow."""

    group: int


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Start bringing `group`'s weights to the device; a later `Fetch` finds them there."""

    group: int


@dataclass(frozen=True, slots=True)
class Evict:
    """The phase is done with `group`'s device weights (their slot may be reused)."""

    group: int


@dataclass(frozen=True, slots=True)
class StemForward:
    micro: int


@dataclass(frozen=True, slots=True)
class Forward:
    """Block `block` over micro-batch `micro`: without autograd, stashing the input and the RNG state, or,
    with `keep_graph`, under autograd keeping the graph (and an input leaf when `input_grad`)."""

    block: int
    micro: int
    keep_graph: bool = False
    input_grad: bool = False


@dataclass(frozen=True, slots=True)
class Head:
    """Micro-batch `micro`'s weighted loss and its gradient w.r.t. the last hidden state and the head."""

    micro: int


@dataclass(frozen=True, slots=True)
class Backward:
    """Backpropagate micro-batch `micro` through block `block`: through its kept graph, or through a
    recomputation from the stash; `input_grad`: pass the gradient on to the block's input."""

    block: int
    micro: int
    input_grad: bool
    kept: bool = False


@dataclass(frozen=True, slots=True)
class StemBackward:
    micro: int


@dataclass(frozen=True, slots=True)
class Update:
    """Hand `group`'s complete gradient to the host optimizer now (it steps in the background)."""

    group: int


@dataclass(frozen=True, slots=True)
class Collect:
    """Keep `group`'s complete gradient for the `StepAll` after the backward."""

    group: int


@dataclass(frozen=True, slots=True)
class StepAll:
    """Step every collected group together (global gradient norm, overflow check)."""


@dataclass(frozen=True, slots=True)
class Synchronize:
    """Wait until every host update has finished: the step returns with the model updated."""


Op = (
    Begin
    | Fetch
    | Prefetch
    | Evict
    | StemForward
    | Forward
    | Head
    | Backward
    | StemBackward
    | Update
    | Collect
    | StepAll
    | Synchronize
)


@dataclass(frozen=True)
class Phase:
    """A named stretch of the plan (a torch.profiler span of that name when executed)."""

    name: str
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class StepPlan:
    phases: tuple[Phase, ...]

    @property
    def ops(self) -> tuple[Op, ...]:
        """Every op of the step, in order."""
        return tuple(op for phase in self.phases for op in phase.ops)


@functools.lru_cache(maxsize=64)
def step_plan(config: PlanConfig) -> StepPlan:
    """The plan of one training step under `config` (a pure function, cached)."""
    backward = [_backward_block(config, k) for k in reversed(range(len(config.blocks)))]
    return StepPlan((_forward(config), _head(config), *backward, _stem(config), _finish(config)))


def _forward(c: PlanConfig) -> Phase:
    micro, kept = range(c.micro_batches), c.kept
    ops: list[Op] = [Fetch(RESIDENT), *(StemForward(j) for j in micro)]
    ops.append(Begin("forward", tuple(i + 1 for i in c.blocks)))
    for pos, i in enumerate(c.blocks):
        ops.append(Fetch(i + 1))
        ops += [Prefetch(n + 1) for n in c.blocks[pos + 1 : pos + 1 + c.prefetch]]
        keep = i in kept
        ops += [Forward(i, j, keep_graph=keep, input_grad=keep and c.input_grad(pos)) for j in micro]
        ops.append(Evict(i + 1))
    return Phase("l2l.forward", tuple(ops))


def _head(c: PlanConfig) -> Phase:
    ops = [Fetch(RESIDENT), *(Head(j) for j in range(c.micro_batches))]
    return Phase("l2l.head", (*ops, Begin("backward", tuple(i + 1 for i in reversed(c.blocks)))))


def _backward_block(c: PlanConfig, pos: int) -> Phase:
    i, kept = c.blocks[pos], c.blocks[pos] in c.kept
    ops: list[Op] = [] if kept else [Fetch(i + 1)]  # a kept graph holds its own weights
    below = reversed(c.blocks[max(0, pos - c.prefetch) : pos])
    ops += [Prefetch(n + 1) for n in below if n not in c.kept]  # a kept block below fetches nothing
    ops += [Backward(i, j, c.input_grad(pos), kept=kept) for j in range(c.micro_batches)]
    return Phase("l2l.backward.block", (*ops, Evict(i + 1), *_hand_over(c, i + 1)))


def _stem(c: PlanConfig) -> Phase:
    ops: list[Op] = []
    if c.stem_trains:
        ops = [Fetch(RESIDENT), *(StemBackward(j) for j in range(c.micro_batches))]
    return Phase("l2l.backward.stem", (*ops, Evict(RESIDENT), *_hand_over(c, RESIDENT)))


def _hand_over(c: PlanConfig, group: int) -> tuple[Op, ...]:
    if group not in c.trainable:
        return ()
    return (Update(group),) if c.update == "overlapped" else (Collect(group),)


def _finish(c: PlanConfig) -> Phase:
    return Phase("l2l.finish_update", ((StepAll(),) if c.update == "after_step" else ()) + (Synchronize(),))
