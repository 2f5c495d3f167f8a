"""`L2L`: layer-to-layer training (Pudipeddi et al., arXiv 2002.05645) from an eager parameter server.

One `step`:
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
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.profiler import record_function

from ecru.l2l.collectives import Collectives, data_parallel_group
from ecru.l2l.config import L2LConfig, L2LInputError, check_device
from ecru.l2l.parts import ForwardOutput, MicroBatch, ModelParts
from ecru.l2l.rng import RngState, capture, replay
from ecru.l2l.scaling import LossScale
from ecru.l2l.stash import ActivationStash
from ecru.l2l.store import OptimizerFactory, ParameterStore, Store
from ecru.l2l.workspace import Workspace

RESIDENT = 0  # group of the stem and head; block i is group i + 1
Binding = list[tuple[str, int]]  # (parameter name in the piece, index in its group)
# a kept block's autograd leaves (index in its group -> weight) and, per micro-batch, (input leaf or None, output)
KeptGraphs = tuple[dict[int, torch.Tensor], list[int], list[tuple[torch.Tensor | None, torch.Tensor | None]]]


class L2L:
    """Trains `parts.model` in place: its parameters are the fp32 masters of the parameter server."""

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
        _fp32_masters_(self.model, frozen=self.config.store != "disk")
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
        self._rng: dict[tuple[int, int], RngState] = {}
        self._kept: dict[int, KeptGraphs] = {}  # block -> its kept forward graphs (keep_graph_blocks)
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
        self._current_order = order
        micro = [
            mb.to(self.device, self.config.dtype)
            for mb in self.parts.split(batch, self.config.micro_batch_size)
        ]
        share = self._rank_share(micro)
        before = (torch.get_rng_state(), dataclasses.replace(self.scaler) if self.scaler else None)
        try:
            loss = self._step(micro, order, share)
            self.store.extra = {"rng": torch.get_rng_state()}  # committed with the step where durable
            self.store.end_step(self.steps + 1)
        except BaseException:
            # all or nothing: masters, optimizer states, loss scale and RNG as before the step
            self.store.rollback()
            torch.set_rng_state(before[0])
            self.scaler = before[1]
            raise
        finally:
            self.stash.clear()
            self._rng.clear()
            self._kept.clear()
            self.store.discard_grads()
        self.steps += 1
        for scheduler in self._schedulers:  # after end_step: no update is in flight
            scheduler.step()
        return self._global_loss(loss * share)

    def _step(self, micro: list[MicroBatch], order: list[int], share: float) -> float:
        # torch.profiler spans ("l2l.*"): bench/experiments/l2l_profile.py reads the phases from them
        scale = self.scaler.scale if self.scaler else 1.0
        with record_function("l2l.forward"):
            hidden, contexts = self._forward(micro, order)
        with record_function("l2l.head"):
            grads, loss = self._head(hidden, micro, scale * share)
        self.store.begin("backward", [i + 1 for i in reversed(order)])
        for k in reversed(range(len(order))):
            with record_function("l2l.backward.block"):
                grads = self._backward_block(order[k], grads, contexts, first=k == 0)
        with record_function("l2l.backward.stem"):
            self._backward_stem(micro, grads)
        with record_function("l2l.finish_update"):
            self._finish_update(scale)
        return loss

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

    def _forward(
        self, micro: list[MicroBatch], order: list[int] | None = None
    ) -> tuple[list[torch.Tensor], list[Any]]:
        order = list(range(len(self.parts.blocks))) if order is None else order
        stem = self.store.weights(RESIDENT)
        hidden, contexts = [], []
        for j, mb in enumerate(micro):
            self._rng[(RESIDENT, j)] = capture(self._rng_devices)
            with torch.no_grad():
                h, ctx = self.run_stem(stem, mb.inputs)
            hidden.append(h)
            contexts.append(ctx)
        self.store.begin("forward", [i + 1 for i in order])
        keep = order[len(order) - min(self.config.keep_graph_blocks, len(order)) :]
        for pos, i in enumerate(order):
            weights = self.store.weights(i + 1)
            for nxt in order[pos + 1 : pos + 1 + self.config.prefetch]:
                self.store.prefetch(nxt + 1)
            if i in keep:
                hidden = self._forward_kept(i, weights, hidden, contexts, first=pos == 0)
                self.store.done_with(i + 1)
                continue
            outputs = []
            for j, x in enumerate(hidden):
                self._rng[(i + 1, j)] = capture(self._rng_devices)
                self.stash.put(i, j, x)
                with torch.no_grad(), record_function("l2l.block.forward"):
                    outputs.append(self.run_block(i, weights, x, contexts[j]))
            self.store.done_with(i + 1)
            hidden = outputs
        return hidden, contexts

    def _forward_kept(
        self,
        i: int,
        weights: list[torch.Tensor],
        hidden: list[torch.Tensor],
        contexts: list[Any],
        *,
        first: bool,
    ) -> list[torch.Tensor]:
        """Block `i` over every micro-batch under autograd, keeping each graph for the backward. Nothing is
        stashed and no RNG state captured: the graph holds the input and its own dropout masks, and the
        forward draws exactly what the no-grad forward would, so later blocks' masks are unchanged."""
        binding = self._block_bindings[i]
        leaves, trainable = self._leaves(binding, weights, i + 1)
        if not self.store.binds_masters:  # device weights sit in reused slots / wire buffers: keep a copy
            leaves = {idx: w.detach().clone().requires_grad_(idx in trainable) for idx, w in leaves.items()}
        needs_input = not first or self._stem_trains
        graphs, outputs = [], []
        for j, x in enumerate(hidden):
            if needs_input and x.is_floating_point():
                x = x.detach().requires_grad_()
            with torch.enable_grad():
                y = self.run_block(i, leaves, x, contexts[j])
            graphs.append((x if x.requires_grad else None, y) if y.requires_grad else (None, None))
            outputs.append(y.detach())
        self._kept[i] = (leaves, trainable, graphs)
        return outputs

    def _head(self, hidden: list[torch.Tensor], micro: list[MicroBatch], scale: float):
        """Each micro-batch's weighted loss and its gradient w.r.t. the last hidden state and the head."""
        weights, indices = self._leaves(self._bindings["head"], self.store.weights(RESIDENT), RESIDENT)
        grads, total = [], torch.zeros((), dtype=torch.float32, device=self.device)
        for j, mb in enumerate(micro):
            x = hidden[j].detach().requires_grad_()
            hidden[j] = None
            with torch.enable_grad():
                loss = self.run_head(weights, x, mb)
                grads.append(self._grad(RESIDENT, loss * scale, None, x, weights, indices))
            total += loss.detach().float()
        return grads, float(total)

    def _backward_block(
        self, i: int, grads: list[torch.Tensor], contexts: list[Any], *, first: bool
    ) -> list[torch.Tensor]:
        g = i + 1
        kept = self._kept.pop(i, None)
        if kept:
            weights, trainable, graphs = kept
        else:
            weights, trainable = self._leaves(self._block_bindings[i], self.store.weights(g), g)
        for below in self._below(i):
            self.store.prefetch(below + 1)
        for j, grad_out in enumerate(grads):
            if kept:
                (x, y), graphs[j] = graphs[j], (None, None)  # free each graph as soon as it has run
            else:
                x, y = self._recompute(i, j, weights, contexts[j], first=first, trains=bool(trainable))
            if y is None:
                continue
            with torch.enable_grad():
                grad_in = self._grad(g, y, grad_out, x, weights, trainable)
            if x is not None:
                grads[j] = grad_in
        self.store.done_with(g)
        if trainable:
            self._submit(g)
        return grads

    def _recompute(
        self, i: int, j: int, weights: dict[int, torch.Tensor], context: Any, *, first: bool, trains: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Block `i`'s forward of micro-batch `j` again, from its stash under the forward's RNG state, with
        autograd: (the input leaf if its gradient is needed, else None; the output), or (None, None) when
        nothing needs a gradient."""
        x = self.stash.pop(i, j)
        needs_input = (not first or self._stem_trains) and x.is_floating_point()
        if needs_input:
            x = x.detach().requires_grad_()
        if not needs_input and not trains:
            return None, None
        # y is only backpropagated through, never read: the block may skip what only its value needs
        kwargs = {"output_used": False} if self.parts.output_unused_ok else None
        with replay(self._rng[(i + 1, j)]), torch.enable_grad(), record_function("l2l.recompute"):
            y = self.run_block(i, weights, x, context, kwargs=kwargs, fresh_buffers=True)
        return (x if needs_input else None), y

    def _backward_stem(self, micro: list[MicroBatch], grads: list[torch.Tensor]) -> None:
        binding = self._bindings["stem"]
        if self._stem_trains:
            weights, indices = self._leaves(binding, self.store.weights(RESIDENT), RESIDENT)
            if self.store.grads_in_params:  # embeddings give sparse gradients: add them to a dense one
                for idx in indices:
                    if weights[idx].grad is None:
                        weights[idx].grad = torch.zeros_like(weights[idx])
            for j, mb in enumerate(micro):
                with replay(self._rng[(RESIDENT, j)]), torch.enable_grad():
                    h, _ = self.run_stem(weights, mb.inputs, fresh_buffers=True)
                    self._grad(RESIDENT, h, grads[j], None, weights, indices)
        self.store.done_with(RESIDENT)
        if self.store.groups[RESIDENT].trainable:
            self._submit(RESIDENT)

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

    def _below(self, i: int) -> list[int]:
        """The blocks whose backward follows block `i`'s in the current step (for prefetching)."""
        order = self._current_order
        k = order.index(i)
        return order[max(0, k - self.config.prefetch) : k][::-1]

    def _submit(self, g: int) -> None:
        self.store.collect(g) if self.config.deferred_update else self.store.update(g)

    def _finish_update(self, scale: float) -> None:
        if self.config.deferred_update:
            finite, self.last_grad_norm = self.store.step_all(
                inv_scale=1.0 / scale, max_norm=self.config.max_grad_norm
            )
            if self.scaler is not None:
                self.scaler.update(finite=finite)
        # step() returns with the model updated: only the tail (block 1, stem/head) is exposed here
        self.store.synchronize()

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
        return self._call(
            self.parts.stem, self._bindings["stem"], weights, (inputs,), fresh_buffers=fresh_buffers
        )

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
            block, binding, weights, (hidden, context), kwargs=kwargs, fresh_buffers=fresh_buffers
        )

    def run_head(self, weights, hidden: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
        """The head's weighted loss of one micro-batch from the last `hidden` state (resident `weights`)."""
        args = (hidden, micro.targets, micro.weight)
        return self._call(self.parts.head, self._bindings["head"], weights, args)

    def run_logits(self, weights, hidden: torch.Tensor) -> torch.Tensor:
        """The model's outputs (logits) from the last `hidden` state; the parts must define `logits`."""
        if self.parts.logits is None:
            raise L2LInputError("these model parts define no logits: read the hidden state instead")
        return self._call(self.parts.logits, self._bindings["logits"], weights, (hidden,))

    def _call(
        self,
        module: nn.Module,
        binding: Binding,
        weights,
        args: tuple,
        *,
        kwargs: dict[str, Any] | None = None,
        fresh_buffers: bool = False,
    ):
        """`module(*args, **kwargs)` with its parameters bound to `weights` (a sequence or an index ->
        tensor dict) through `functional_call`; when the masters are the device weights, they are the
        module's own parameters already and only buffers are bound. A recomputation gets copies of the
        buffers, so running statistics are updated once, in the forward."""
        bound = {} if self.store.binds_masters else {name: weights[idx] for name, idx in binding}
        if fresh_buffers:
            bound.update({name: b.clone() for name, b in module.named_buffers()})
        if bound:
            return functional_call(module, bound, args, kwargs)
        return module(*args, **(kwargs or {}))

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict (the fp32 masters); the original model loads it with strict=True. On the
        disk tier it is read from disk into new tensors (O(model) memory)."""
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


def _fp32_masters_(model: nn.Module, *, frozen: bool = True) -> None:
    """Trainable parameters (and with `frozen` the others too) as fp32 masters on the CPU; without
    `frozen` (the disk tier) frozen ones stay as they are, meta device included (ecru.l2l.disk)."""
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise L2LInputError(f"parameter {name} is {p.dtype}; L2L trains floating-point parameters only")
        if not (frozen or p.requires_grad):
            continue
        if p.dtype != torch.float32:  # the masters are fp32 whatever the compute precision
            p.data = p.data.float()
        if p.device.type != "cpu":
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
