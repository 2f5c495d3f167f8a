"""Hugging Face decoder-only causal LMs (Llama family, GPT-2) cut into stem, blocks and head.

The stem and head replay what `LlamaModel.forward` / `GPT2Model.forward` do around the decoder layers
(transformers 5.x): positions 0..T-1 for every micro-batch, `create_causal_mask` from the micro-batch's
attention mask (so padding and the sdpa `None`-means-causal shortcut behave as in the model), rotary
cos/sin computed once per micro-batch. Token (and GPT-2 position) embeddings are looked up with sparse
gradients: the stem's backward runs once per micro-batch, and a dense [vocab, hidden] gradient per
micro-batch (zeroed, scattered, then added to the accumulator) cost more than the rest of the stem; the
sparse one is added into the accumulator row by row, with the same sums. The head calls the model's own `loss_function` with
`num_items_in_batch` = the number of targets in the whole minibatch, so micro-batch losses sum to the
model's mean over every label token of the minibatch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ecru.l2l.config import L2LInputError
from ecru.l2l.parts import MicroBatch, ModelParts, chunks
from ecru.l2l.recompute import llama_layer_graph, replayable

SUPPORTED = ("llama", "gpt2")
IGNORE_INDEX = -100


def embed(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """`module(ids)` with a sparse weight gradient (only the rows of `ids`), whatever `module.sparse` says."""
    return F.embedding(
        ids,
        module.weight,
        module.padding_idx,
        module.max_norm,
        module.norm_type,
        module.scale_grad_by_freq,
        sparse=True,
    )


class LlamaStem(nn.Module):
    """Token embeddings, causal/padding mask and rotary cos/sin of a Llama-family model."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.embed_tokens, self.rotary_emb = model.model.embed_tokens, model.model.rotary_emb
        self.config = model.config

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor | None]):
        from transformers.masking_utils import create_causal_mask

        input_ids, attention_mask = inputs
        hidden = embed(self.embed_tokens, input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=positions,
        )
        with torch.no_grad():
            cos_sin = self.rotary_emb(hidden, position_ids=positions)
        context = {"attention_mask": mask, "position_ids": positions, "position_embeddings": cos_sin}
        return hidden, context


class GPT2Stem(nn.Module):
    """Token + learned position embeddings, causal/padding mask and embedding dropout of GPT-2."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = model.transformer.wte, model.transformer.wpe, model.transformer.drop
        self.config = model.config

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor | None]):
        from transformers.masking_utils import create_causal_mask

        input_ids, attention_mask = inputs
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        embeds = embed(self.wte, input_ids)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=positions,
        )
        hidden = self.drop(embeds + embed(self.wpe, positions))
        return hidden, {"attention_mask": mask, "position_ids": positions}


class DecoderBlock(nn.Module):
    """One decoder layer called the way its model calls it (no cache). `output_used=False` (the backward's
    recomputation) lets a Llama layer skip its last projection (ecru.l2l.recompute): same gradients,
    but the returned value is not the layer's output."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(
        self, hidden: torch.Tensor, context: dict[str, Any], *, output_used: bool = True
    ) -> torch.Tensor:
        if not output_used and replayable(self.layer):
            return llama_layer_graph(self.layer, hidden, context)
        out = self.layer(hidden, use_cache=False, **context)
        return out[0] if isinstance(out, tuple) else out


class CausalLMHead(nn.Module):
    """Final norm, LM head and the model's own causal-LM loss, summed and divided by `num_items`."""

    def __init__(self, model: nn.Module, norm: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, model.lm_head
        self.loss_function, self.vocab_size = model.loss_function, model.config.vocab_size

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, num_items: int) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        return self.loss_function(logits, labels, vocab_size=self.vocab_size, num_items_in_batch=num_items)


def hf_parts(model: nn.Module) -> ModelParts:
    """The stem/blocks/head view of a supported causal LM, or an error naming what is supported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == "llama" and hasattr(model, "model") and hasattr(model, "lm_head"):
        stem, layers, norm = LlamaStem(model), model.model.layers, model.model.norm
    elif model_type == "gpt2" and hasattr(model, "transformer") and hasattr(model, "lm_head"):
        if model.config.add_cross_attention:
            raise L2LInputError("GPT-2 with cross-attention is not supported by L2L.from_hf")
        stem, layers, norm = GPT2Stem(model), model.transformer.h, model.transformer.ln_f
    else:
        raise L2LInputError(
            f"L2L.from_hf does not understand {type(model).__name__} (model_type={model_type!r}); supported: "
            f"causal LMs of the families {SUPPORTED} (e.g. LlamaForCausalLM, GPT2LMHeadModel). For another "
            "model, wrap its blocks in an nn.Sequential and use L2L.from_sequential"
        )
    vocab = model.config.vocab_size

    def append(layer: nn.Module) -> nn.Module:
        layers.append(layer)
        if hasattr(model.config, "num_hidden_layers"):
            model.config.num_hidden_layers = len(layers)
        if getattr(model.config, "layer_types", None) is not None and len(model.config.layer_types) < len(
            layers
        ):
            model.config.layer_types = [*model.config.layer_types, model.config.layer_types[-1]]
        return DecoderBlock(layer)

    return ModelParts(
        kind="hf",
        model=model,
        stem=stem,
        blocks=[DecoderBlock(layer) for layer in layers],
        head=CausalLMHead(model, norm),
        split=lambda batch, size: split_lm_batch(batch, size, vocab_size=vocab),
        count=lambda micro: float(micro[0].weight),
        append=append,
        output_unused_ok=True,
    )


def split_lm_batch(batch: Mapping[str, torch.Tensor], size: int, *, vocab_size: int) -> list[MicroBatch]:
    """Validate a causal-LM batch and cut it into micro-batches of `size` rows."""
    input_ids, labels, mask = _check_lm_batch(batch, vocab_size=vocab_size)
    num_items = int((labels[:, 1:] != IGNORE_INDEX).sum())  # HF shifts labels left by one
    if num_items == 0:
        raise L2LInputError("the batch has no target token: every label (after the shift by one) is -100")
    pieces = chunks((input_ids, mask, labels), size)
    return [MicroBatch((ids, m), lab, num_items) for ids, m, lab in pieces]


def _check_lm_batch(batch: Any, *, vocab_size: int):
    if not isinstance(batch, Mapping):
        raise L2LInputError(
            f"a causal-LM batch is a dict with input_ids and labels, got {type(batch).__name__}"
        )
    if "labels" not in batch or batch["labels"] is None:
        raise L2LInputError(
            "the batch has no 'labels'; add labels = input_ids with -100 at padding positions (the model "
            "shifts them by one itself)"
        )
    if "input_ids" not in batch:
        raise L2LInputError("the batch has no 'input_ids'")
    input_ids, labels, mask = batch["input_ids"], batch["labels"], batch.get("attention_mask")
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise L2LInputError(
            f"input_ids must be a [batch, time] int64 tensor, got {tuple(input_ids.shape)} {input_ids.dtype}"
        )
    for name, t in (("labels", labels), ("attention_mask", mask)):
        if t is not None and tuple(t.shape) != tuple(input_ids.shape):
            raise L2LInputError(
                f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(input_ids.shape)}"
            )
    if input_ids.numel() == 0:
        raise L2LInputError("the batch is empty")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
        raise L2LInputError(f"input_ids must lie in [0, {vocab_size}) (the model's vocabulary)")
    valid = labels[labels != IGNORE_INDEX]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab_size):
        raise L2LInputError(f"labels must lie in [0, {vocab_size}) or be {IGNORE_INDEX} (ignored)")
    return input_ids, labels, mask
