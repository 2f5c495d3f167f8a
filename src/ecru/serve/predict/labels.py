"""Response-length labels and greedy answers: the model's own answers to each prompt, on the request engine.

Labels: the paper samples 4 answers (temperatures 0, 0.3, 0.5, 0.7) and labels a prompt with the longest, so
a predictor trained on it errs towards over-estimating (fewer FCR failures).

Answers: re-predicting the remaining length while generating needs the hidden states a row has at every
decode step. Teacher forcing gives the same states from one forward of prompt + answer, so the greedy
answers (token ids) are generated once and kept: {"prompt": str, "tokens": [int, ...], "max_new_tokens": int}.

Both are cached in a JSONL file keyed by model (`predictors.model_key`), prompt and cap, appended chunk by
chunk: a rerun only generates what is missing, and an interrupted run loses at most the chunk in flight. A
line of another model (or of none: written before lines named their model) is kept, never reused.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ecru.errors import EcruError
from ecru.io import BadLine, read_jsonl
from ecru.serve.engine.static import GenerationConfig, context_length

TEMPERATURES = (0.0, 0.3, 0.5, 0.7)


@dataclass(frozen=True)
class LengthLabel:
    """One prompt's sampled response lengths (tokens, EOS included)."""

    prompt: str
    """The raw user prompt (before the chat template)."""
    lengths: list[int]
    """Response length per sample; sample 0 is greedy."""
    max_new_tokens: int
    """The cap the samples were generated under (a length equal to it may be truncated)."""
    model: str | None = None
    """The model whose answers they are (`predictors.model_key`); None: written before lines named it."""

    @property
    def label(self) -> int:
        return max(self.lengths)

    @property
    def greedy(self) -> int:
        return self.lengths[0]


def read_labels(path: str | Path) -> list[LengthLabel]:
    """The labels in a JSONL file (none if it does not exist); a malformed line is an `EcruError` naming
    `file:line`."""
    path = Path(path)
    if not path.is_file():
        return []
    expected = '{"prompt", "lengths": [int, ...], "max_new_tokens", "model"} as written by `ecru serve label`'
    return read_jsonl(path, _parse_label, expected=expected)


def _parse_label(row: dict) -> LengthLabel:
    label = LengthLabel(str(row["prompt"]), [int(x) for x in row["lengths"]], int(row["max_new_tokens"]),
                        _model(row))  # fmt: skip
    if not label.lengths:
        raise BadLine("lengths is empty; relabel with `ecru serve label`")
    return label


def _model(row: dict) -> str | None:
    model = row.get("model")
    if model is not None and not isinstance(model, str):
        raise BadLine(f'"model" must be a string, got {json.dumps(model)[:80]}')
    return model


CHUNK_BATCHES = 4
"""Prompts labelled between two appends to the cache, in batches: fewer leaves rows idle at each chunk's
end, more loses more to an interruption."""


def label_prompts(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    out: str | Path,
    model_key: str,
    samples: int = 4,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    progress: bool = True,
) -> list[LengthLabel]:
    """Label every prompt not yet in `out` for `model_key` (the model's `predictors.model_key`; appended chunk by
    chunk: an interrupted run loses at most the chunk in flight); return the labels of `prompts`. The samples run on the continuous-batching request
    engine (CPU), up to `batch_size` rows at a time, finished rows refilled from the waiting samples."""
    if not 1 <= samples <= len(TEMPERATURES):
        raise EcruError(f"samples must be in 1..{len(TEMPERATURES)} (one per temperature), got {samples}")
    drop_torn_tail(out)
    done = {
        r.prompt: r
        for r in read_labels(out)
        if len(r.lengths) >= samples and r.max_new_tokens == max_new_tokens and r.model == model_key
    }
    gen = GenerationConfig.for_model(model, tokenizer)

    def label(chunk: list[str], ids: list[list[int]]) -> list[LengthLabel]:
        lengths = sample_lengths(model, ids, gen=gen, samples=samples, max_new_tokens=max_new_tokens,
                                 batch_size=batch_size)  # fmt: skip
        return [LengthLabel(p, ls, max_new_tokens, model_key) for p, ls in zip(chunk, lengths, strict=True)]

    _fill(done, prompts, model, tokenizer, out=out, cap=max_new_tokens, run=label, row=lambda p, v: asdict(v),
          chunk_size=CHUNK_BATCHES * batch_size, desc="labelling", progress=progress)  # fmt: skip
    return [done[p] for p in prompts]


def drop_torn_tail(path: str | Path) -> None:
    """Cut a last line without its newline from an append-only cache: what a kill mid-append left (the next
    append would run on from it). At most that one entry is computed again."""
    path = Path(path)
    if path.is_file() and (data := path.read_bytes()) and not data.endswith(b"\n"):
        os.truncate(path, data.rfind(b"\n") + 1)


