"""A leaner recomputation of Llama decoder layers for the backward (gradients bit-identical).

The backward recomputes each block only to backpropagate through it: the output's value is never read
(it equals the next block's stashed input), only its graph. In a Llama layer the output is
`residual + down_proj(act)`; the sum's backward needs no values and the projection's backward needs
only `act` and the weight, so the projection's matmul (a quarter of the layer's weight FLOPs) is wasted.
`llama_layer_graph` replays `LlamaDecoderLayer.forward` with that projection replaced by
`LinearGradOnly`, whose forward computes nothing and whose backward runs the very matmuls autograd runs
for `F.linear`, so every gradient is bit for bit the one of the full forward. It applies only where the
layer runs exactly that code (`replayable`); anything else recomputes the ordinary way.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Any

import torch
from torch import nn


class LinearGradOnly(torch.autograd.Function):
    """`F.linear(x, weight)` (no bias) for a graph that is only backpropagated through: the forward skips
    the matmul and returns zeros; the backward is autograd's for `F.linear` on a contiguous input
    (`matmul` folds x to 2-D: grad_x = grad @ W, grad_W = grad^T @ x), the same mm calls on the same
    layouts, hence the same bits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x.new_zeros(()).expand(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad2d.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = grad2d.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


# sha256 (first 16 hex digits) of the source of `LlamaDecoderLayer.forward` and `LlamaMLP.forward` in
# transformers 5.x, the code `llama_layer_graph` replays: a layer whose forward has other source (a newer
# transformers, another family) recomputes the ordinary way. Families that copy Llama's code verbatim
# (Mistral, Qwen2, Qwen3, OLMo in 5.23) match too.
LAYER_SOURCE, MLP_SOURCE = "75d1d62e173e8c57", "03df2d7685cf8446"


@functools.cache
def source_hash(fn) -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def replayable(layer: nn.Module) -> bool:
    """Whether `llama_layer_graph` reproduces `layer`'s graph: its forward and its MLP's are Llama's own
    code (by source hash), a bias-free `nn.Linear` down projection, and no module hooks that the replay
    would bypass."""
    mlp = getattr(layer, "mlp", None)
    down = getattr(mlp, "down_proj", None)
    return (
        source_hash(type(layer).forward) == LAYER_SOURCE
        and source_hash(type(mlp).forward) == MLP_SOURCE
        and type(down) is nn.Linear
        and down.bias is None
        and not _has_hooks(layer, mlp, down)
    )


_HOOKS = ("forward_hooks", "forward_pre_hooks", "backward_hooks", "backward_pre_hooks")


def _has_hooks(*modules: nn.Module) -> bool:
    """Module hooks on `modules` or registered globally (the replay calls neither `layer` nor `down_proj`)."""
    from torch.nn.modules import module as torch_module

    if any(getattr(torch_module, f"_global_{kind}", None) for kind in _HOOKS):
        return True
    return any(getattr(m, f"_{kind}", None) for m in modules for kind in _HOOKS)


def llama_layer_graph(layer: nn.Module, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
    """`layer(hidden, use_cache=False, **context)` as `LlamaDecoderLayer.forward` (transformers 5.x) runs
    it, with the same graph and gradients but an output whose value is wrong (the down projection's
    contribution is zero): for a recomputation that only backpropagates."""
    residual = hidden
    h = layer.input_layernorm(hidden)
    h, _ = layer.self_attn(hidden_states=h, past_key_values=None, use_cache=False, **context)
    h = residual + h
    residual = h
    h = layer.post_attention_layernorm(h)
    mlp = layer.mlp
    act = mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h)
    return residual + LinearGradOnly.apply(act, mlp.down_proj.weight)
