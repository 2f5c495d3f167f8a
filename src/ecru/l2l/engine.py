"""`L2L`: layer-to-layer training (Pudipeddi et al., arXiv 2002.05645) from an eager parameter server.

One `step` executes its plan (ecru.l2l.plan: the order of fetches, prefetches, forwards, backwards and
updates, computed from the settings by a pure function); each op's handler below is the mechanism:
  forward   stem, then for each block: load its weights once, run every micro-batch without autograd,
            keeping only the block's input; the head computes each micro-batch's weighted loss and its
            gradient at once.
  backward  for each block in reverse: load its weights, recompute every micro-batch from its stash with
            the forward's RNG state, accumulate the weight gradient on the device, send it to the host
            once and let the host optimizer update the block while the device works on the one below.
            The recomputation is only backpropagated through: blocks that can skip work whose only use
            is their output's value do (`ModelParts.output_unused_ok`; a Llama layer's last projection,
            ecru.l2l.recompute), with bit-identical gradients.
  stem      last: the resident stem + head group (which holds a tied embedding once) is updated after
            both of its gradients have arrived.
  kept graphs   `L2LConfig(keep_graph_blocks=k)`: the last k blocks run their forward under autograd and
            keep the graph per micro-batch; their backward runs autograd on it instead of recomputing
            (memory for speed, as selective activation checkpointing).

Beyond one machine's memory and beyond one process:
  disk tier     `L2LConfig(store="disk")`: the parameter server keeps each block's masters and optimizer
                state in files (ecru.l2l.disk), read ahead and written behind; a step commits atomically.
  data parallel under torch.distributed, each rank runs this schedule on its shard; each block's
                gradient is all-reduced (weighted by the rank's share of the loss normaliser) before
                its host update, so the ranks stay identical and equal one process on the whole batch.
  dynamic depth `step(batch, blocks=[...])` runs a subset / ordering of the blocks; `add_block` appends
                one to a running engine (progressive stacking); every block keeps its optimizer state.

Only parameters with `requires_grad` are autograd leaves and get gradients, optimizer state and updates
(frozen weights, PEFT). A step that raises is undone by the store (`rollback`), with the RNG and loss
scale, and the engine stays usable. After training: `forward` (evaluation streamed like a step),
`model_on` (the model back whole on one device), `save_pretrained`, `lr_scheduler`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.profiler import record_function

from ecru.l2l.collectives import Collectives, data_parallel_group
from ecru.l2l.config import L2LConfig, L2LInputError, check_device
from ecru.l2l.parts import ForwardOutput, MicroBatch, ModelParts
from ecru.l2l.plan import (
    RESIDENT,  # group of the stem and head; block i is group i + 1
    Backward,
    Begin,
    Collect,
    Evict,
    Fetch,
    Forward,
    Head,
    Phase,
    PlanConfig,
    Prefetch,
    StemBackward,
    StemForward,
    StepAll,
    StepPlan,
    Synchronize,
    Update,
    step_plan,
)
from ecru.l2l.rng import RngState, capture, replay
from ecru.l2l.scaling import LossScale
from ecru.l2l.stash import ActivationStash
from ecru.l2l.store import OptimizerFactory, ParameterStore, Store
from ecru.l2l.workspace import Workspace

Binding = list[tuple[str, int]]  # (parameter name in the piece, index in its group)
# a kept block's autograd leaves (index in its group -> weight), its trainable indices and, per micro-batch,
# (input leaf or None, output), None once its backward has run
KeptGraphs = tuple[
    dict[int, torch.Tensor], list[int], list[tuple[torch.Tensor | None, torch.Tensor | None] | None]
]


@dataclass(eq=False)
class _Run:
    """What one step's ops share: per micro-batch hidden states, block contexts and gradients, the fetched
    groups' device weights and autograd leaves, the forward's RNG states and the kept graphs."""

    micro: list[MicroBatch]
    loss_scale: float
    head_scale: float
    """The loss scale times this rank's share of the loss normaliser: what the head's loss is seeded with."""
    device: torch.device
    hidden: list = field(init=False)
    contexts: list = field(init=False)
    grads: list = field(init=False)
    loss: torch.Tensor = field(init=False)
    weights: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    leaves: dict[tuple[int, str], tuple[dict[int, torch.Tensor], list[int]]] = field(default_factory=dict)
    rng: dict[tuple[int, int], RngState] = field(default_factory=dict)
    kept: dict[int, KeptGraphs] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.micro)
        self.hidden, self.contexts, self.grads = [None] * n, [None] * n, [None] * n
        self.loss = torch.zeros((), dtype=torch.float32, device=self.device)


class L2L:
    """Trains `parts.model` in place: its trainable parameters are the fp32 masters of the parameter
    server; frozen ones stay in their own dtype."""

    def __init__(self, parts: ModelParts, *, optimizer: OptimizerFactory, config: L2LConfig | None = None):
        self.config = config or L2LConfig()
        self.device = check_device(self.config.torch_device)
        if not callable(optimizer):
            raise L2LInputError(
                "optimizer must be a callable params -> torch.optim.Optimizer, "
                "e.g. functools.partial(torch.optim.AdamW, lr=1e-3)"
            )
        self.parts, self.model = parts, parts.model
        self.model_dtype = _model_dtype(self.model)
        _fp32_masters_(self.model, meta_ok=self.config.store == "disk")
        _buffers_to_(self.model, self.device)
        groups = _groups(parts)
        self._bindings = {
            "stem": _binding(parts.stem, groups[RESIDENT]),
            "head": _binding(parts.head, groups[RESIDENT]),
        }
        if parts.logits is not None:
            self._bindings["logits"] = _binding(parts.logits, groups[RESIDENT])
        self._block_bindings = [_binding(b, groups[i + 1]) for i, b in enumerate(parts.blocks)]
        group = data_parallel_group() if self.config.data_parallel else None
        self.comm = Collectives(group, self.device) if group is not None else None
        self.process_group = group
        if self.comm is not None:  # every rank starts from rank 0's weights
            self.comm.broadcast_([p.data for p in _unique(self.model.parameters())], src=0)
        self.workspace = _workspace(self.config, self.comm)
        try:
            self.store = _make_store(
                self.config, groups, optimizer, self.device, self.workspace, self.model, self.comm
            )
        except BaseException:
            if self.workspace is not None:
                self.workspace.close()
            raise
        stem_params = {idx for _, idx in self._bindings["stem"]}
        self._stem_trains = any(i in stem_params for i in self.store.groups[RESIDENT].trainable)
        stash_dir = self.workspace.folder("stash") if self.config.stash == "disk" else None
        self.stash = ActivationStash(self.config.stash, self.device, stash_dir)
        self.scaler = (
            LossScale(
                self.config.loss_scale,
                self.config.loss_scale_growth_interval,
                min_scale=self.config.min_loss_scale,
            )
            if self.config.dtype == torch.float16
            else None
        )
        self._rng_devices = (self.device.index,) if self.device.type == "cuda" else ()
        self._handlers = self._op_handlers()
        self._run: _Run | None = None  # the state of the step in progress
        self.steps = self.store.step  # a disk store resumes from its last complete step
        if self.store.extra.get("rng") is not None:
            torch.set_rng_state(self.store.extra["rng"])
        self.last_grad_norm: float | None = None
        self._schedulers: list[Any] = []

    # ---- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_hf(
        cls, model: nn.Module, *, optimizer: OptimizerFactory, config: L2LConfig | None = None
    ) -> L2L:
        """A Hugging Face decoder-only causal LM (any family whose decoder layers sit in one module list,
        run by the model's own code: ecru.l2l.hf); batches are dicts with input_ids, attention_mask
        (optional) and labels (-100 = ignored)."""
        from ecru.l2l.hf import hf_parts

        return cls(hf_parts(model), optimizer=optimizer, config=config)

    @classmethod
    def from_sequential(
        cls,
        seq: nn.Sequential,
        *,
        loss_fn: Callable,
        optimizer: OptimizerFactory,
        config: L2LConfig | None = None,
        reduction: str = "mean",
    ) -> L2L:
        """Each child of `seq` is a block; batches are (inputs, targets); `reduction` is how `loss_fn`
        reduces over samples ("mean" or "sum")."""
        from ecru.l2l.sequential import sequential_parts

        return cls(sequential_parts(seq, loss_fn, reduction=reduction), optimizer=optimizer, config=config)

    @classmethod
    def resume(
        cls,
        path,
        model: nn.Module,
        *,
        optimizer: OptimizerFactory,
        config: L2LConfig | None = None,
        loss_fn: Callable | None = None,
    ) -> L2L:
        """An engine over `model` restored from `engine.save(path)`: weights, optimizer state, step, RNG."""
        from ecru.l2l.checkpoint import resume

        return resume(cls, path, model, optimizer=optimizer, config=config, loss_fn=loss_fn)

    # ---- one training step ----------------------------------------------------------------------
    def step(self, batch: Any, *, blocks: Sequence[int] | None = None) -> float:
        """Forward, backward and update on one minibatch; returns its loss as the model defines it.

        `blocks` runs only these blocks, in this order (layer drop, reordering; default: all in order);
        blocks left out keep their weights and optimizer state untouched."""
        order = self._order(blocks)
        micro = [
            mb.to(self.device, self.config.dtype)
            for mb in self.parts.split(batch, self.config.micro_batch_size)
        ]
        share = self._rank_share(micro)
        before = (torch.get_rng_state(), dataclasses.replace(self.scaler) if self.scaler else None)
        try:
            loss = self._global_loss(self._step(micro, order, share) * share)
            # committed with the step where the store is durable (the disk tier): RNG and loss
            self.store.extra = {"rng": torch.get_rng_state(), "loss": loss}
            self.store.end_step(self.steps + 1)
        except BaseException:
            # all or nothing: masters, optimizer states, loss scale and RNG as before the step
            self.store.rollback()
            torch.set_rng_state(before[0])
            self.scaler = before[1]
            raise
        finally:
            self.stash.clear()
            self._run = None  # stashed RNG states and kept graphs do not outlive their step
            self.store.discard_grads()
        self.steps += 1
        for scheduler in self._schedulers:  # after end_step: no update is in flight
            scheduler.step()
        return loss

    @property
    def committed_loss(self) -> float | None:
        """The loss of the last step the parameter store committed with its weights: a disk store reopened
        after a kill tells the step's loss that a caller's own record may lack; None where it keeps none."""
        loss = self.store.extra.get("loss")
        return None if loss is None else float(loss)

    def _step(self, micro: list[MicroBatch], order: list[int], share: float) -> float:
        """Execute the step's plan (ecru.l2l.plan); each phase is a torch.profiler span ("l2l.*", which
        bench/experiments/l2l_profile.py reads)."""
        scale = self.scaler.scale if self.scaler else 1.0
        run = _Run(micro, loss_scale=scale, head_scale=scale * share, device=self.device)
        self._run = run
        self._execute(self._plan(order, len(micro)).phases, run)
        return float(run.loss)

    def _plan(self, order: list[int], micro_batches: int) -> StepPlan:
        trainable = frozenset(g for g, group in enumerate(self.store.groups) if group.trainable)
        return step_plan(
            PlanConfig(
                blocks=tuple(order),
                micro_batches=micro_batches,
                prefetch=self.config.prefetch,
                keep_graph_blocks=self.config.keep_graph_blocks,
                update="after_step" if self.config.deferred_update else "overlapped",
                trainable=trainable,
                stem_trains=self._stem_trains,
            )
        )

    def _execute(self, phases: Sequence[Phase], run: _Run) -> None:
        handlers = self._handlers
        for phase in phases:
            with record_function(phase.name):
                for op in phase.ops:
                    handlers[type(op)](run, op)

    def _order(self, blocks: Sequence[int] | None) -> list[int]:
        n = len(self.parts.blocks)
        if blocks is None:
            return list(range(n))
        order = list(blocks)
        if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n for i in order):
            raise L2LInputError(f"blocks must be indices in [0, {n}), got {order}")
        if len(set(order)) != len(order):
            raise L2LInputError(f"blocks {order} repeats a block; each block runs at most once per step")
        return order

    def _rank_share(self, micro: list[MicroBatch]) -> float:
        """Data parallel: this rank's share of the global loss normaliser (its targets / all targets), so
        that summed gradients equal one process on the concatenated batch; 1.0 otherwise. A rank may
        have no target at all; the minibatch as a whole must have one."""
        if self.parts.count is None:
            return 1.0
        count = self.parts.count(micro)
        total = count
        if self.comm is not None:
            total = self.comm.all_reduce_sum(count)
        if total == 0:
            raise L2LInputError(
                "the batch has no target token: every label (after the shift by one) is -100"
                + (" on every rank" if self.comm is not None else "")
            )
        return count / total

    def _global_loss(self, loss: float) -> float:
        return loss if self.comm is None else self.comm.all_reduce_sum(loss)

    def add_block(self, block: nn.Module) -> int:
        """Progressive stacking: append `block` to the model (after the last block) and to the parameter
        server with a fresh optimizer state; returns its index. Existing blocks keep their state."""
        if self.parts.append is None:
            raise L2LInputError(
                f"this model ({self.parts.kind}) cannot grow; add_block needs from_hf or from_sequential"
            )
        for name, p in block.named_parameters():
            if not p.is_floating_point() or p.device.type != "cpu":
                raise L2LInputError(
                    f"parameter {name} of the new block must be a floating-point tensor on the CPU"
                )
        known = {id(p) for g in self.store.groups for p in g.params}
        params = _unique(block.parameters())
        if any(id(p) in known for p in params):
            raise L2LInputError("the new block shares a parameter with the model; give it its own weights")
        self.store.synchronize()
        _fp32_masters_(block)
        _buffers_to_(block, self.device)
        wrapped = self.parts.append(block)
        self.parts.blocks.append(wrapped)
        self._block_bindings.append(_binding(wrapped, params))
        self.store.add_group(params)
        return len(self.parts.blocks) - 1

    def _grad(
        self,
        g: int,
        output: torch.Tensor,
        grad_output: torch.Tensor | None,
        x: torch.Tensor | None,
        weights: dict[int, torch.Tensor],
        indices: list[int],
    ) -> torch.Tensor | None:
        """Backpropagate `output` (seeded with `grad_output`) to group `g`'s trainable `weights[indices]`,
        whose gradients the store accumulates over the micro-batches, and to the leaf `x` (None: not
        needed); returns x's gradient. When the masters are bound directly, autograd accumulates into
        their `.grad` as in plain training: the first micro-batch's gradient is taken over without a copy
        and the others are added in place (no flat buffer, no zeroing)."""
        leaves = ([x] if x is not None else []) + [weights[idx] for idx in indices]
        if not leaves:
            return None
        if self.store.grads_in_params:
            if indices:
                self.store.note_grads(g)
            torch.autograd.backward(output, grad_output, inputs=leaves)
            return None if x is None else x.grad if x.grad is not None else torch.zeros_like(x)
        out = torch.autograd.grad(output, leaves, grad_output, materialize_grads=True)
        if indices:
            self.store.add_grads(g, out[len(leaves) - len(indices) :], indices=indices)
        return out[0] if x is not None else None

    # ---- the plan's ops: each handler executes one op of ecru.l2l.plan on the step's state ----------
    def _op_handlers(self) -> dict[type, Callable[[_Run, Any], None]]:
        return {
            Begin: lambda run, op: self.store.begin(op.phase, list(op.groups)),
            Fetch: self._fetch,
            Prefetch: lambda run, op: self.store.prefetch(op.group),
            Evict: self._evict,
            StemForward: self._stem_forward,
            Forward: self._block_forward,
            Head: self._head,
            Backward: self._backward,
            StemBackward: self._stem_backward,
            Update: lambda run, op: self.store.update(op.group),
            Collect: lambda run, op: self.store.collect(op.group),
            StepAll: self._step_all,
            Synchronize: lambda run, op: self.store.synchronize(),
        }

    def _forward(self, micro: list[MicroBatch]) -> list[torch.Tensor]:
        """The forward phase of a step over all blocks alone, its state dropped (tests: it draws the random
        numbers a step's forward draws)."""
        run = _Run(micro, loss_scale=1.0, head_scale=1.0, device=self.device)
        try:
            self._execute(self._plan(list(range(len(self.parts.blocks))), len(micro)).phases[:1], run)
        finally:
            self.stash.clear()
        return run.hidden

    def _fetch(self, run: _Run, op: Fetch) -> None:
        run.weights[op.group] = self.store.weights(op.group)
        run.leaves = {key: v for key, v in run.leaves.items() if key[0] != op.group}

    def _evict(self, run: _Run, op: Evict) -> None:
        self.store.done_with(op.group)
        run.weights.pop(op.group, None)
        run.leaves = {key: v for key, v in run.leaves.items() if key[0] != op.group}
        kept = run.kept.get(op.group - 1)
        if kept is not None and all(graph is None for graph in kept[2]):  # its backward has run
            del run.kept[op.group - 1]

    def _part_leaves(self, run: _Run, part: str, g: int) -> tuple[dict[int, torch.Tensor], list[int]]:
        """`_leaves` of `part` ("stem", "head" or "block") in group `g`, made once per fetch."""
        key = (g, part)
        if key not in run.leaves:
            binding = self._bindings[part] if g == RESIDENT else self._block_bindings[g - 1]
            run.leaves[key] = self._leaves(binding, run.weights[g], g)
        return run.leaves[key]

    def _stem_forward(self, run: _Run, op: StemForward) -> None:
        j = op.micro
        run.rng[(RESIDENT, j)] = capture(self._rng_devices)
        with torch.no_grad():
            run.hidden[j], run.contexts[j] = self.run_stem(run.weights[RESIDENT], run.micro[j].inputs)

    def _block_forward(self, run: _Run, op: Forward) -> None:
        i, j = op.block, op.micro
        if op.keep_graph:
            self._forward_kept(run, op)
            return
        x = run.hidden[j]
        run.rng[(i + 1, j)] = capture(self._rng_devices)
        self.stash.put(i, j, x)
        with torch.no_grad(), record_function("l2l.block.forward"):
            run.hidden[j] = self.run_block(i, run.weights[i + 1], x, run.contexts[j])

    def _forward_kept(self, run: _Run, op: Forward) -> None:
        """Block `op.block` over one micro-batch under autograd, keeping the graph for the backward. Nothing
        is stashed and no RNG state captured: the graph holds the input and its own dropout masks, and the
        forward draws exactly what the no-grad forward would, so later blocks' masks are unchanged."""
        i, j = op.block, op.micro
        if i not in run.kept:
            leaves, trainable = self._leaves(self._block_bindings[i], run.weights[i + 1], i + 1)
            if not self.store.binds_masters:  # device weights sit in reused slots / wire buffers: copy them
                leaves = {
                    idx: w.detach().clone().requires_grad_(idx in trainable) for idx, w in leaves.items()
                }
            run.kept[i] = (leaves, trainable, [None] * len(run.micro))
        leaves, _, graphs = run.kept[i]
        x = run.hidden[j]
        if op.input_grad and x.is_floating_point():
            x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = self.run_block(i, leaves, x, run.contexts[j])
        graphs[j] = (x if x.requires_grad else None, y) if y.requires_grad else (None, None)
        run.hidden[j] = y.detach()

    def _head(self, run: _Run, op: Head) -> None:
        """Micro-batch `op.micro`'s weighted loss and its gradient w.r.t. the last hidden state and the head."""
        weights, indices = self._part_leaves(run, "head", RESIDENT)
        j = op.micro
        x = run.hidden[j].detach().requires_grad_()
        run.hidden[j] = None
        with torch.enable_grad():
            loss = self.run_head(weights, x, run.micro[j])
            run.grads[j] = self._grad(RESIDENT, loss * run.head_scale, None, x, weights, indices)
        run.loss += loss.detach().float()

    def _backward(self, run: _Run, op: Backward) -> None:
        i, j, g = op.block, op.micro, op.block + 1
        if op.kept:
            weights, trainable, graphs = run.kept[i]
            (x, y), graphs[j] = graphs[j], None  # free each graph as soon as it has run
        else:
            weights, trainable = self._part_leaves(run, "block", g)
            x, y = self._recompute(run, op, weights, trains=bool(trainable))
        if y is None:
            return
        with torch.enable_grad():
            grad_in = self._grad(g, y, run.grads[j], x, weights, trainable)
        if x is not None:
            run.grads[j] = grad_in

    def _recompute(
        self, run: _Run, op: Backward, weights: dict[int, torch.Tensor], *, trains: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Block `op.block`'s forward of micro-batch `op.micro` again, from its stash under the forward's RNG
        state, with autograd: (the input leaf if its gradient is needed, else None; the output), or
        (None, None) when nothing needs a gradient."""
        i, j = op.block, op.micro
        x = self.stash.pop(i, j)
        needs_input = op.input_grad and x.is_floating_point()
        if needs_input:
            x = x.detach().requires_grad_()
        if not needs_input and not trains:
            return None, None
        # y is only backpropagated through, never read: the block may skip what only its value needs
        kwargs = {"output_used": False} if self.parts.output_unused_ok else None
        with replay(run.rng[(i + 1, j)]), torch.enable_grad(), record_function("l2l.recompute"):
            y = self.run_block(i, weights, x, run.contexts[j], kwargs=kwargs, fresh_buffers=True)
        return (x if needs_input else None), y

    def _stem_backward(self, run: _Run, op: StemBackward) -> None:
        weights, indices = self._part_leaves(run, "stem", RESIDENT)
        if self.store.grads_in_params:  # embeddings give sparse gradients: add them to a dense one
            for idx in indices:
                if weights[idx].grad is None:
                    weights[idx].grad = torch.zeros_like(weights[idx])
        j = op.micro
        with replay(run.rng[(RESIDENT, j)]), torch.enable_grad():
            h, _ = self.run_stem(weights, run.micro[j].inputs, fresh_buffers=True)
            self._grad(RESIDENT, h, run.grads[j], None, weights, indices)

    def _step_all(self, run: _Run, op: StepAll) -> None:
        finite, self.last_grad_norm = self.store.step_all(
            inv_scale=1.0 / run.loss_scale, max_norm=self.config.max_grad_norm
        )
        if self.scaler is not None:
            self.scaler.update(finite=finite)

    # ---- weight binding -------------------------------------------------------------------------
    def _leaves(
        self, binding: Binding, weights: Sequence[torch.Tensor], g: int
    ) -> tuple[dict[int, torch.Tensor], list[int]]:
        """The group `g` device weights that `binding` uses, keyed by index, and the indices of the
        trainable ones, which are autograd leaves: the masters themselves when they are bound directly,
        else fresh leaves over the device copies. Frozen weights are plain tensors: no gradient."""
        indices = sorted({idx for _, idx in binding})
        trainable = set(self.store.groups[g].trainable)
        train = [idx for idx in indices if idx in trainable]
        if self.store.binds_masters:
            return {idx: weights[idx] for idx in indices}, train
        return {idx: weights[idx].detach().requires_grad_(idx in trainable) for idx in indices}, train

    # ---- the block executor: every forward of a part, in training, evaluation and export -----------
    def run_stem(self, weights, inputs: Any, *, fresh_buffers: bool = False) -> tuple[torch.Tensor, Any]:
        """The stem over one micro-batch's `inputs` with the resident group's `weights` (a sequence or an
        index -> tensor dict): the first hidden state and the context every block receives."""
        binding = self._bindings["stem"]
        return self._call(self.parts.stem, binding, RESIDENT, weights, (inputs,), fresh_buffers=fresh_buffers)

    def run_block(
        self,
        i: int,
        weights,
        hidden: torch.Tensor,
        context: Any,
        *,
        kwargs: dict[str, Any] | None = None,
        fresh_buffers: bool = False,
    ) -> torch.Tensor:
        """Block `i` over one micro-batch's `hidden` state with group `i + 1`'s `weights`."""
        block, binding = self.parts.blocks[i], self._block_bindings[i]
        return self._call(
            block, binding, i + 1, weights, (hidden, context), kwargs=kwargs, fresh_buffers=fresh_buffers
        )

    def run_head(self, weights, hidden: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
        """The head's weighted loss of one micro-batch from the last `hidden` state (resident `weights`)."""
        args = (hidden, micro.targets, micro.weight)
        return self._call(self.parts.head, self._bindings["head"], RESIDENT, weights, args)

    def run_logits(self, weights, hidden: torch.Tensor) -> torch.Tensor:
        """The model's outputs (logits) from the last `hidden` state; the parts must define `logits`."""
        if self.parts.logits is None:
            raise L2LInputError("these model parts define no logits: read the hidden state instead")
        return self._call(self.parts.logits, self._bindings["logits"], RESIDENT, weights, (hidden,))

    def _call(
        self,
        module: nn.Module,
        binding: Binding,
        g: int,
        weights,
        args: tuple,
        *,
        kwargs: dict[str, Any] | None = None,
        fresh_buffers: bool = False,
    ):
        """`module(*args, **kwargs)` with its parameters bound to group `g`'s `weights` (a sequence or an
        index -> tensor dict) through `functional_call`; when the masters are the device weights, they are
        the module's own parameters already and only the weights that are not (frozen low-precision ones
        upcast for the compute) and buffers are bound. A recomputation gets copies of the buffers, so
        running statistics are updated once, in the forward."""
        if self.store.binds_masters:
            params = self.store.groups[g].params
            bound = {name: weights[idx] for name, idx in binding if weights[idx] is not params[idx]}
        else:
            bound = {name: weights[idx] for name, idx in binding}
        if fresh_buffers:
            bound.update({name: b.clone() for name, b in module.named_buffers()})
        if bound:
            return functional_call(module, bound, args, kwargs)
        return module(*args, **(kwargs or {}))

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict (trainable weights as their fp32 masters, frozen ones in their own dtype);
        the original model loads it with strict=True. On the disk tier it is read from disk into new
        tensors (O(model) memory)."""
        self.store.materialize()
        try:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        finally:
            self.store.release()

    def load_state_dict(
        self, state_dict: dict[str, torch.Tensor], *, frozen_from_model: bool = False
    ) -> None:
        """Load a state dict (strict); with `frozen_from_model`, frozen parameters it lacks keep the model's."""
        self.store.synchronize()
        if frozen_from_model:
            frozen = {
                n for n, p in self.model.named_parameters(remove_duplicate=False) if not p.requires_grad
            }
            missing = set(self.model.state_dict()) - set(state_dict)
            if missing - frozen:
                raise ValueError(f"the state dict lacks trainable weights: {sorted(missing - frozen)[:3]}")
            self.model.load_state_dict(state_dict, strict=False)
        else:
            self.model.load_state_dict(state_dict, strict=True)
        self.store.refresh()

    def save(self, path, *, meta: dict | None = None) -> None:
        """A full training checkpoint (weights, optimizer states, step, RNG, loss scale) in folder `path`,
        committed atomically with the caller's JSON `meta` (see ecru.l2l.checkpoint)."""
        from ecru.l2l.checkpoint import save

        save(self, path, meta=meta)

    def save_pretrained(self, path, *, tokenizer=None, dtype: torch.dtype | None = None) -> None:
        """Export the trained Hugging Face model (`save_pretrained` format, with its config) in `dtype`
        (default: the dtype the model came in), and `tokenizer` beside it when given."""
        from ecru.l2l.export import save_pretrained

        save_pretrained(self, path, tokenizer=tokenizer, dtype=dtype or self.model_dtype)

    def model_on(self, device: str | torch.device = "cpu", *, dtype: torch.dtype | None = None) -> nn.Module:
        """Close the engine and hand the model back whole on one `device` (parameters and buffers; the
        disk tier reads every block back), in `dtype` (default: fp32 masters), for evaluation or
        generation with the model's own forward."""
        from ecru.l2l.export import model_on

        return model_on(self, torch.device(device), dtype=dtype)

    @torch.no_grad()
    def forward(self, batch: Any, *, blocks: Sequence[int] | None = None) -> ForwardOutput:
        """Evaluate `batch` layer by layer as `step` streams it (so a model larger than memory can be
        evaluated too), in eval mode, without autograd and without touching weights or optimizer state:
        the batch's loss as the model defines it and the outputs (HF: logits), on the CPU. An HF batch
        without labels gives the logits only."""
        from ecru.l2l.evaluate import forward

        return forward(self, batch, order=self._order(blocks))

    def lr_scheduler(self, factory: Callable[[torch.optim.Optimizer], Any]) -> None:
        """Give every block's optimizer (and the stem/head's) the scheduler `factory(optimizer)`, e.g.
        `lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup)`; each is stepped after every
        training step. Set it after a resume too: it is fast-forwarded to the engine's step count."""
        self.store.synchronize()
        self._schedulers = [factory(g.optimizer) for g in self.store.groups if g.optimizer is not None]
        with warnings.catch_warnings():  # fast-forwarding a resumed run steps no optimizer, by design
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            for _ in range(self.steps):
                for s in self._schedulers:
                    s.step()

    def close(self) -> None:
        """Finish pending updates, stop the optimizer thread and release the store_dir lock."""
        try:
            self.store.close()
        finally:
            self.stash.close()
            if self.workspace is not None:
                self.workspace.close()


def _workspace(config: L2LConfig, comm: Collectives | None) -> Workspace | None:
    """The engine's locked folder in store_dir (disk tier or disk stash), one per data-parallel rank."""
    if config.store != "disk" and config.stash != "disk":
        return None
    rank = comm.rank if comm is not None and comm.world > 1 else None
    return Workspace(config.store_dir, rank=rank)


def _make_store(
    config: L2LConfig,
    groups: list[list[nn.Parameter]],
    optimizer: OptimizerFactory,
    device: torch.device,
    workspace: Workspace | None,
    model: nn.Module,
    comm: Collectives | None,
) -> Store:
    kw = dict(
        optimizer=optimizer,
        device=device,
        dtype=config.dtype,
        resident=RESIDENT,
        slots=config.prefetch + 2,
        max_pending=config.max_pending_updates,
        comm=comm,
    )
    if config.store != "disk":
        shard = (comm.rank, comm.world) if comm is not None and config.shard_optimizer else None
        return ParameterStore(groups, shard=shard, snapshots=config.rollback, **kw)
    from ecru.l2l.disk import DiskParameterStore
    from ecru.l2l.frozen import FolderWeights

    return DiskParameterStore(
        groups,
        directory=workspace.folder("store"),
        fsync=config.fsync,
        read_ahead=max(1, config.prefetch),
        frozen=FolderWeights(config.frozen_weights, model) if config.frozen_weights else None,
        **kw,
    )


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype most of the model's parameters have (what save_pretrained writes back)."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return max(sizes, key=sizes.get) if sizes else torch.float32


def _fp32_masters_(model: nn.Module, *, meta_ok: bool = False) -> None:
    """Trainable parameters as fp32 masters on the CPU. Frozen ones stay in their own dtype (a bf16 base
    stays bf16 on the host; the store upcasts a block's frozen weights while it computes where the compute
    needs fp32), on the CPU or, with `meta_ok` (the disk tier), anywhere, meta device included
    (read in place: ecru.l2l.disk)."""
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise L2LInputError(f"parameter {name} is {p.dtype}; L2L trains floating-point parameters only")
        if p.requires_grad and p.dtype != torch.float32:  # the masters are fp32 whatever the compute dtype
            p.data = p.data.float()
        if p.device.type != "cpu" and (p.requires_grad or not meta_ok):
            raise L2LInputError(
                f"parameter {name} is on {p.device}; give L2L the model on the CPU (it keeps "
                "the masters in host memory and streams blocks to the device itself)"
            )


def _buffers_to_(model: nn.Module, device: torch.device) -> None:
    if device.type != "cpu":  # buffers are small (rotary frequencies, norm statistics): keep them resident
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)


def _unique(params) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


def _groups(parts: ModelParts) -> list[list[nn.Parameter]]:
    """[resident stem + head parameters, block 0's, block 1's, ...], each parameter in exactly one group."""
    groups = [_unique([*parts.stem.parameters(), *parts.head.parameters()])]
    groups += [_unique(b.parameters()) for b in parts.blocks]
    owner: dict[int, int] = {}
    for g, params in enumerate(groups):
        for p in params:
            if owner.setdefault(id(p), g) != g:
                raise L2LInputError(
                    f"a parameter is shared between block {owner[id(p)] - 1} and block {g - 1}; L2L streams "
                    "blocks separately, so only the input embedding and the output head may share weights"
                )
    return groups


def _binding(module: nn.Module, group: list[nn.Parameter]) -> Binding:
    index = {id(p): i for i, p in enumerate(group)}
    return [(name, index[id(p)]) for name, p in module.named_parameters(remove_duplicate=False)]
