"""Categorical tokens -> per-field ids, as columnar operations on a chunk's distinct tokens.

Every token is first turned into a 64-bit key: a token of up to 8 bytes is its bytes read big-endian
(zero-padded on the right), so sorting keys sorts tokens (Criteo's 8-hex-digit hashes always take this
exact path); a longer token is its 64-bit FNV-1a hash with the top bit set (a collision between two long
tokens of one field has probability ~n^2 / 2^64). The empty token has key 0 and always maps to id 0.

An `Encoder` maps keys to ids in one of two ways:
- `HashingEncoder`: id = splitmix64(key) mod (buckets - 1) + 1 (id 0 kept for the empty token);
- `VocabularyEncoder`: per field a sorted array of keys and their ids (1..); unknown keys get the
  out-of-vocabulary id 0. `VocabularyBuilder` builds it in one streaming pass: ids are handed out provisionally in order of
  first appearance, counted, and renumbered at the end (tokens in sorted order, rarer than `min_count` -> 0).

Lookups run on each chunk's distinct tokens (`pyarrow.compute.dictionary_encode`), then one gather maps
every row: a chunk of n rows with u distinct tokens costs O(n + u log V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)
_TOP = np.uint64(1 << 63)


def token_keys(tokens: pa.Array) -> np.ndarray:
    """64-bit keys (uint64) of a binary/string array without nulls (see the module docstring)."""
    tokens = tokens.cast(pa.large_binary())
    offsets = np.frombuffer(tokens.buffers()[1], dtype=np.int64)[
        tokens.offset : tokens.offset + len(tokens) + 1
    ]
    data = (
        np.frombuffer(tokens.buffers()[2], dtype=np.uint8) if tokens.buffers()[2] else np.zeros(1, np.uint8)
    )
    starts, lengths = offsets[:-1], np.diff(offsets)
    width = int(lengths.max(initial=0))
    cols = np.arange(max(width, 8))
    present = cols[None, :] < lengths[:, None]
    raw = np.where(present, data[np.minimum(starts[:, None] + cols, len(data) - 1)], 0).astype(np.uint64)
    shifts = np.arange(56, -8, -8, dtype=np.uint64)
    keys = (raw[:, :8] << shifts).sum(1, dtype=np.uint64)  # disjoint bytes: the sum is the big-endian OR
    long = lengths > 8
    if long.any():
        h = np.full(int(long.sum()), _FNV_OFFSET, dtype=np.uint64)
        for j in range(width):  # FNV-1a over the bytes present
            h = np.where(present[long, j], (h ^ raw[long, j]) * _FNV_PRIME, h)
        keys[long] = h | _TOP
    return keys


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: spreads keys that differ in a few bits over all 64."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def dictionary(column: pa.Array | pa.ChunkedArray) -> pa.DictionaryArray:
    """The column as distinct tokens + row indices (a no-op if it is already dictionary-encoded)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column if isinstance(column, pa.DictionaryArray) else pc.dictionary_encode(column)


