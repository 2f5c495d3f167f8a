"""Hugging Face decoder-only causal LMs cut into stem, blocks and head, run by the model's own code.

Any `*ForCausalLM` whose decoder keeps its layers in one `nn.ModuleList` (Llama, GPT-2, Qwen2/3, Mistral,
Phi-3, OLMo, OLMo 2, Gemma 2/3, Cohere, Granite, StableLM, ..., and a PEFT wrapper around any of them)
works without per-family code:

- stem: the decoder's own `forward` runs with its layer list temporarily swapped for `_Capture` modules;
  each records how the decoder calls its layer (positional and keyword arguments: the mask of its
  attention kind, rotary cos/sin of its kind, positions, ...), the first one records the hidden state it
  gets (embeddings, scaling, learned positions, dropout: whatever the model does), and the last one
  stops the forward.
- block i: layer i called with exactly the arguments the decoder gave it.
- head: the causal LM's own `forward` runs with its decoder temporarily swapped for `_Finish` (the
  decoder's final norm applied to the given hidden state), so the LM head, its final transforms (logit
  softcapping, logit scale, tied weights) and its loss are the model's own.

`hf_parts` checks the cut against the model's own forward on a small padded probe batch and refuses a
model whose forward does something else between its layers. Token embeddings are looked up with sparse
gradients (the embedding's `sparse` flag, set for the stem's call only): a dense [vocab, hidden]
gradient per micro-batch costs more than the rest of the stem. The head passes `num_items_in_batch` =
the number of targets in the whole minibatch to the model, so micro-batch losses sum to the model's mean
over every label token of the minibatch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ecru.l2l.config import L2LInputError
from ecru.l2l.parts import MicroBatch, ModelParts, chunks
from ecru.l2l.recompute import llama_layer_graph, replayable

IGNORE_INDEX = -100
BATCH_KEYS = ("input_ids", "attention_mask", "labels")
_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


@dataclass
class DecoderLayout:
    """Where the pieces of a decoder-only causal LM sit, as `decoder_layout` found them."""

    lm: nn.Module
    """The `*ForCausalLM` (inside a PEFT wrapper, its base model)."""
    decoder_name: str
    """The attribute of `lm` holding the decoder (`model`, `transformer`, ...)."""
    layers_name: str
    """The attribute of the decoder holding its layer list."""
    norm: nn.Module
    """The decoder's final norm (applied after the last layer)."""

    @property
    def decoder(self) -> nn.Module:
        return getattr(self.lm, self.decoder_name)

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.decoder, self.layers_name)


def _refuse(what: str, why: str) -> L2LInputError:
    return L2LInputError(
        f"L2L.from_hf needs a decoder-only Hugging Face causal LM with its layers in one nn.ModuleList; {what} "
        f"{why}; wrap its blocks in an nn.Sequential and use L2L.from_sequential"
    )


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """The layout of `model` (a causal LM, possibly PEFT-wrapped), or an error saying what is missing."""
    lm = model.get_base_model() if hasattr(model, "peft_config") else model
    config = getattr(lm, "config", None)
    what = f"{type(lm).__name__} (model_type={getattr(config, 'model_type', None)!r})"
    if config is None or getattr(config, "is_encoder_decoder", False) or not hasattr(lm, "get_decoder"):
        raise _refuse(what, "is not one")
    if getattr(config, "add_cross_attention", False):
        raise _refuse(what, "has cross-attention")
    decoder = lm.get_decoder()
    decoder_name = next((n for n, m in lm.named_children() if m is decoder), None)
    lists = [n for n, m in decoder.named_children() if isinstance(m, nn.ModuleList)]
    norm = next(
        (getattr(decoder, n) for n in _NORMS if isinstance(getattr(decoder, n, None), nn.Module)), None
    )
    if decoder_name is None or decoder is lm:
        raise _refuse(what, "keeps no decoder module of its own")
    if len(lists) != 1:
        raise _refuse(what, f"has {len(lists)} module lists in its decoder")
    if norm is None or lm.get_output_embeddings() is None:
        raise _refuse(what, f"has no final norm ({'/'.join(_NORMS)}) or no output head")
    layout = DecoderLayout(lm=lm, decoder_name=decoder_name, layers_name=lists[0], norm=norm)
    _check_covered(layout, what)
    return layout


