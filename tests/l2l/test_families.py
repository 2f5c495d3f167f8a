"""`L2L.from_hf` on decoder families beyond Llama and GPT-2, run by each model's own code: parity with
plain training (logits, loss, gradients, optimizer steps), generic guards."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from ecru.l2l import L2L, L2LConfig, L2LInputError
from ecru.l2l.hf import cut_logits, hf_parts, layer_kinds

from .helpers import (
    FAMILIES,
    GRAD_TOL,
    GradRecorder,
    assert_params_close,
    lm_batch,
    named_grads,
    reference_step,
    tiny_family,
)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_training_matches_plain(name):
    """3 SGD steps, micro-batches of 2 (5 padded rows of 12 tokens, sliding windows of 4-5 tokens). The absolute
    tolerance is 1e-6, or twice the plain model's own rounding noise after the same steps where that is larger:
    a twin trained on the same batches with their rows reversed (equal in exact arithmetic; OLMo 2's QK norms
    amplify rounding to ~2e-6 on some CPUs). A wrong update moves a parameter by ~lr x grad, orders more."""
    ref = tiny_family(name)
    twin = copy.deepcopy(ref)
    engine = L2L.from_hf(copy.deepcopy(ref), optimizer=SGD, config=L2LConfig(micro_batch_size=2))
    opt, twin_opt = SGD(ref.parameters()), SGD(twin.parameters())
    for step in range(3):
        batch = lm_batch(seed=step)
        assert engine.step(batch) == pytest.approx(reference_step(ref, opt, batch), rel=1e-6, abs=0)
        reference_step(twin, twin_opt, {k: v.flip(0) for k, v in batch.items()})
    noise = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), twin.parameters(), strict=True))
    assert_params_close(ref, engine.state_dict(), atol=max(1e-6, 2 * noise), rtol=1e-5)
    assert (ref.lm_head.weight - tiny_family(name).lm_head.weight).abs().max() > 1e-3  # it moved


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_logits_loss_and_gradients_equal_plain(name):
    """Forward logits (eval), the loss and every parameter's gradient of one L2L step (train mode,
    micro-batches of 2) against the plain model's in fp32."""
    ref = tiny_family(name, tie=name in ("gemma2", "gemma3", "cohere"))
    log: dict[int, torch.Tensor] = {}
    model = copy.deepcopy(ref)
    engine = L2L.from_hf(
        model,
        optimizer=functools.partial(GradRecorder, log=log, lr=0.1),
        config=L2LConfig(micro_batch_size=2),
    )
    batch = lm_batch(seed=5)
    out = engine.forward(batch)
    want = ref(**batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(out.outputs[real], want.logits[real], atol=1e-5, rtol=1e-5)
    assert out.loss == pytest.approx(want.loss.item(), rel=1e-6, abs=0)
    want.loss.backward()
    engine.step(batch)
    got = named_grads(model, log)
    for param_name, p in ref.named_parameters():
        torch.testing.assert_close(
            got[param_name], p.grad, msg=lambda m, n=param_name: f"{n}: {m}", **GRAD_TOL
        )


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_family_adamw_bf16_wire_close_to_plain(name):
    """bfloat16 compute with fp32 masters against fp32 plain AdamW: close, not equal (bf16 rounding)."""
    ref = tiny_family(name, tie=True)
    engine = L2L.from_hf(
        copy.deepcopy(ref), optimizer=ADAMW, config=L2LConfig(micro_batch_size=3, compute_dtype="bfloat16")
    )
    opt = ADAMW(ref.parameters())
    for step in range(2):
        batch = lm_batch(seed=step)
        assert engine.step(batch) == pytest.approx(reference_step(ref, opt, batch), rel=2e-2)


def test_each_layer_gets_the_arguments_of_its_kind():
    """Gemma 3 (sliding, sliding, full): the stem records each layer's own mask and rotary embeddings;
    swapping two layers' recorded calls changes the logits, so the comparison can fail."""
    model = tiny_family("gemma3")
    assert layer_kinds(model.config, 3) == ["sliding_attention", "sliding_attention", "full_attention"]
    parts = hf_parts(model)
    batch = lm_batch(seed=3)
    want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    got = cut_logits(parts, batch["input_ids"], batch["attention_mask"])
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    parts.blocks[0].index, parts.blocks[2].index = 2, 0
    wrong = cut_logits(parts, batch["input_ids"], batch["attention_mask"])
    assert (wrong[real] - want[real]).abs().max() > 1e-3


def test_a_forward_that_does_more_than_the_cut_is_refused():
    """A decoder whose forward rescales its output after the final norm: the head runs only the norm."""
    model = tiny_family("mistral")
    decoder = model.model
    original = decoder.forward

    def rescaled(*args, **kw):
        out = original(*args, **kw)
        out.last_hidden_state = out.last_hidden_state * 3.0
        return out

    decoder.forward = rescaled
    with pytest.raises(L2LInputError, match="differs from the model's own forward"):
        L2L.from_hf(model, optimizer=SGD)


def test_a_model_that_is_not_a_decoder_stack_is_refused():
    import transformers

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    with pytest.raises(L2LInputError, match="decoder-only Hugging Face causal LM"):
        L2L.from_hf(transformers.BertForMaskedLM(config), optimizer=SGD)
    with pytest.raises(L2LInputError, match="decoder-only Hugging Face causal LM"):
        L2L.from_hf(nn.Linear(2, 2), optimizer=SGD)


def test_a_parameter_outside_the_known_pieces_is_refused():
    model = tiny_family("olmo")
    model.model.extra = nn.Parameter(torch.zeros(2))
    with pytest.raises(L2LInputError, match="outside its child modules"):
        L2L.from_hf(model, optimizer=SGD)


def test_unknown_batch_keys_are_refused():
    engine = L2L.from_hf(tiny_family("qwen3"), optimizer=SGD)
    batch = lm_batch()
    batch["position_ids"] = torch.arange(12).expand(5, 12)
    with pytest.raises(L2LInputError, match=r"\['position_ids'\]"):
        engine.step(batch)


def test_progressive_stacking_from_zero_layers_equals_the_stacked_model():
    """add_block on a 0-layer Qwen2 (layer 0 full attention, later ones sliding): each appended layer
    gets its own mask kind and training equals plain training of the stacked model."""
    full = tiny_family("qwen2", num_layers=3)
    empty = tiny_family("qwen2", num_layers=0)
    empty.load_state_dict(full.state_dict(), strict=False)
    engine = L2L.from_hf(empty, optimizer=SGD, config=L2LConfig(micro_batch_size=2))
    for layer in full.model.layers:
        engine.add_block(copy.deepcopy(layer))
    assert layer_kinds(engine.model.config, 3) == layer_kinds(full.config, 3)
    opt = SGD(full.parameters())
    for step in range(2):
        batch = lm_batch(seed=step)
        assert engine.step(batch) == pytest.approx(reference_step(full, opt, batch), rel=1e-6, abs=0)
    assert_params_close(full, engine.state_dict(), atol=1e-6, rtol=1e-5)
