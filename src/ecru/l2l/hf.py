"""Hugging Face decoder-only causal LMs cut into stem, blocks and head, found generically.

Any `*ForCausalLM` whose decoder runs "embeddings -> a list of decoder layers -> final norm -> LM head"
works (Llama, Qwen2, Qwen3, Mistral, Phi-3, OLMo, GPT-2, ..., and a PEFT wrapper around any of them):
`decoder_layout` finds the token embedding, learned position embedding and embedding dropout (GPT-2
style), rotary embedding, layer list, final norm and head by what the model exposes; any parameter
outside those pieces makes it refuse. The stem replays what the decoder's own `forward` does around the
layers (transformers 5.x): positions 0..T-1, one mask per attention kind built by transformers' own
`create_causal_mask` / `create_sliding_window_causal_mask` (per `config.layer_types` where the config
has them, else sliding-window when `config.sliding_window` is set), rotary cos/sin once per micro-batch.
`hf_parts` then checks the cut against the model's own forward on a small padded probe batch and
refuses a model whose forward does something else (a scaled embedding, soft-capped logits, ...).

Token (and learned position) embeddings are looked up with sparse gradients: a dense [vocab, hidden]
gradient per micro-batch costs more than the rest of the stem. The head calls the model's own
`loss_function` with `num_items_in_batch` = the number of targets in the whole minibatch, so
micro-batch losses sum to the model's mean over every label token of the minibatch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ecru.l2l.config import L2LInputError
from ecru.l2l.parts import MicroBatch, ModelParts, chunks
from ecru.l2l.recompute import llama_layer_graph, replayable

IGNORE_INDEX = -100
BATCH_KEYS = ("input_ids", "attention_mask", "labels")
_LAYERS, _NORMS = ("layers", "h", "blocks"), ("norm", "ln_f", "final_layernorm", "final_layer_norm")
_POSITIONS, _DROPOUTS = ("wpe", "embed_positions"), ("drop", "embed_dropout")


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


@dataclass
class DecoderLayout:
    """The pieces of a decoder-only causal LM, as `decoder_layout` found them."""

    lm: nn.Module
    """The `*ForCausalLM` (inside a PEFT wrapper, its base model)."""
    embed: nn.Embedding
    positions: nn.Embedding | None
    dropout: nn.Module | None
    rotary: nn.Module | None
    layers: nn.ModuleList
    norm: nn.Module
    head: nn.Module


def _child(module: nn.Module, names: tuple[str, ...], kind: type | tuple[type, ...]) -> Any:
    return next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), kind)), None)


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """The layout of `model` (a causal LM, possibly PEFT-wrapped), or an error saying what is missing."""
    lm = model.get_base_model() if hasattr(model, "peft_config") else model
    config = getattr(lm, "config", None)
    what = f"{type(lm).__name__} (model_type={getattr(config, 'model_type', None)!r})"
    if config is None or getattr(config, "is_encoder_decoder", False) or not hasattr(lm, "get_decoder"):
        raise L2LInputError(
            f"L2L.from_hf needs a decoder-only Hugging Face causal LM, got {what}; for another model, wrap "
            "its blocks in an nn.Sequential and use L2L.from_sequential"
        )
    decoder = lm.get_decoder()
    layout = DecoderLayout(
        lm=lm,
        embed=lm.get_input_embeddings(),
        positions=_child(decoder, _POSITIONS, nn.Embedding),
        dropout=_child(decoder, _DROPOUTS, nn.Dropout),
        rotary=getattr(decoder, "rotary_emb", None),
        layers=_child(decoder, _LAYERS, nn.ModuleList),
        norm=_child(decoder, _NORMS, nn.Module),
        head=lm.get_output_embeddings(),
    )
    missing = [k for k in ("embed", "layers", "norm", "head") if getattr(layout, k) is None]
    if missing or not isinstance(layout.embed, nn.Embedding):
        raise L2LInputError(
            f"L2L.from_hf cannot find the {', '.join(missing) or 'token embedding'} of {what}; it needs a "
            f"decoder with an embedding, a layer list ({'/'.join(_LAYERS)}), a final norm "
            f"({'/'.join(_NORMS)}) and an output head; use L2L.from_sequential for other models"
        )
    _check_covered(layout, what)
    return layout


def _check_covered(layout: DecoderLayout, what: str) -> None:
    """Every parameter of the model belongs to a piece the stem, blocks or head runs."""
    pieces = (layout.embed, layout.positions, layout.layers, layout.norm, layout.head)
    known = {id(p) for m in pieces if m is not None for p in m.parameters()}
    other = [n for n, p in layout.lm.named_parameters() if id(p) not in known]
    if other:
        raise L2LInputError(
            f"L2L.from_hf does not know where {what} uses the parameters {other[:3]} (outside the "
            "embeddings, layers, final norm and head); use L2L.from_sequential for this model"
        )
    if getattr(layout.lm.config, "add_cross_attention", False):
        raise L2LInputError(f"{what} has cross-attention; L2L.from_hf trains decoder-only models")


def layer_kinds(config: Any, n: int) -> list[str]:
    """The attention kind of each of `n` layers, as the model's forward picks its mask."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds[:n]) + [kinds[-1]] * max(0, n - len(kinds))
    sliding = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * n