def _check_covered(layout: DecoderLayout, what: str) -> None:
    """Every parameter of the model sits in a child module the stem, blocks or head bind."""
    known = {id(p) for m in layout.lm.children() for p in m.parameters()}
    other = [n for n, p in layout.lm.named_parameters() if id(p) not in known]
    direct = [n for n, _ in layout.decoder.named_parameters(recurse=False)]
    if other or direct:
        raise _refuse(what, f"holds the parameters {(other + direct)[:3]} outside its child modules")


def layer_kinds(config: Any, n: int) -> list[str]:
    """The attention kind of each of `n` layers, as the model's config lists them (for stacking)."""
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


@contextmanager
def swapped(owner: nn.Module, name: str, stand_in: nn.Module) -> Iterator[None]:
    """`owner.<name>` is `stand_in` inside the block, the original again after it (also on errors)."""
    original = getattr(owner, name)
    setattr(owner, name, stand_in)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def sparse_lookups(modules: list[nn.Module]) -> Iterator[None]:
    """The embeddings among `modules` give sparse weight gradients inside the block."""
    embeddings = [m for module in modules for m in module.modules() if isinstance(m, nn.Embedding)]
    flags = [m.sparse for m in embeddings]
    for m in embeddings:
        m.sparse = True
    try:
        yield
    finally:
        for m, flag in zip(embeddings, flags, strict=True):
            m.sparse = flag


class _Stop(Exception):
    """Raised by the last `_Capture`: the decoder's work after its layers is the head's."""


@dataclass
class _Calls:
    """What the decoder's forward gave its layers: the first layer's hidden state, each layer's arguments
    besides it."""

    hidden: torch.Tensor | None = None
    args: list[tuple[tuple, dict[str, Any]]] = field(default_factory=list)


class _Capture(nn.Module):
    """Stands in for a decoder layer: records its call, passes the hidden state on unchanged. (A forward
    pre-hook sees the call too, but cannot skip the layer: the stem runs no layer.)"""

    def __init__(self, calls: _Calls, *, last: bool):
        super().__init__()
        self.calls, self.last = calls, last

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden, args = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
        if self.calls.hidden is None:
            self.calls.hidden = hidden
        self.calls.args.append((args, kwargs))
        if self.last:
            raise _Stop
        return hidden


class _Finish(nn.Module):
    """Stands in for the whole decoder: its final norm on a given hidden state, as a decoder output."""

    def __init__(self, norm: nn.Module, hidden: torch.Tensor):
        super().__init__()
        self.norm, self.hidden = norm, hidden

    def forward(self, *args: Any, **kwargs: Any):
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions as Output

        return Output(last_hidden_state=self.norm(self.hidden))  # every field a causal LM reads


def _children(module: nn.Module, *skip: nn.Module) -> nn.ModuleDict:
    return nn.ModuleDict({n: m for n, m in module.named_children() if not any(m is s for s in skip)})


class DecoderStem(nn.Module):
    """The decoder's own forward up to its first layer, with every layer's call recorded; binds the
    decoder's modules other than its layers and final norm (embeddings, rotary embeddings, ...)."""

    def __init__(self, layout: DecoderLayout):
        super().__init__()
        self.pieces = _children(layout.decoder, layout.layers, layout.norm)
        self.layout = layout

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor | None]):
        input_ids, attention_mask = inputs
        n = called_layers(self.layout)
        if n == 0:
            raise L2LInputError("the model has no decoder layers to run; add_block one before training")
        calls = _Calls()
        stand_ins = nn.ModuleList(_Capture(calls, last=i == n - 1) for i in range(n))
        decoder = self.layout.decoder
        with swapped(decoder, self.layout.layers_name, stand_ins), sparse_lookups([self.pieces]):
            try:
                decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _Stop:
                pass
        if len(calls.args) != n:
            raise L2LInputError(f"the decoder called {len(calls.args)} of its {n} layers; L2L runs them all")
        return calls.hidden, {"calls": calls.args}


def called_layers(layout: DecoderLayout) -> int:
    """How many layers the decoder's forward runs (a config may list fewer than the module list holds)."""
    n = len(layout.layers)
    return min(n, getattr(layout.lm.config, "num_hidden_layers", None) or n)


# the decoder's cache arguments; the Llama replay passes its own
_CACHE_KEYS = ("past_key_values", "past_key_value", "use_cache")


