"""`L2LConfig`: how the layer-to-layer engine places, streams and updates a model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ecru.errors import EcruError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
STASH_PLACES = ("device", "host", "disk")
STORES = ("ram", "disk")


class L2LInputError(EcruError, ValueError):
    """A bad configuration, model or batch; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class L2LConfig:
    """Placement and schedule of an `L2L` engine; validated on construction."""

    micro_batch_size: int = 1
    """Samples per micro-batch; a minibatch is cut into ceil(B / micro_batch_size), the last may be smaller."""
    device: str = "cpu"
    """Where the blocks execute ("cpu", "cuda", "cuda:1"); the fp32 masters always stay on the host."""
    compute_dtype: str = "float32"
    """Wire and compute precision: float32, bfloat16 or float16 (float16 adds dynamic loss scaling)."""
    stash: str = "device"
    """Where block inputs wait for the backward: "device" (fast), "host" (device memory flat in depth) or
    "disk" (files under `store_dir`/stash: host memory flat in depth too)."""
    prefetch: int = 1
    """Blocks whose weights are copied to the device ahead of the executing one (CUDA only)."""
    max_grad_norm: float | None = None
    """Global gradient clipping. It needs every gradient before the first update, so the host optimizer
    steps wait for the whole backward instead of overlapping with it."""
    max_pending_updates: int = 2
    """Block updates that may queue behind the backward before it waits (bounds host gradient buffers)."""
    store: str = "ram"
    """Where the fp32 masters and optimizer states live: "ram" (host memory, O(model)) or "disk" (one file
    pair per block under `store_dir`, read ahead and written behind; host memory O(a few blocks))."""
    store_dir: str | None = None
    """Folder of the disk tier (required with store="disk"); an existing store there is resumed from its
    last complete step."""
    frozen_weights: str | None = None
    """Disk tier: a Hugging Face model folder whose safetensors hold the parameters the model has on the
    meta device (a frozen base built by ecru.l2l.frozen.empty_model): each is read from there, in place and
    in its own dtype, when its block is used, and never copied into the store."""
    fsync: bool = True
    """Disk tier: fsync every block file before the step's manifest is committed (durable across power
    loss; a crashed process is safe either way because files are renamed into place)."""
    data_parallel: bool = True
    """When torch.distributed runs several ranks: start from rank 0's weights and all-reduce each block's
    gradient before its host update (every rank trains on its shard; the result equals one process on
    the concatenated batch). False leaves the ranks independent."""
    shard_optimizer: bool = False
    """Data parallel, ZeRO-1 style: each block's optimizer state lives on one rank (round robin), which
    receives the reduced gradient, updates the block and broadcasts its weights at the end of the step
    (optimizer memory / world_size; the broadcasts are not overlapped). RAM tier only."""
    keep_graph_blocks: int = 0
    """Selective recomputation, memory for speed: the last k blocks of a step (the first ones the backward
    needs) run their forward under autograd and keep its graph per micro-batch, so their backward skips the
    recomputation. Those graphs hold every activation autograd saves inside the k blocks for ALL
    micro-batches at once (several times the block inputs the stash keeps, and on the device whatever
    `stash` says), plus, when the device weights are not the fp32 masters themselves (CUDA or low
    precision), a device copy of the k blocks' weights. 0: recompute every block; k >= the number of
    blocks keeps them all. Not with store="disk" (it evicts masters)."""
    rollback: bool = False
    """RAM tier: make every step all or nothing by copying each group's trainable masters and optimizer
    state aside before its update (host memory up to the whole trainable training state again; cheap for
    LoRA). Without it a step that fails after some blocks were updated keeps those updates (with a
    warning). The disk tier always rolls a failed step back (its committed files are the snapshot)."""
    loss_scale: float = 2.0**16
    """Initial dynamic loss scale (float16 only)."""
    loss_scale_growth_interval: int = 2000
    """Steps without overflow before the loss scale doubles (float16 only)."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale (float16 only): overflows never halve it below this."""

    def __post_init__(self) -> None:
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            raise L2LInputError(f"micro_batch_size must be an integer >= 1, got {self.micro_batch_size!r}")
        if self.compute_dtype not in DTYPES:
            raise L2LInputError(
                f"compute_dtype {self.compute_dtype!r} is unknown; use one of {sorted(DTYPES)}"
            )
        if self.stash not in STASH_PLACES:
            raise L2LInputError(f"stash must be one of {STASH_PLACES}, got {self.stash!r}")
        if self.prefetch < 0:
            raise L2LInputError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise L2LInputError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if (
            not isinstance(self.keep_graph_blocks, int)
            or isinstance(self.keep_graph_blocks, bool)
            or self.keep_graph_blocks < 0
        ):
            raise L2LInputError(f"keep_graph_blocks must be an integer >= 0, got {self.keep_graph_blocks!r}")
        if self.keep_graph_blocks and self.store == "disk":
            raise L2LInputError(
                'keep_graph_blocks needs store="ram": the disk tier evicts a block\'s masters '
                "after use, while a kept graph would hold them until the backward"
            )
        if self.max_pending_updates < 1:
            raise L2LInputError(f"max_pending_updates must be >= 1, got {self.max_pending_updates}")
        if not self.loss_scale > 0 or self.loss_scale_growth_interval < 1:
            raise L2LInputError("loss_scale must be > 0 and loss_scale_growth_interval >= 1")
        if not 0 < self.min_loss_scale <= self.loss_scale:
            raise L2LInputError(
                f"min_loss_scale must be in (0, loss_scale={self.loss_scale}], got {self.min_loss_scale}"
            )
        if self.store not in STORES:
            raise L2LInputError(f"store must be one of {STORES}, got {self.store!r}")
        if self.store == "disk" and not self.store_dir:
            raise L2LInputError('store="disk" needs store_dir=, a folder for the block files')
        if self.frozen_weights is not None and self.store != "disk":
            raise L2LInputError('frozen_weights (a folder read in place) needs store="disk"')
        if self.stash == "disk" and not self.store_dir:
            raise L2LInputError('stash="disk" needs store_dir=, a folder for the stashed activations')
        if self.store == "disk" and self.deferred_update:
            raise L2LInputError(
                'store="disk" updates each block as soon as its gradient is ready; max_grad_norm and float16 '
                "loss scaling need every gradient first (the whole model in RAM): use bfloat16 and no clipping"
            )
        if self.shard_optimizer and (self.store == "disk" or self.deferred_update):
            raise L2LInputError(
                "shard_optimizer works on the RAM tier without clipping or float16 loss scaling"
            )
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise L2LInputError(
                f"device {self.device!r} is not a device name; use e.g. 'cpu' or 'cuda:0'"
            ) from exc

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.compute_dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def deferred_update(self) -> bool:
        """Whether the updates wait for the whole backward (clipping, or overflow checks under float16)."""
        return self.max_grad_norm is not None or self.dtype == torch.float16


def check_device(device: torch.device) -> torch.device:
    """`device` if it exists on this machine, else a clear error; "cuda" resolves to the current index."""
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise L2LInputError(f"device type {device.type!r} is not supported; use 'cpu' or 'cuda'")
    if not torch.cuda.is_available():
        raise L2LInputError(f"device {device} requested but CUDA is not available here; use device='cpu'")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise L2LInputError(
            f"device {device} does not exist: this machine has {torch.cuda.device_count()} GPU(s)"
        )
    return torch.device("cuda", index)
