"""Prefix caching: prompts that start alike (a chat template's system prompt) skip recomputing the start.

vLLM's automatic prefix caching, for this engine's left-padded batches. After each prefill the engine
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

from ecru.serve.kv_cache import right_aligned

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