def _fill(done: dict, prompts: Sequence[str], model, tokenizer, *, out: str | Path, cap: int, run: Callable,
          row: Callable, chunk_size: int, desc: str, progress: bool) -> None:  # fmt: skip
    """For every prompt not in `done`, `chunk_size` at a time: `run(prompts, their token ids)`, keep each
    result in `done` and append `row(prompt, result)` to `out`. Prompts the model's context cannot hold with
    `cap` new tokens are refused first."""
    from tqdm.auto import tqdm

    from ecru.serve.prompts import encode_chat

    out = Path(out)
    todo = list(dict.fromkeys(p for p in prompts if p not in done))
    ids = dict(zip(todo, encode_chat(tokenizer, todo), strict=True))
    _check_context(model, ids, cap)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc=desc, unit="prompt", disable=not progress)
    for start in range(0, len(todo), chunk_size):
        chunk = todo[start : start + chunk_size]
        results = run(chunk, [ids[p] for p in chunk])
        with out.open("a") as f:
            for p, result in zip(chunk, results, strict=True):
                done[p] = result
                f.write(json.dumps(row(p, result)) + "\n")
        bar.update(len(chunk))
    bar.close()


def _check_context(model, ids: dict[str, list[int]], max_new_tokens: int) -> None:
    context = context_length(model)
    long = [p for p, i in ids.items() if len(i) + max_new_tokens > context]
    if long:
        raise EcruError(
            f"{len(long)} prompt(s) leave no room for {max_new_tokens} new tokens in the model's {context}-token "
            f"context (e.g. {long[0][:60]!r}): shorten them or lower --max-new-tokens"
        )


def sample_seed(prompt: Sequence[int], k: int) -> int:
    """Sample k's seed for `prompt`: stable across runs and batch compositions, different per prompt."""
    return zlib.crc32(json.dumps([k, list(prompt)]).encode())


def sample_lengths(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    gen: GenerationConfig,
    samples: int,
    max_new_tokens: int,
    batch_size: int,
) -> list[list[int]]:
    """Per prompt (token ids), the lengths (EOS included) of `samples` answers: sample k at
    `TEMPERATURES[k]` seeded by `sample_seed`; `gen` gives the EOS and pad ids. A prompt that leaves no
    room for `max_new_tokens` in the model's context is a ValueError before any generation."""
    from ecru.serve.engine.sampling import SamplingParams

    engine = _engine(model, gen, batch_size=batch_size, max_new_tokens=max_new_tokens)
    params = [
        SamplingParams(max_new_tokens, temperature=TEMPERATURES[k], seed=sample_seed(p, k))
        for p in prompts
        for k in range(samples)
    ]
    requests = engine.generate([p for p in prompts for _ in range(samples)], params)
    return [[len(r.output) for r in requests[i : i + samples]] for i in range(0, len(requests), samples)]


def _engine(model, gen: GenerationConfig, *, batch_size: int, max_new_tokens: int):
    from ecru.serve.engine.request_engine import EngineConfig, RequestEngine

    config = EngineConfig(max_batch_size=batch_size, max_new_tokens=max_new_tokens)
    return RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id, config=config)


# ---- greedy answers ------------------------------------------------------------------------------------
def read_responses(path: str | Path, *, max_new_tokens: int, model_key: str) -> dict[str, list[int]]:
    """prompt -> greedy answer tokens (EOS included when produced) of model `model_key` under `max_new_tokens`."""
    if not Path(path).is_file():
        return {}
    rows = read_jsonl(path, _response, expected="{'prompt', 'tokens', 'max_new_tokens', 'model'}")
    return {
        prompt: tokens for prompt, tokens, cap, model in rows if (cap, model) == (max_new_tokens, model_key)
    }


def _response(row: dict) -> tuple[str, list[int], int, str | None]:
    return str(row["prompt"]), [int(t) for t in row["tokens"]], int(row["max_new_tokens"]), _model(row)


def generate_responses(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    out: str | Path,
    model_key: str,
    max_new_tokens: int,
    batch_size: int = 32,
    progress: bool = True,
) -> dict[str, list[int]]:
    """Greedy answers of model `model_key` (`predictors.model_key`) to every prompt not yet in `out` for it
    (appended chunk by chunk) on the request engine, up to `batch_size` rows at a time; returns prompt -> tokens."""
    from ecru.serve.engine.sampling import SamplingParams

    drop_torn_tail(out)
    done = read_responses(out, max_new_tokens=max_new_tokens, model_key=model_key)
    engine = _engine(model, GenerationConfig.for_model(model, tokenizer), batch_size=batch_size,
                     max_new_tokens=max_new_tokens)  # fmt: skip

    def answer(chunk: list[str], ids: list[list[int]]) -> list[list[int]]:
        return [r.output for r in engine.generate(ids, SamplingParams(max_new_tokens))]

    def row(prompt: str, tokens: list[int]) -> dict:
        return {"prompt": prompt, "tokens": tokens, "max_new_tokens": max_new_tokens, "model": model_key}

    _fill(done, prompts, model, tokenizer, out=out, cap=max_new_tokens, run=answer, row=row,
          chunk_size=CHUNK_BATCHES * batch_size, desc="answers", progress=progress)  # fmt: skip
    return {p: done[p] for p in prompts}