def own_kind(layer: nn.Module) -> str | None:
    """The attention kind a layer recorded from its config (`layer_type` / `attention_type` on the layer
    or its `self_attn`), if any."""
    for module in (layer, getattr(layer, "self_attn", None)):
        for name in ("layer_type", "attention_type"):
            kind = getattr(module, name, None)
            if isinstance(kind, str):
                return kind
    return None


class DecoderStem(nn.Module):
    """Embeddings (+ learned positions, dropout), one mask per attention kind and rotary cos/sin."""

    def __init__(self, layout: DecoderLayout, kinds: set[str]):
        super().__init__()
        self.embed_tokens, self.wpe, self.drop = layout.embed, layout.positions, layout.dropout
        self.rotary_emb, self.kinds = layout.rotary, sorted(kinds)
        self.config = layout.lm.config

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor | None]):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        input_ids, attention_mask = inputs
        hidden = embed(self.embed_tokens, input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        kw = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=positions,
        )
        make = {"sliding_attention": create_sliding_window_causal_mask}
        masks = {kind: make.get(kind, create_causal_mask)(**kw) for kind in self.kinds}
        if self.wpe is not None:
            hidden = hidden + embed(self.wpe, positions)
        if self.drop is not None:
            hidden = self.drop(hidden)
        context = {"masks": masks, "position_ids": positions}
        if self.rotary_emb is not None:
            with torch.no_grad():
                context["position_embeddings"] = self.rotary_emb(hidden, position_ids=positions)
        return hidden, context


class DecoderBlock(nn.Module):
    """One decoder layer called the way its model calls it (no cache), with the mask of its kind.
    `output_used=False` (the backward's recomputation) lets a Llama layer skip its last projection
    (ecru.l2l.recompute): same gradients, but the returned value is not the layer's output."""

    def __init__(self, layer: nn.Module, kind: str = "full_attention"):
        super().__init__()
        self.layer, self.kind = layer, kind

    def forward(
        self, hidden: torch.Tensor, context: dict[str, Any], *, output_used: bool = True
    ) -> torch.Tensor:
        kw = {k: v for k, v in context.items() if k != "masks"}
        kw["attention_mask"] = context["masks"][self.kind]
        if not output_used and replayable(self.layer):
            return llama_layer_graph(self.layer, hidden, kw)
        out = self.layer(hidden, use_cache=False, **kw)
        return out[0] if isinstance(out, tuple) else out


class Logits(nn.Module):
    """The head's logits alone (final norm + LM head), a module of its own for `functional_call`."""

    def __init__(self, head: CausalLMHead):
        super().__init__()
        self.norm, self.lm_head = head.norm, head.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class CausalLMHead(nn.Module):
    """Final norm, LM head and the model's own causal-LM loss, summed and divided by `num_items`."""

    def __init__(self, layout: DecoderLayout):
        super().__init__()
        self.norm, self.lm_head = layout.norm, layout.head
        self.loss_function, self.vocab_size = layout.lm.loss_function, layout.lm.config.vocab_size

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, num_items: int) -> torch.Tensor:
        logits = self.logits(hidden)
        return self.loss_function(logits, labels, vocab_size=self.vocab_size, num_items_in_batch=num_items)


