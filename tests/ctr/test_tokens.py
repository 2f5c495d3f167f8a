"""Token keys, hashing and the one-pass vocabulary against plain-Python references."""

import random

import numpy as np
import pyarrow as pa
import pytest

from ecru.ctr.tokens import (
    HashingEncoder,
    VocabularyBuilder,
    VocabularyEncoder,
    encode,
    load_encoder,
    splitmix64,
    token_keys,
)


def test_short_tokens_are_their_bytes_and_sort_like_tokens():
    tokens = ["68fd1e64", "0aaf7e0c", "a", "ab", "", "zz", "12345678"]
    keys = token_keys(pa.array(tokens, pa.binary()))
    assert keys[0] == int.from_bytes(b"68fd1e64", "big") and keys[4] == 0
    assert keys[2] == int.from_bytes(b"a" + b"\0" * 7, "big")
    assert [tokens[i] for i in np.argsort(keys)] == sorted(tokens)


def test_long_tokens_hash_with_the_top_bit_set():
    def fnv1a(b):
        h = 0xCBF29CE484222325
        for byte in b:
            h = ((h ^ byte) * 0x100000001B3) % 2**64
        return h | 1 << 63

    tokens = ["abcdefghi", "abcdefghj", "x" * 30, "short"]
    keys = token_keys(pa.array(tokens))
    assert [int(k) for k in keys[:3]] == [fnv1a(t.encode()) for t in tokens[:3]]
    assert keys[3] < 1 << 63 and len(set(keys.tolist())) == 4


def test_hashing_spreads_ids_over_the_buckets():
    enc = HashingEncoder(1, 101)
    ids = enc.encode_distinct(0, np.arange(1, 100_001, dtype=np.uint64))
    counts = np.bincount(ids, minlength=101)
    assert counts[0] == 0 and ids.min() == 1 and ids.max() == 100
    assert counts[1:].min() > 850 and counts[1:].max() < 1150  # ~1000 each (binomial sd ~31)
    # splitmix64's first output for seed 0 is the finaliser of the golden gamma
    assert splitmix64(np.array([0x9E3779B97F4A7C15], np.uint64))[0] == 0xE220A8397B1DCDAF


@pytest.mark.parametrize("min_count", [1, 3])
def test_one_pass_vocabulary_equals_two_pass_reference(min_count):
    rng = random.Random(0)
    chunks = [
        [rng.choice(["", "a", "b", "c", "d", "e", "ffffffffff", "g"]) for _ in range(50)] for _ in range(6)
    ]
    builder = VocabularyBuilder()
    pids = np.concatenate([builder.add(pa.array(c, pa.binary())) for c in chunks])
    keys, ids, final = builder.finish(min_count)
    flat = [t for c in chunks for t in c]
    counts = {t: flat.count(t) for t in set(flat) if t}
    kept = sorted(
        (t for t, n in counts.items() if n >= min_count), key=lambda t: token_keys(pa.array([t]))[0]
    )
    expect = [kept.index(t) + 1 if t in kept else 0 for t in flat]
    assert final[pids].tolist() == expect
    enc = VocabularyEncoder([keys], [ids], (len(keys) + 1,))
    assert encode(enc, 0, pa.array(flat, pa.binary())).tolist() == expect
    back = load_encoder(enc.settings(), enc.state())
    assert encode(back, 0, pa.array(flat)).tolist() == expect
    hashed = load_encoder(HashingEncoder(3, 16).settings(), {})
    assert hashed == HashingEncoder(3, 16) and hashed.cardinalities == (16, 16, 16)