def distinct(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(keys of the distinct tokens [u] (0: the empty token), row -> index into them [n]); a null row
    points at an extra key 0 at the end. The indices are pyarrow's, not copied when there are no nulls."""
    enc = dictionary(column)
    keys, indices = token_keys(enc.dictionary), enc.indices
    if indices.null_count:
        indices, keys = indices.fill_null(len(keys)), np.append(keys, np.uint64(0))
    return keys, indices.to_numpy(zero_copy_only=False)


class Encoder(Protocol):
    """Token keys -> per-field ids (id 0: empty or unknown token)."""

    cardinalities: tuple[int, ...]
    """Ids per field (the model's table sizes)."""

    def encode_distinct(self, field: int, keys: np.ndarray) -> np.ndarray:
        """Ids (int32) of a field's distinct keys."""
        ...

    def settings(self) -> dict:
        """What rebuilds the encoder with `load_encoder` (JSON-able), beside `state()`."""
        ...

    def state(self) -> dict[str, np.ndarray]:
        """Named arrays for a safetensors file (empty if the settings suffice)."""
        ...


def encode(encoder: Encoder, field: int, column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Ids [n] (int32) of one field's column, looked up on its distinct tokens."""
    keys, index = distinct(column)
    return encoder.encode_distinct(field, keys)[index]


@dataclass(frozen=True)
class HashingEncoder:
    """id = splitmix64(key) mod (buckets - 1) + 1; the empty token -> 0."""

    n_fields: int
    """Categorical fields."""
    buckets: int
    """Ids per field (>= 2; id 0 is the empty token's)."""

    def __post_init__(self) -> None:
        if self.buckets < 2:
            raise ValueError(f"hash buckets must be >= 2 (id 0 is the empty token's), got {self.buckets}")

    @property
    def cardinalities(self) -> tuple[int, ...]:
        return (self.buckets,) * self.n_fields

    def encode_distinct(self, field: int, keys: np.ndarray) -> np.ndarray:
        ids = (splitmix64(keys) % np.uint64(self.buckets - 1) + np.uint64(1)).astype(np.int32)
        return np.where(keys == 0, np.int32(0), ids)

    def settings(self) -> dict:
        return {"kind": "hashing", "hash_buckets": self.buckets, "n_fields": self.n_fields}

    def state(self) -> dict[str, np.ndarray]:
        return {}


@dataclass(frozen=True)
class VocabularyEncoder:
    """Per field, the sorted keys of the tokens that have an id, and their ids; other tokens -> 0."""

    keys: list[np.ndarray]
    """Per field: sorted uint64 keys."""
    ids: list[np.ndarray]
    """Per field: the id (int32, >= 1) of each key."""
    cardinalities: tuple[int, ...]
    """Ids per field (ids freed by `restricted` are still counted)."""

    def __post_init__(self) -> None:
        if not len(self.keys) == len(self.ids) == len(self.cardinalities):
            raise ValueError("a vocabulary needs keys, ids and a cardinality for every field")

    def encode_distinct(self, field: int, keys: np.ndarray) -> np.ndarray:
        vocab, ids = self.keys[field], self.ids[field]  # key 0 (empty) is never in a vocabulary
        if not len(vocab):
            return np.zeros(len(keys), np.int32)
        pos = np.minimum(np.searchsorted(vocab, keys), len(vocab) - 1)
        return np.where(vocab[pos] == keys, ids[pos], 0).astype(np.int32)

    def restricted(self, live: list[np.ndarray]) -> VocabularyEncoder:
        """A copy that keeps only the ids with `live[field][id]` (the others map to id 0)."""
        kept = [mask[ids] for mask, ids in zip(live, self.ids, strict=True)]
        keys = [k[m] for k, m in zip(self.keys, kept, strict=True)]
        ids = [i[m] for i, m in zip(self.ids, kept, strict=True)]
        return VocabularyEncoder(keys, ids, self.cardinalities)

    def settings(self) -> dict:
        return {"kind": "vocabulary", "cardinalities": list(self.cardinalities)}

    def state(self) -> dict[str, np.ndarray]:
        """Keys as int64 bit patterns (safetensors has no uint64), ids as int32."""
        out = {}
        for f, (keys, ids) in enumerate(zip(self.keys, self.ids, strict=True)):
            out[f"keys.{f}"], out[f"ids.{f}"] = keys.view(np.int64), ids.astype(np.int32)
        return out


def load_encoder(settings: dict, state: dict[str, np.ndarray]) -> Encoder:
    """The encoder that `settings()` and `state()` describe."""
    if settings.get("kind") == "hashing":
        return HashingEncoder(int(settings["n_fields"]), int(settings["hash_buckets"]))
    if settings.get("kind") == "vocabulary":
        fields = range(len(settings["cardinalities"]))
        keys = [np.asarray(state[f"keys.{f}"]).view(np.uint64) for f in fields]
        ids = [np.asarray(state[f"ids.{f}"]).astype(np.int32) for f in fields]
        return VocabularyEncoder(keys, ids, tuple(settings["cardinalities"]))
    raise ValueError(f"unknown encoder settings {settings!r}")


class VocabularyBuilder:
    """One field's vocabulary built in one pass: provisional ids by first appearance, then renumbered."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, np.uint64)  # sorted
        self.pids = np.zeros(0, np.int64)  # provisional id of each sorted key
        self.counts = np.zeros(0, np.int64)  # occurrences per provisional id

    def add(self, column: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Provisional ids [n] (int32, -1 for empty) of a chunk, counting its tokens."""
        keys, index = distinct(column)
        occurrences = np.bincount(index, minlength=len(keys))
        real = keys != 0
        pids = np.full(len(keys), -1, np.int64)
        pids[real] = self._provisional(keys[real])
        np.add.at(self.counts, pids[real], occurrences[real])
        return pids.astype(np.int32)[index]

    def _provisional(self, keys: np.ndarray) -> np.ndarray:
        """Provisional ids of distinct keys, new keys getting the next ids (inserted in sorted order)."""
        pos = np.searchsorted(self.keys, keys)
        known = np.zeros(len(keys), bool)
        inside = pos < len(self.keys)
        known[inside] = self.keys[pos[inside]] == keys[inside]
        pids = np.empty(len(keys), np.int64)
        pids[known] = self.pids[pos[known]]
        fresh = ~known
        n_new = int(fresh.sum())
        pids[fresh] = np.arange(len(self.counts), len(self.counts) + n_new)
        if n_new:
            order = np.argsort(keys[fresh], kind="stable")
            at = pos[fresh][order]
            self.keys = np.insert(self.keys, at, keys[fresh][order])
            self.pids = np.insert(self.pids, at, pids[fresh][order])
            self.counts = np.concatenate([self.counts, np.zeros(n_new, np.int64)])
        return pids

    def finish(self, min_count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sorted kept keys, their ids 1.., provisional id -> final id map with -1 -> 0 at the end)."""
        kept = self.counts[self.pids] >= min_count
        final = np.zeros(len(self.counts) + 1, np.int32)  # the extra last slot: provisional -1 (empty)
        ids = np.arange(1, int(kept.sum()) + 1, dtype=np.int32)
        final[self.pids[kept]] = ids
        return self.keys[kept], ids, final
