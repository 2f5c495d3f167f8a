"""Never re-encode what a frozen component already encoded: the frozen bottom layers' outputs, cached.

When adapters sit only in the top layers (`ecru`), the embeddings and the first `k` transformer layers
never change, so each text goes through them once; training and evaluation then run only the top layers
on the cached hidden states (per text, unpadded [len, H], padded again per batch).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from transformers.masking_utils import create_bidirectional_mask

from ecru.models import MiniLM
from ecru.models.minilm import mean_pool


def _bert(model: MiniLM) -> nn.Module:
    enc = model.encoder
    return enc.get_base_model() if hasattr(enc, "get_base_model") else enc


def run_layers(bert: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, layers: range) -> torch.Tensor:
    """BERT layers `layers` on `hidden` [B, L, H] with padding `mask` [B, L], as `BertModel.forward` runs them."""
    attn = create_bidirectional_mask(config=bert.config, inputs_embeds=hidden, attention_mask=mask)
    for i in layers:
        hidden = bert.encoder.layer[i](hidden, attn)
    return hidden


CACHE_ITEMS = 16_384
"""Texts whose hidden states a prefix keeps (least recently used first out): ~0.5 GB for short texts."""


class FrozenPrefix:
    """Per-text hidden states after the embeddings and layers 0..k-1 of `model` (which must stay frozen),
    for at most `max_items` texts at a time (least recently used dropped first)."""

    def __init__(self, model: MiniLM, k: int, *, max_items: int = CACHE_ITEMS):
        self.model, self.k, self.max_items = model, k, max_items
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoded = 0
        """Texts pushed through the frozen layers so far (each at most once)."""

    def __len__(self) -> int:
        return len(self._cache)

    @torch.no_grad()
    def _fill(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        # One text at a time, in eval mode: a cached state is a function of its text alone (no dropout, no
        # padding or batch-composition effects), so a run resumed from a checkpoint rebuilds identical states.
        found = {t: self._cache[t] for t in texts if t in self._cache}
        todo = list(dict.fromkeys(t for t in texts if t not in found))
        bert = _bert(self.model)
        was_training = bert.training
        bert.eval()
        for text in todo:
            batch = self.model.tokenize([text])
            embedded = bert.embeddings(
                input_ids=batch["input_ids"], token_type_ids=batch.get("token_type_ids")
            )
            found[text] = run_layers(bert, embedded, batch["attention_mask"], range(self.k))[0]
        bert.train(was_training)
        self.encoded += len(todo)
        for text in dict.fromkeys(texts):
            self._cache[text] = found[text]
            self._cache.move_to_end(text)
        while len(self._cache) > self.max_items:
            self._cache.popitem(last=False)
        return found

    def drop(self, texts: Iterable[str]) -> None:
        """Forget cached states (e.g. a finished task's training utterances)."""
        for t in texts:
            self._cache.pop(t, None)

    def __call__(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded cached hidden states [B, L, H] and their mask [B, L]."""
        found = self._fill(texts)
        rows = [found[t] for t in texts]
        mask = pad_sequence([torch.ones(len(r), dtype=torch.long) for r in rows], batch_first=True)
        return pad_sequence(rows, batch_first=True), mask


class PrefixCachedEncoder:
    """`model`'s embeddings computed from cached frozen-prefix states: differentiable call and `encode`."""

    def __init__(self, model: MiniLM, prefix: FrozenPrefix):
        self.model, self.prefix = model, prefix

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        hidden, mask = self.prefix(texts)
        bert = _bert(self.model)
        hidden = run_layers(bert, hidden, mask, range(self.prefix.k, len(bert.encoder.layer)))
        return F.normalize(mean_pool(hidden, mask), dim=-1)

    @torch.no_grad()
    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        out = [self(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)]
        self.model.train(was_training)
        return torch.cat(out) if out else torch.empty(0, _bert(self.model).config.hidden_size)