def hf_parts(model: nn.Module, *, verify: bool = True) -> ModelParts:
    """The stem/blocks/head view of a decoder-only causal LM (checked against the model's own forward
    on a probe batch when `verify`), or an error saying why it does not fit."""
    layout = decoder_layout(model)
    config = layout.lm.config
    n = min(len(layout.layers), getattr(config, "num_hidden_layers", None) or len(layout.layers))
    kinds = layer_kinds(config, n)
    layers = layout.layers

    def append(layer: nn.Module) -> nn.Module:
        # the new layer's own attention kind where it records one (Qwen2, Qwen3: from its config)
        kind = own_kind(layer) or layer_kinds(config, len(layers) + 1)[-1]
        layers.append(layer)
        if hasattr(config, "num_hidden_layers"):
            config.num_hidden_layers = len(layers)
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = [*list(config.layer_types)[: len(layers) - 1], kind]
        parts.stem.kinds = sorted({*parts.stem.kinds, kind})
        return DecoderBlock(layer, kind)

    vocab = config.vocab_size
    head = CausalLMHead(layout)
    parts = ModelParts(
        kind="hf",
        model=model,
        stem=DecoderStem(layout, set(kinds)),
        blocks=[DecoderBlock(layers[i], kinds[i]) for i in range(n)],
        head=head,
        split=lambda batch, size: split_lm_batch(batch, size, vocab_size=vocab),
        logits=Logits(head),
        count=count_targets,
        append=append,
        output_unused_ok=True,
    )
    if verify:
        check_against_forward(parts, layout)
    return parts


def count_targets(micro: list[MicroBatch]) -> float:
    """Target tokens of a minibatch (labels after the shift by one that are not ignored)."""
    return float(sum(int((mb.targets[:, 1:] != IGNORE_INDEX).sum()) for mb in micro))


def probe_batch(vocab: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two rows of 12 tokens, the second right-padded: masks, positions and padding all show."""
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def cut_logits(parts: ModelParts, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Logits of the stem, blocks and head run one after the other (no engine, the model's own weights)."""
    hidden, context = parts.stem((input_ids, mask))
    for block in parts.blocks:
        hidden = block(hidden, context)
    return parts.head.logits(hidden)


@torch.no_grad()
def check_against_forward(parts: ModelParts, layout: DecoderLayout) -> None:
    """Refuse a model whose own forward (eval mode) gives other logits than the cut, at real positions."""
    lm, modes = layout.lm, {m: m.training for m in layout.lm.modules()}
    lm.eval()
    try:
        batch = probe_batch(lm.config.vocab_size)
        device = layout.embed.weight.device
        batch = {k: v.to(device) for k, v in batch.items()}
        want = lm(**batch, use_cache=False).logits.float()
        got = cut_logits(parts, batch["input_ids"], batch["attention_mask"]).float()
    finally:
        for m, training in modes.items():
            m.training = training
    real = batch["attention_mask"].bool()
    tol = 1e-4 if layout.embed.weight.dtype == torch.float32 else 2e-2
    scale = float(want[real].abs().max()) or 1.0
    err = float((got[real] - want[real]).abs().max())
    if not err <= tol * scale:
        raise L2LInputError(
            f"L2L.from_hf cut {type(lm).__name__} into embeddings, layers, norm and head, but that "
            f"differs from the model's own forward (max logit error {err:.3g}): its forward does more "
            "than the generic decoder does; use L2L.from_sequential with your own blocks"
        )


def split_lm_batch(batch: Mapping[str, torch.Tensor], size: int, *, vocab_size: int) -> list[MicroBatch]:
    """Validate a causal-LM batch and cut it into micro-batches of `size` rows. A batch without any target
    token is cut too (a data-parallel shard may have none); the engine refuses a minibatch whose ranks
    together have none."""
    input_ids, labels, mask = _check_lm_batch(batch, vocab_size=vocab_size)
    num_items = int((labels[:, 1:] != IGNORE_INDEX).sum())  # HF shifts labels left by one
    pieces = chunks((input_ids, mask, labels), size)
    # max(.., 1): a shard without targets has a zero loss sum; dividing it by 1 keeps it zero, not NaN
    return [MicroBatch((ids, m), lab, max(num_items, 1)) for ids, m, lab in pieces]


def _check_lm_batch(batch: Any, *, vocab_size: int):
    if not isinstance(batch, Mapping):
        raise L2LInputError(
            f"a causal-LM batch is a dict with input_ids and labels, got {type(batch).__name__}"
        )
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise L2LInputError(
            f"the batch has keys {unknown} that L2L does not use; it reads only {list(BATCH_KEYS)} "
            "(positions are 0..T-1 per row, as the model computes them without position_ids): drop them"
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
