"""Training text as right-padded causal-LM batches (CLI, demo, benchmark): CLINC150 utterances or the
user's own .txt / .jsonl file, at a data position that is a pure function of the step (exact resume)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

IGNORE_INDEX = -100


def byte_tokenizer():
    """A Hugging Face fast tokenizer for random tiny models: UTF-8 bytes shifted past three specials
    (pad 0, bos 1, eos 2), each text wrapped in bos ... eos; `save_pretrained` writes it like any other."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ("<pad>", "<s>", "</s>")
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({char: byte + len(specials) for byte, char in bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def encode_batch(tokenizer, texts: Sequence[str], *, max_length: int) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / labels, right-padded; labels are -100 at padding."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    enc = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
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


def read_texts(path: str | Path, *, flag: str = "--data") -> list[str]:
    """Training texts from a file: `.txt` (one text per non-empty line) or `.jsonl` (one JSON object per
    line with a string field `text`); a clear error, naming `flag`, for anything else."""
    from ecru.errors import EcruError

    path = Path(path)
    if path.suffix not in (".txt", ".jsonl"):
        raise EcruError(
            f"{flag} {path}: give a .txt file (one text per line) or a .jsonl file with a 'text' field"
        )
    lines = _decoded_lines(path, flag)
    if path.suffix == ".txt":
        texts = [line for line in lines if line.strip()]
    else:
        texts = [
            _jsonl_text(line, f"{flag} {path}, line {n}") for n, line in enumerate(lines, 1) if line.strip()
        ]
    if not texts:
        raise EcruError(f"{flag} {path}: no text in it")
    return texts


def _decoded_lines(path: Path, flag: str) -> list[str]:
    """The file's lines as UTF-8 text; a line that is not valid UTF-8 is one error naming file and line."""
    from ecru.errors import EcruError
    from ecru.io import decode_line

    lines = []
    for n, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            lines.append(decode_line(raw))
        except ValueError as exc:
            raise EcruError(f"{flag} {path}, line {n}: {exc}") from None
    return lines


def _jsonl_text(line: str, where: str) -> str:
    from ecru.errors import EcruError

    try:
        text = json.loads(line).get("text")
    except (json.JSONDecodeError, AttributeError):
        text = None
    if not isinstance(text, str):
        raise EcruError(f"{where}: not a JSON object with a string field 'text'")
    return text


def batch_texts(texts: Sequence[str], step: int, *, batch_size: int, seed: int) -> list[str]:
    """The texts of training step `step` (0-based): epoch e visits the texts in the order of a shuffle
    seeded by (seed, e), `batch_size` at a time, dropping the last partial batch. A pure function of the
    step, so a resumed run continues at exactly the data position it stopped at."""
    per_epoch = len(texts) // batch_size
    if per_epoch == 0:
        raise ValueError(f"{len(texts)} texts cannot fill one batch of {batch_size}")
    epoch, index = divmod(step, per_epoch)
    order = list(range(len(texts)))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return [texts[k] for k in order[index * batch_size : (index + 1) * batch_size]]
