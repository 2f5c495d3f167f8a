"""CLINC150 utterances as right-padded causal-LM batches for fine-tuning runs (CLI, demo, benchmark)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import torch

IGNORE_INDEX = -100


class ByteTokenizer:
    """UTF-8 bytes shifted past three specials (pad 0, bos 1, eos 2): a tokenizer for random tiny models."""

    vocab_size = 259
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *(b + 3 for b in text.encode("utf-8")), self.eos_token_id]


def encode_batch(tokenizer, texts: Sequence[str], *, max_length: int) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / labels, right-padded; labels are -100 at padding."""
    if isinstance(tokenizer, ByteTokenizer):
        rows = [tokenizer.encode(t)[:max_length] for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    else:
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        enc = tokenizer(
            list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        ids, mask = enc["input_ids"], enc["attention_mask"]
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def clinc_batches(
    tokenizer, *, batch_size: int, max_length: int = 64, seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless shuffled batches of CLINC150 training utterances."""
    from ecru.datasets import load_clinc

    texts = [e.text for e in load_clinc()["train"]]
    rng = random.Random(seed)
    while True:
        order = list(range(len(texts)))
        rng.shuffle(order)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield encode_batch(
                tokenizer, [texts[k] for k in order[i : i + batch_size]], max_length=max_length
            )
