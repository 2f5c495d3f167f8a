"""The serving engine's KV cache: Hugging Face's `DynamicCache` with spare columns per layer.

`DynamicLayer.update` concatenates the new keys and values onto the whole layer at every decode step, a
copy of the entire cache per generated token (about a tenth of a 16-row SmolLM2 decode step on one CPU
thread at 70 cached positions, growing with them). `HeadroomLayer` writes them into a preallocated buffer
with `headroom` spare columns and exposes `keys`/`values` as views of it, so the copy happens once per
`headroom` steps. The values are the same, and so are the model's outputs.

Everything else stays Hugging Face's: the engine keeps replacing `keys`/`values` when rows leave or
batches merge (`batch_select_indices`, padding, concatenation); the layer notices at its next update (its
`keys` are no longer its own view) and copies them once into a fresh buffer.

Prefix caching (`PrefixStore`), vLLM's automatic prefix caching for this engine's left-padded batches: prompts
that start alike (a chat template's system prompt) skip recomputing the start. After each prefill the engine
keeps every row's KV in a small LRU store keyed by its tokens. A new prompt looks up the stored sequence
sharing its longest prefix; a group of prompts prefilled together then computes only the tokens after
the cached parts, with the cached keys and values copied in front of them. Rows keep the engine's
layout, left padding only: the group's new tokens are the last `new` positions of every row (`new` = the
most any row must compute), so a row with a longer cached prefix recomputes the difference. Keys were
computed at the same positions from the same tokens, so the outputs are those of a full prefill, up to
float rounding of a different batch shape (greedy outputs are checked equal in the tests).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

HEADROOM = 32
"""Spare columns allocated per row beyond those held: the memory over `EngineStats.peak_kv_tokens`."""


class HeadroomLayer(DynamicLayer):
    """A `DynamicLayer` appending into a buffer with spare columns instead of concatenating."""

    def __init__(self, headroom: int = HEADROOM, **kwargs):
        super().__init__(**kwargs)
        self.headroom = headroom
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.keys.shape[-2] if self.keys.numel() else 0
        end = held + key_states.shape[-2]
        stale = self._views is None or self.keys is not self._views[0] or self.values is not self._views[1]
        if stale or end > self._room[0].shape[-2]:
            self._room = (
                with_room(self.keys, key_states, held, end + self.headroom),
                with_room(self.values, value_states, held, end + self.headroom),
            )
        for buf, states in zip(self._room, (key_states, value_states), strict=True):
            buf[:, :, held:end] = states
        self.keys, self.values = (buf[:, :, :end] for buf in self._room)
        self._views = (self.keys, self.values)
        return self.keys, self.values


def with_room(old: torch.Tensor, like: torch.Tensor, held: int, capacity: int) -> torch.Tensor:
    """A [B, H, capacity, D] buffer (B, H, D and dtype of `like`) starting with `old`'s `held` columns."""
    b, h, _, d = like.shape
    buf = like.new_empty(b, h, capacity, d)
    if held:
        buf[:, :, :held] = old
    return buf


WHOLE_CONTEXT = ("full_attention", "sliding_attention")
"""Layer types whose KV the engine keeps whole: a sliding window is the model's own mask over it (Hugging Face
masks by the config's `sliding_window`, index against index, which is position against position in a row that
is left padding then tokens). Hugging Face's sliding layer keeps only the window: its columns are not the batch's
columns, so rows could not join, leave or be padded, and a kept KV would be cut."""


class HeadroomCache(DynamicCache):
    """`DynamicCache(config=...)` whose full-attention and sliding-window layers are `HeadroomLayer`s
    (`WHOLE_CONTEXT`; other special layers, e.g. chunked or linear attention, stay Hugging Face's own)."""

    def __init__(self, config, *, headroom: int = HEADROOM):
        super().__init__(config=config)
        kinds, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        self.layers = [
            HeadroomLayer(headroom) if kind in WHOLE_CONTEXT and isinstance(ly, DynamicLayer) else ly
            for kind, ly in zip(kinds, self.layers, strict=True)
        ]


