"""Linear layers whose weights are pre-packed for oneDNN, for the engine's decode steps on the CPU.

A decode step multiplies a few rows (one per running request) by every weight of the model. Through
`F.linear` the BLAS library re-packs the whole weight into its blocked layout at every call, which for a
few rows costs about as much as the product itself; the LM head (49152 x 576 in SmolLM2) is the largest
such weight. `PackedLinear` keeps one packed copy and multiplies by it with oneDNN's packed linear ops
(`torch.ops.mkldnn._reorder_linear_weight` and `_linear_pointwise`, which PyTorch's inductor uses for
packed CPU linear layers). Measured in `bench/serve_api.py` (an engine arm on plain layers); the results
differ from `F.linear`'s in the last bits (another summation order), as batched and one-at-a-time products
do.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

ROWS = (2, 64)  # packed for 2..64 rows: one row, or a long prefill, gain nothing over F.linear
# every SmolLM2 weight (bench/experiments/serve_packed_matmul.py --in-model); not LoRA's small ones
MIN_SIZE = 1 << 16
PACK_HINT = 16  # the row count oneDNN chooses the packed layout for


def packing_available() -> bool:
    """Whether this torch build has the oneDNN ops `PackedLinear` needs."""
    try:
        ops = torch.ops.mkldnn
        return torch.backends.mkldnn.is_available() and all(
            callable(getattr(ops, name)) for name in ("_reorder_linear_weight", "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Linear):
    """An `nn.Linear` sharing its weight and bias Parameters with the layer it wraps (state dict, tied
    weights and training unchanged). Forward without autograd on 2-64 fp32 rows on the CPU multiplies by a
    packed copy of the weight; everything else goes through `F.linear`. The copy is remade when the weight
    is replaced or written in place through autograd-visible ops (`copy_`, `load_state_dict`); writes
    through `.data` are not seen: call `pack_linears_` again after them. Copies and pickles leave the
    packed copy behind (it is remade on first use)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", linear.bias)
        self.train(linear.training)
        self.repack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not self._packable(x, rows):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight(), self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def _packable(self, x: torch.Tensor, rows: int) -> bool:
        w = self.weight
        return (
            ROWS[0] <= rows <= ROWS[1]
            and x.dtype == w.dtype == torch.float32
            and x.device.type == w.device.type == "cpu"
            and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
        )

    def repack(self) -> None:
        """Forget the packed copy; the next packed product makes a fresh one."""
        self._packed: torch.Tensor | None = None
        self._source: tuple[torch.Tensor, int] | None = None

    def packed_weight(self) -> torch.Tensor:
        w = self.weight
        version = 0 if w.is_inference() else w._version
        # the packed-from tensor is held, so a replaced weight can never reuse its address unnoticed
        if self._source is None or self._source[0].data_ptr() != w.data_ptr() or self._source[1] != version:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT)
            self._source = (w.detach(), version)
        return self._packed

    def __getstate__(self) -> dict:
        # the packed copy is an opaque oneDNN tensor without storage: neither copied nor pickled
        return {**self.__dict__, "_packed": None, "_source": None}


def _linears(model: nn.Module, kind: type[nn.Linear]):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                yield parent, name, child


def _packable_layer(linear: nn.Linear, min_size: int) -> bool:
    w = linear.weight
    hooked = linear._forward_hooks or linear._forward_pre_hooks  # e.g. accelerate's: kept as they are
    return w.dtype == torch.float32 and w.device.type == "cpu" and w.numel() >= min_size and not hooked


def pack_linears_(model: nn.Module, *, min_size: int = MIN_SIZE) -> int:
    """Swap every fp32 CPU `nn.Linear` of `model` with at least `min_size` weights (and no hooks) for a
    `PackedLinear`, in place, packing at once; layers already packed are packed afresh. Returns how many
    layers are packed: 0 where the torch build lacks the ops or packing fails (with a warning; the model
    is left plain). Undo with `unpack_linears_`."""
    if not packing_available():
        return 0
    try:
        for parent, name, linear in _linears(model, nn.Linear):
            if _packable_layer(linear, min_size):
                setattr(parent, name, PackedLinear(linear))
        for packed in packed_layers(model):
            packed.repack()
            packed.packed_weight()  # now, not in the first request
    except RuntimeError as exc:
        log.warning("could not pack the linear layers (%s); running on plain ones", exc)
        unpack_linears_(model)
        return 0
    return len(packed_layers(model))


def unpack_linears_(model: nn.Module) -> int:
    """Put plain `nn.Linear` layers (the same Parameters) back where `pack_linears_` swapped them."""
    swapped = 0
    for parent, name, packed in _linears(model, PackedLinear):
        plain = nn.Linear(
            packed.in_features, packed.out_features, bias=packed.bias is not None, device="meta"
        )
        plain.weight, plain.bias = packed.weight, packed.bias
        plain.train(packed.training)
        setattr(parent, name, plain)
        swapped += 1
    return swapped


def packed_layers(model: nn.Module) -> list[PackedLinear]:
    """The model's `PackedLinear` layers."""
    return [m for m in model.modules() if type(m) is PackedLinear]


def packed_bytes(model: nn.Module) -> int:
    """The memory the packed copies add: their weights' bytes."""
    return sum(m.weight.numel() * m.weight.element_size() for m in packed_layers(model))
