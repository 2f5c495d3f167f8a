"""The lean recomputation of Llama layers (ecru.l2l.recompute): it skips the down projection's matmul,
and every gradient, hence the training, stays bit for bit that of the ordinary recomputation."""

from __future__ import annotations

import copy

import pytest
import torch

from ecru.l2l import L2L, L2LConfig
from ecru.l2l import hf as l2l_hf
from ecru.l2l.recompute import llama_layer_graph, replayable
from ecru.models import tiny_gpt2, tiny_llama

from .helpers import lm_batch
from .test_parity import SGD


def _layer_inputs(model, rows: int = 3, time: int = 10):
    torch.manual_seed(1)
    hidden = torch.randn(rows, time, model.config.hidden_size)
    positions = torch.arange(time).unsqueeze(0)
    context = {
        "attention_mask": None,
        "position_ids": positions,
        "position_embeddings": model.model.rotary_emb(hidden, position_ids=positions),
    }
    return hidden, context, torch.randn(rows, time, model.config.hidden_size)


def _grads(layer, hidden, context, grad_out, *, lean: bool):
    x = hidden.detach().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    if lean:
        y = llama_layer_graph(layer, x, context)
    else:
        y = layer(x, use_cache=False, **context)
    torch.autograd.backward(y, grad_out, inputs=[x, *layer.parameters()])
    return [x.grad, *(p.grad for p in layer.parameters())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_graph_gives_the_same_gradients_bit_for_bit(dtype):
    model = tiny_llama(num_layers=1, hidden_size=48, intermediate_size=96).to(dtype)
    layer = model.model.layers[0]
    assert replayable(layer)
    hidden, context, grad_out = (t.to(dtype) if torch.is_tensor(t) else t for t in _layer_inputs(model))
    context["position_embeddings"] = tuple(t.to(dtype) for t in context["position_embeddings"])
    full = _grads(layer, hidden, context, grad_out, lean=False)
    lean = _grads(layer, hidden, context, grad_out, lean=True)
    assert len(full) == len(lean) == 1 + len(list(layer.parameters()))
    for a, b in zip(full, lean, strict=True):
        assert a is not None and a.abs().sum() > 0
        assert torch.equal(a, b)


def test_only_the_exact_llama_layer_code_is_replayed():
    llama = tiny_llama(num_layers=1)
    layer = llama.model.layers[0]
    assert replayable(layer)
    for register in (  # hooks the replay would bypass
        layer.mlp.down_proj.register_forward_hook,
        layer.register_forward_pre_hook,
        layer.register_full_backward_hook,
        torch.nn.modules.module.register_module_forward_hook,
    ):
        handle = register(lambda *_: None)
        assert not replayable(layer)
        handle.remove()
        assert replayable(layer)
    biased = copy.deepcopy(layer)
    biased.mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(llama.config.hidden_size))
    assert not replayable(biased)
    assert not replayable(tiny_gpt2(num_layers=1).transformer.h[0])


def _train(*, lean: bool, micro: int, stash: str, dtype: str, name: str, calls: list):
    model = tiny_llama(num_layers=3) if name == "llama" else tiny_gpt2(num_layers=3)
    engine = L2L.from_hf(
        model, optimizer=SGD, config=L2LConfig(micro_batch_size=micro, stash=stash, compute_dtype=dtype)
    )
    engine.parts.output_unused_ok = lean
    calls.clear()
    losses = [engine.step(lm_batch(seed=s)) for s in range(3)]
    return losses, engine.state_dict()


@pytest.mark.parametrize(
    "name,micro,stash,dtype",
    [
        ("llama", 1, "device", "float32"),
        ("llama", 2, "host", "float32"),
        ("llama", 3, "device", "float32"),  # 5 samples: a last micro-batch of 2
        ("llama", 2, "device", "bfloat16"),  # binds wire copies through functional_call
        ("gpt2", 2, "device", "float32"),  # not replayable: the ordinary recomputation
    ],
)
def test_training_is_bit_identical_to_the_ordinary_recomputation(name, micro, stash, dtype, monkeypatch):
    calls: list = []

    def counted(*args):
        calls.append(1)
        return llama_layer_graph(*args)

    monkeypatch.setattr(l2l_hf, "llama_layer_graph", counted)
    ordinary = _train(lean=False, micro=micro, stash=stash, dtype=dtype, name=name, calls=calls)
    assert not calls
    lean = _train(lean=True, micro=micro, stash=stash, dtype=dtype, name=name, calls=calls)
    # every block's backward recomputes each micro-batch through the lean graph (none for GPT-2)
    assert len(calls) == (3 * 3 * -(-5 // micro) if name == "llama" else 0)
    assert lean[0] == ordinary[0]
    for key, value in ordinary[1].items():
        torch.testing.assert_close(lean[1][key], value, atol=0, rtol=0, msg=key)


def test_a_layer_whose_forward_code_differs_is_recomputed_the_ordinary_way():
    """The guard is the source of the forward, not the class: a subclass with its own forward (as a newer
    transformers would have) is not replayed, even when it computes the same thing."""
    layer = tiny_llama(num_layers=1).model.layers[0]

    class Drifted(type(layer)):
        def forward(self, hidden_states, **kwargs):
            return super().forward(hidden_states, **kwargs)

    layer.__class__ = Drifted
    assert not replayable(layer)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "olmo"])
def test_families_with_llama_layer_code_train_bit_identically_lean(name):
    """Their decoder layer and MLP forwards are Llama's code verbatim (same source hash): replayed, and
    the training stays bit for bit that of the ordinary recomputation."""
    from .helpers import tiny_family

    assert replayable(tiny_family(name, num_layers=1).model.layers[0])
    runs = []
    for lean in (False, True):
        engine = L2L.from_hf(tiny_family(name), optimizer=SGD, config=L2LConfig(micro_batch_size=2))
        engine.parts.output_unused_ok = lean
        runs.append(([engine.step(lm_batch(seed=s)) for s in range(2)], engine.state_dict()))
    assert runs[0][0] == runs[1][0]
    for key, value in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][key], value, atol=0, rtol=0, msg=key)