def row_kv(cache, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row `row`'s last `length` cached positions, copied out of every layer of `cache`: one
    ([heads, length, dim] keys, values) pair per layer."""
    return [(ly.keys[row, :, -length:].clone(), ly.values[row, :, -length:].clone()) for ly in cache.layers]


def right_aligned(parts: list[torch.Tensor | None], width: int) -> torch.Tensor:
    """[rows, heads, width, dim]: row r holds `parts[r]` ([heads, n, dim]) in its last n positions after zero
    (masked) padding; a None part is all padding. At least one part is a tensor."""
    like = next(p for p in parts if p is not None)
    out = like.new_zeros(len(parts), like.shape[0], width, like.shape[-1])
    for r, part in enumerate(parts):
        if part is not None and part.shape[-2]:
            out[r, :, width - part.shape[-2] :] = part
    return out


def stack_rows(
    config, rows: Sequence[list[tuple[torch.Tensor, torch.Tensor]]]
) -> tuple[torch.Tensor, HeadroomCache]:
    """One left-padded batch from rows of cached KV (each `row_kv`'s output, no padding): its attention mask
    [B, T] and a cache for a model of `config` holding every row right-aligned."""
    lengths = [row[0][0].shape[-2] for row in rows]
    width = max(lengths)
    mask = torch.stack([F.pad(torch.ones(n, dtype=torch.long), (width - n, 0)) for n in lengths])
    cache = HeadroomCache(config)
    for i in range(len(cache.layers)):
        cache.update(*(right_aligned([row[i][part] for row in rows], width) for part in (0, 1)), i)
    return mask, cache


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero-pad `t` on the left of dimension `dim` (-1 or -2) up to `width`."""
    return F.pad(t, (0, 0) * (-dim - 1) + (width - t.shape[dim], 0))


class RunningBatch:
    """The running batch: request ids, pending (not yet cached) tokens, attention mask, KV cache."""

    def __init__(self, model):
        self.ids: list[int] = []
        self.pending = torch.empty(0, dtype=torch.long)
        self.mask = torch.empty(0, 0, dtype=torch.long)
        self.cache = HeadroomCache(model.config)

    def merge(self, ids: list[int], pending: torch.Tensor, mask: torch.Tensor, cache) -> None:
        if not self.ids:
            self.ids, self.pending, self.mask, self.cache = ids, pending, mask, cache
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width, -2), _pad_left(new.keys, width, -2)])
            old.values = torch.cat([_pad_left(old.values, width, -2), _pad_left(new.values, width, -2)])
        self.mask = torch.cat([_pad_left(self.mask, width, -1), _pad_left(mask, width, -1)])
        self.ids, self.pending = self.ids + ids, torch.cat([self.pending, pending])

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (a bool mask), then drop cache columns that are padding in every row.

        Nothing is copied when every row stays: re-indexing would copy the whole KV cache at every
        decode step, a cost of the order of the step's own attention.
        """
        if not bool(rows.all()):
            self.select(rows.nonzero().flatten())

    def select(self, index: torch.Tensor) -> None:
        """Keep rows `index` (positions, in that order), then drop the columns that are padding in every
        row."""
        if index.tolist() == list(range(len(self.ids))):
            return  # nothing would change; re-indexing would copy the whole cache
        self.ids = [self.ids[i] for i in index.tolist()]
        self.pending, self.mask = self.pending[index], self.mask[index]
        if not self.ids:
            return
        first = int(self.mask.any(0).nonzero()[0])
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index, :, first:], layer.values[index, :, first:]


@dataclass
class KeptRow:
    """One waiting request's cached KV (per layer, [heads, positions, head_dim] keys and values) and its
    pending token."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    pending: int
    """Its newest token (the first, sampled at arrival; a preempted row's last), not yet in the cache."""

    @property
    def length(self) -> int:
        return self.kv[0][0].shape[-2]


class KeptKV:
    """The KV rows of waiting requests prefilled on arrival or preempted by cb-srpt, by request key, without
    padding (exactly their cached positions: the prompt, and for a preempted row its tokens but the newest).
    Which requests keep theirs is the scheduler's call (`Scheduler.kept`, at most `arrival_kv_requests`); at
    admission the kept rows are left-padded and stacked into one cache (`stack_rows`), with no forward."""

    def __init__(self):
        self.rows: dict[int, KeptRow] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: int) -> bool:
        return key in self.rows

    @property
    def tokens(self) -> int:
        """KV positions held (the kept rows have no padding)."""
        return sum(r.length for r in self.rows.values())

    def keep(self, key: int, cache, row: int, length: int, *, pending: int) -> None:
        """Copy row `row` of a left-padded `cache` (its last `length` positions are the request's cached ones)."""
        self.rows[key] = KeptRow(row_kv(cache, row, length), pending)

    def drop(self, key: int) -> None:
        self.rows.pop(key, None)

    def take(self, model, keys: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, object]:
        """Remove the rows of `keys` and stack them as a running batch's pieces: pending tokens [B], a
        left-padded attention mask [B, T] and a KV cache for `model`."""
        rows = [self.rows.pop(k) for k in keys]
        mask, cache = stack_rows(model.config, [r.kv for r in rows])
        return torch.tensor([r.pending for r in rows]), mask, cache


MIN_PREFIX = 16
"""Shortest prefix worth reusing, in tokens (below, the copy and bookkeeping cost more than they save)."""


@dataclass(frozen=True)
class PrefixHit:
    """A prompt's longest stored prefix: `length` tokens of stored entry `key` (0: none), whose per-layer
    keys and values `kv` it holds (an entry evicted after the lookup stays usable)."""

    length: int = 0
    key: tuple[int, ...] = ()
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, compare=False, repr=False)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixStore:
    """An LRU store of per-layer KV [heads, tokens, dim] of recently prefilled sequences, by tokens."""

    def __init__(self, capacity: int, *, min_prefix: int = MIN_PREFIX):
        if capacity < 1 or min_prefix < 1:
            raise ValueError(f"capacity and min_prefix must be >= 1, got {capacity} and {min_prefix}")
        self.capacity, self.min_prefix = capacity, min_prefix
        self._entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """KV positions held (per layer): the store's memory, next to the running batch's cache."""
        return sum(len(key) for key in self._entries)

    def lookup(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest stored prefix of `tokens`, leaving at least its last token to compute."""
        best = PrefixHit()
        for key in self._entries:
            n = min(common_prefix(tokens, key), len(tokens) - 1)
            if n >= self.min_prefix and n > best.length:
                best = PrefixHit(n, key, self._entries[key])
        if best.length:
            self._entries.move_to_end(best.key)
        return best

    def insert(self, tokens: Sequence[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store `tokens`' keys and values (one [heads, len(tokens), dim] pair per layer)."""
        key = tuple(tokens)
        self._entries[key] = layers
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def prefix_kv(
        self, hits: Sequence[PrefixHit], cached: Sequence[int], layer: int
    ) -> tuple[torch.Tensor, ...]:
        """Keys and values [rows, heads, max(cached), dim] of one layer: row r's first `cached[r]` stored
        positions right-aligned after zero (masked) padding."""
        return tuple(
            right_aligned(
                [h.kv[layer][part][:, :c] if c else None for h, c in zip(hits, cached, strict=True)],
                max(cached),
            )  # fmt: skip
            for part in (0, 1)
        )
