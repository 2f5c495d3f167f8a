"""Prompt sources (bundled CLINC150 / Banking77 queries, the instruction workload, or a JSONL file) and
chat-template encoding."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

from ecru.errors import EcruError
from ecru.io import BadLine, read_jsonl

SOURCES = ("clinc", "banking", "mixed", "instructions")
"""Bundled prompts: CLINC150 or Banking77 queries, both interleaved ("mixed"), or "instructions": the
instruction workload (`ecru.serve.workload.build_mixed_workload`: 14 request forms over wiki sentences and
queries, lengths that follow the request), in its own order."""


def _bundled(name: str, split: str) -> list[str]:
    from ecru.datasets import load_banking77, load_clinc

    if name == "instructions":
        from ecru.serve.workload import build_mixed_workload

        return [p.prompt for p in build_mixed_workload()[split]]

    loaders = {"clinc": load_clinc, "banking": load_banking77}
    if name in loaders:
        return [e.text for e in loaders[name]()[split]]
    clinc, banking = ([e.text for e in load()[split]] for load in loaders.values())
    return [t for pair in zip(clinc, banking, strict=False) for t in pair]  # mixed: interleaved


def check_source(source: str | Path) -> None:
    """A bundled source's name or an existing file; else one line saying which sources there are."""
    if str(source) not in SOURCES and not Path(source).is_file():
        raise EcruError(f"prompt file {source} not found; give {', '.join(SOURCES)} or a JSONL path")


def read_jsonl_prompts(path: str | Path) -> list[str]:
    """`{"prompt": "..."}` per line."""
    check_source(path)
    return read_jsonl(path, _prompt, expected='a JSON object with a "prompt" field')


def _prompt(row: dict) -> str:
    prompt = row["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadLine(f'"prompt" must be a non-empty string, got {json.dumps(prompt)[:80]}')
    return prompt


def load_prompts(source: str, *, n: int | None = None, split: str = "test", seed: int = 0) -> list[str]:
    """`n` prompts from a bundled source (shuffled with `seed`, so any n is a fixed sample) or a file.

    A file's prompts keep their order; bundled sources use the `split` ("train" or "test") so that a
    predictor trained on train-split labels is evaluated on held-out test queries. "instructions" keeps the
    workload's own (random) order: its first n test prompts are those
    `bench/experiments/serve_workload.py --test n` uses.
    """
    if source in SOURCES:
        texts = _bundled(source, split)
        if source != "instructions":
            random.Random(seed).shuffle(texts)
    else:
        texts = read_jsonl_prompts(source)
    if n is not None:
        if n < 1:
            raise EcruError(f"--n must be >= 1, got {n}")
        texts = texts[:n]
    if not texts:
        raise EcruError(f"no prompts found in {source}")
    return texts


def chat_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of chat messages through the tokenizer's chat template, ready for the assistant's answer.

    A control token's text inside a message (`<|im_start|>system` typed by a user) is text, not the control
    token, as OpenAI's API takes it: only the template writes control tokens (`_text_content_ids`)."""
    specials = _specials_in(tokenizer, messages)
    if specials:
        return _text_content_ids(tokenizer, list(messages), specials)
    return _template_ids(tokenizer, list(messages))


def _template_ids(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def _specials_in(tokenizer, messages: Sequence[dict]) -> list[str]:
    """The special tokens' texts that some message's content holds."""
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    tokens = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return sorted(t for t in tokens if any(t in text for text in texts))


def _text_content_ids(tokenizer, messages: list[dict], specials: list[str]) -> list[int]:
    """The template rendered around placeholders, its pieces tokenized with control tokens, each content as
    plain text (`split_special_tokens`). Exact only where the template copies contents as they are and pieces
    tokenize apart as together: checked on the contents without their control-token texts (ValueError if not)."""

    def pieced(msgs: list[dict]) -> list[int]:
        marks = [f"\ue000{i}\ue001" for i in range(len(msgs))]
        text = tokenizer.apply_chat_template([{**m, "content": k} for m, k in zip(msgs, marks, strict=True)],
                                             add_generation_prompt=True, tokenize=False)  # fmt: skip
        ids = []
        for k, piece in enumerate(re.split("\ue000(\\d+)\ue001", text)):
            content = msgs[int(piece)]["content"] if k % 2 else piece
            ids += tokenizer(content, add_special_tokens=False, split_special_tokens=bool(k % 2))["input_ids"]
        return ids

    strip = re.compile("|".join(map(re.escape, specials)))
    bare = [
        {**m, "content": strip.sub("", m["content"])} if isinstance(m["content"], str) else m
        for m in messages
    ]
    if pieced(bare) != _template_ids(tokenizer, bare):
        raise ValueError(f"a message holds the text of the control token {specials[0]}, which this model's chat "
                         "template can not take as plain text: remove it")  # fmt: skip
    return pieced(messages)


def encode_chat(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as one user turn in the model's chat template."""
    return [chat_ids(tokenizer, [{"role": "user", "content": text}]) for text in texts]
