"""Dropout: the recomputing backward replays the forward's masks, so gradients equal autograd through them."""

from __future__ import annotations

import copy
import functools

import torch
from transformers.masking_utils import create_causal_mask

from ecru.l2l import L2L, L2LConfig
from ecru.models import tiny_gpt2

from .helpers import GRAD_TOL, GradRecorder, lm_batch, named_grads

MICRO = 2


def same_masks_reference_grads(model, batch: dict, seed: int) -> dict[str, torch.Tensor]:
    """Plain autograd through GPT-2, drawing dropout masks in the engine's order: the embedding stage
    over all micro-batches, then block by block, each over all micro-batches."""
    torch.manual_seed(seed)
    t = model.transformer
    pieces = [
        {k: v[i : i + MICRO] for k, v in batch.items()} for i in range(0, len(batch["input_ids"]), MICRO)
    ]
    num_items = int((batch["labels"][:, 1:] != -100).sum())
    pos = torch.arange(batch["input_ids"].shape[1], device=batch["input_ids"].device)[None]
    hidden, masks = [], []
    for mb in pieces:
        embeds = t.wte(mb["input_ids"])
        masks.append(
            create_causal_mask(
                config=model.config,
                inputs_embeds=embeds,
                attention_mask=mb["attention_mask"],
                past_key_values=None,
                position_ids=pos,
            )
        )
        hidden.append(t.drop(embeds + t.wpe(pos)))
    for block in t.h:
        hidden = [
            block(h, attention_mask=m, use_cache=False, position_ids=pos)
            for h, m in zip(hidden, masks, strict=True)
        ]
    loss = sum(
        model.loss_function(
            model.lm_head(t.ln_f(h)),
            mb["labels"],
            vocab_size=model.config.vocab_size,
            num_items_in_batch=num_items,
        )
        for h, mb in zip(hidden, pieces, strict=True)
    )
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_dropout_gradients_equal_autograd_through_the_same_masks():
    ref = tiny_gpt2(num_layers=3, dropout=0.2).train()
    model = copy.deepcopy(ref)
    batch = lm_batch(seed=3)
    expected = same_masks_reference_grads(ref, batch, seed=11)
    log: dict[int, torch.Tensor] = {}
    engine = L2L.from_hf(
        model,
        optimizer=functools.partial(GradRecorder, log=log, lr=0.1),
        config=L2LConfig(micro_batch_size=MICRO),
    )
    torch.manual_seed(11)
    engine.step(batch)
    got = named_grads(model, log)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=lambda m, n=name: f"{n}: {m}", **GRAD_TOL)

    # the masks matter: without dropout (or with other masks) the gradients are far from these
    plain = tiny_gpt2(num_layers=3, dropout=0.2).eval()
    plain(**batch).loss.backward()
    assert (plain.lm_head.weight.grad - got["transformer.wte.weight"]).abs().max() > 1e-3


def test_recompute_leaves_the_global_random_stream_as_the_forward_left_it():
    model = tiny_gpt2(num_layers=2, dropout=0.1).train()
    engine = L2L.from_hf(
        model, optimizer=functools.partial(torch.optim.SGD, lr=0.0), config=L2LConfig(micro_batch_size=2)
    )
    torch.manual_seed(5)
    engine.step(lm_batch())
    after_l2l = torch.rand(3)
    # the forward alone (no recompute) draws the same numbers: replay forked and restored the generator
    torch.manual_seed(5)
    with torch.no_grad():
        engine._forward([mb for mb in engine.parts.split(lm_batch(), 2)])
    torch.testing.assert_close(torch.rand(3), after_l2l, atol=0, rtol=0)
