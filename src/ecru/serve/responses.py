"""A cache of the model's greedy answers (token ids), to read its hidden states along each answer later.

Re-predicting the remaining length while generating needs the hidden states a row has at every decode
step. Teacher forcing gives the same states from one forward of prompt + answer, so the answers are
generated once (greedy, batched by a known length so batches barely pad) and kept in a JSONL file
keyed by prompt: {"prompt": str, "tokens": [int, ...], "max_new_tokens": int}. A rerun only generates
what is missing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ecru.io import read_jsonl
from ecru.serve.engine import GenerationConfig, generate_static


def read_responses(path: str | Path, *, max_new_tokens: int) -> dict[str, list[int]]:
    """prompt -> greedy answer tokens (EOS included when produced) generated under `max_new_tokens`."""
    if not Path(path).is_file():
        return {}
    rows = read_jsonl(path, _response, expected="{'prompt', 'tokens', 'max_new_tokens'}")
    return {prompt: tokens for prompt, tokens, cap in rows if cap == max_new_tokens}


def _response(row: dict) -> tuple[str, list[int], int]:
    return str(row["prompt"]), [int(t) for t in row["tokens"]], int(row["max_new_tokens"])


def generate_responses(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    out: str | Path,
    max_new_tokens: int,
    order_hint: Sequence[float] | None = None,
    batch_size: int = 32,
    progress: bool = True,
) -> dict[str, list[int]]:
    """Greedy answers of every prompt not yet in `out` (appended batch by batch); returns prompt -> tokens.

    `order_hint` (e.g. known answer lengths) groups similar lengths in a batch, which only saves time:
    greedy rows are independent of their batch.
    """
    from tqdm.auto import tqdm

    from ecru.serve.prompts import encode_chat

    out = Path(out)
    done = read_responses(out, max_new_tokens=max_new_tokens)
    hint = dict(zip(prompts, order_hint, strict=True)) if order_hint is not None else {}
    todo = sorted(dict.fromkeys(p for p in prompts if p not in done), key=lambda p: hint.get(p, 0.0))
    ids = dict(zip(todo, encode_chat(tokenizer, todo), strict=True))
    config = GenerationConfig.for_tokenizer(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="answers", unit="prompt", disable=not progress)
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        result = generate_static(model, [ids[p] for p in chunk], max_new_tokens=max_new_tokens, config=config)
        with out.open("a") as f:
            for p, toks in zip(chunk, result.tokens, strict=True):
                done[p] = toks
                f.write(json.dumps({"prompt": p, "tokens": toks, "max_new_tokens": max_new_tokens}) + "\n")
        bar.update(len(chunk))
    bar.close()
    return {p: done[p] for p in prompts}