class DecoderBlock(nn.Module):
    """Decoder layer `index` called with exactly the arguments the decoder's forward gave it (recorded by
    the stem). `output_used=False` (the backward's recomputation) lets a Llama layer skip its last
    projection (ecru.l2l.recompute): same gradients, but the returned value is not the layer's output."""

    def __init__(self, layer: nn.Module, index: int):
        super().__init__()
        self.layer, self.index = layer, index

    def forward(
        self, hidden: torch.Tensor, context: dict[str, Any], *, output_used: bool = True
    ) -> torch.Tensor:
        args, kwargs = context["calls"][self.index]
        if not output_used and not args and replayable(self.layer):
            kw = {k: v for k, v in kwargs.items() if k not in _CACHE_KEYS}
            return llama_layer_graph(self.layer, hidden, kw)
        out = self.layer(hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class CausalLMHead(nn.Module):
    """The causal LM's own forward after its decoder (final norm, LM head, final logit transforms, loss),
    with the decoder standing aside; binds the LM's modules other than the decoder, and the final norm."""

    def __init__(self, layout: DecoderLayout):
        super().__init__()
        self.pieces = _children(layout.lm, layout.decoder)
        self.norm, self.layout = layout.norm, layout

    def run(self, hidden: torch.Tensor, **kwargs: Any):
        with swapped(self.layout.lm, self.layout.decoder_name, _Finish(self.norm, hidden)):
            return self.layout.lm(use_cache=False, **kwargs)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.run(hidden).logits

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, num_items: int) -> torch.Tensor:
        return self.run(hidden, labels=labels, num_items_in_batch=num_items).loss


class Logits(nn.Module):
    """The head's logits alone, a module of its own for `functional_call`."""

    def __init__(self, head: CausalLMHead):
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden)


def hf_parts(model: nn.Module, *, verify: bool = True) -> ModelParts:
    """The stem/blocks/head view of a decoder-only causal LM (checked against the model's own forward
    on a probe batch when `verify`), or an error saying why it does not fit."""
    layout = decoder_layout(model)
    config, layers = layout.lm.config, layout.layers

    def append(layer: nn.Module) -> nn.Module:
        # the config lists the new layer's attention kind (its own where it records one), so the
        # decoder's forward builds its mask and rotary embeddings for it
        kind = own_kind(layer) or layer_kinds(config, len(layers) + 1)[-1]
        layers.append(layer)
        if hasattr(config, "num_hidden_layers"):
            config.num_hidden_layers = len(layers)
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = [*list(config.layer_types)[: len(layers) - 1], kind]
            if hasattr(layout.decoder, "has_sliding_layers"):  # Qwen2 & co. derive it once, at __init__
                layout.decoder.has_sliding_layers = "sliding_attention" in config.layer_types
        return DecoderBlock(layer, len(layers) - 1)

    vocab = config.vocab_size
    head = CausalLMHead(layout)
    parts = ModelParts(
        kind="hf",
        model=model,
        stem=DecoderStem(layout),
        blocks=[DecoderBlock(layers[i], i) for i in range(called_layers(layout))],
        head=head,
        split=lambda batch, size: split_lm_batch(batch, size, vocab_size=vocab),
        logits=Logits(head),
        count=count_targets,
        append=append,
        output_unused_ok=True,
    )
    if verify and parts.blocks and not any(p.is_meta for p in model.parameters()):
        check_against_forward(parts, layout)  # (a model built empty, read in place, has no forward to run)
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
        weight = layout.lm.get_input_embeddings().weight
        device = weight.device
        batch = {k: v.to(device) for k, v in batch.items()}
        want = lm(**batch, use_cache=False).logits.float()
        got = cut_logits(parts, batch["input_ids"], batch["attention_mask"]).float()
    finally:
        for m, training in modes.items():
            m.training = training
    real = batch["attention_mask"].bool()
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    scale = float(want[real].abs().max()) or 1.0
    err = float((got[real] - want[real]).abs().max())
    if not err <= tol * scale:
        raise L2LInputError(
            f"L2L.from_hf cut {type(lm).__name__} into embeddings, layers, norm and head, but that "
            f"differs from the model's own forward (max logit error {err:.3g}): its forward does more "
            "between its layers than calling them in turn; use L2L.from_sequential with your own blocks"
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
