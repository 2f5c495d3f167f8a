"""Linear layers whose weights are pre-packed for oneDNN, for the engine's decode steps on the CPU.

A decode step multiplies a few rows (one per running request) by every weight of the model. Through
`F.linear` the BLAS library re-packs the whole weight into its blocked layout at every call, which for a
few rows costs about as much as the product itself; the LM head (49152 x 576 in SmolLM2) is the largest
such weight. `PackedLinear` keeps one packed copy and multiplies by it with the ops that `torch.compile`'s
CPU freezing pass emits for the same purpose (`torch.ops.mkldnn._reorder_linear_weight` and
`_linear_pointwise`). Measured in `bench/serve_api.py` (an engine arm without packing); the results differ
from `F.linear`'s in the last bits (another summation order), as batched and one-at-a-time products do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROWS = (2, 64)  # packed for 2..64 rows: one row, or a long prefill, gain nothing over F.linear
MIN_SIZE = 1 << 19  # weights of fewer elements gain nothing (SmolLM2's 576 x 576 and 192 x 576 ones)
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
    packed copy of the weight, remade whenever the weight changes (another tensor, or written in place);
    everything else goes through `F.linear`."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", linear.bias)
        self._packed: torch.Tensor | None = None
        self._packed_from: tuple | None = None

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

    def packed_weight(self) -> torch.Tensor:
        w = self.weight
        source = (w.data_ptr(), w._version, tuple(w.shape))
        if source != self._packed_from:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT)
            self._packed_from = source
        return self._packed


def _linears(model: nn.Module, kind: type[nn.Linear]):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                yield parent, name, child


def pack_linears(model: nn.Module, *, min_size: int = MIN_SIZE) -> int:
    """Swap every fp32 CPU `nn.Linear` of `model` with at least `min_size` weights for a `PackedLinear` (in
    place; packs at once). Returns how many were swapped: 0 where the torch build lacks the ops. Undo with
    `unpack_linears`."""
    if not packing_available():
        return 0
    swapped = 0
    for parent, name, linear in _linears(model, nn.Linear):
        w = linear.weight
        if w.dtype == torch.float32 and w.device.type == "cpu" and w.numel() >= min_size:
            packed = PackedLinear(linear)
            packed.packed_weight()
            setattr(parent, name, packed)
            swapped += 1
    return swapped


def unpack_linears(model: nn.Module) -> int:
    """Put plain `nn.Linear` layers (the same Parameters) back where `pack_linears` swapped them."""
    swapped = 0
    for parent, name, packed in _linears(model, PackedLinear):
        plain = nn.Linear(
            packed.in_features, packed.out_features, bias=packed.bias is not None, device="meta"
        )
        plain.weight, plain.bias = packed.weight, packed.bias
        setattr(parent, name, plain)
        swapped += 1
    return swapped
