"""`ecru serve run`: offline batch inference from a JSONL file, resumable.

Input lines: {"prompt": str} or {"messages": [{"role", "content"}, ...]}, an optional "id" (default: the
line number) and an optional "max_tokens". Every line is checked before any generation; a bad line stops
the run with `file:line` and what is wrong, or is skipped and counted (`skip_invalid`).
Output lines: {"id", "text", "output_tokens", "finish_reason"}. Each answer is appended and flushed as soon
as it is finished, so a crash loses only the requests in flight; a rerun skips the ids already answered
(a torn last line from a crash is dropped). At the end the file is rewritten in input order, atomically.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ecru.errors import EcruError
from ecru.io import atomic_write_text, decode_line
from ecru.serve.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from ecru.serve.engine.request_engine import RequestEngine


@dataclass(frozen=True)
class BatchLine:
    """One input line, parsed and checked."""

    line: int
    id: str | int
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int | None = None


class InvalidLine(ValueError):
    """What is wrong with one input line (and how to fix it)."""


def _check_messages(messages) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise InvalidLine('"messages" must be a non-empty list of {"role": str, "content": str}')
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise InvalidLine(f'every message needs a string "role" and "content", got {json.dumps(m)[:80]}')
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def parse_line(text: str, number: int) -> BatchLine:
    """One JSONL line -> `BatchLine`, or `InvalidLine` saying what is wrong."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidLine(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise InvalidLine('expected a JSON object with "prompt" or "messages"')
    if ("prompt" in row) == ("messages" in row):
        raise InvalidLine('give exactly one of "prompt" (a string) or "messages" (a list)')
    line = BatchLine(number, row.get("id", number), max_tokens=row.get("max_tokens"))
    if isinstance(line.id, bool) or not isinstance(line.id, str | int):
        raise InvalidLine(f'"id" must be a string or an integer, got {json.dumps(line.id)}')
    if line.max_tokens is not None and (type(line.max_tokens) is not int or line.max_tokens < 1):  # not bool
        raise InvalidLine(f'"max_tokens" must be an integer >= 1, got {json.dumps(line.max_tokens)}')
    if "messages" in row:
        return replace(line, messages=_check_messages(row["messages"]))
    if not isinstance(row["prompt"], str) or not row["prompt"].strip():
        raise InvalidLine(f'"prompt" must be a non-empty string, got {json.dumps(row["prompt"])[:80]}')
    return replace(line, prompt=row["prompt"])


SKIP_HINT = " (or pass --skip-invalid)"


def read_batch(path: Path, *, skip_invalid: bool, hint: str = SKIP_HINT) -> tuple[list[BatchLine], list[str]]:
    """Every line of `path`, checked; with `skip_invalid` the bad ones are left out and described (`hint`
    ends the error of a bad line otherwise)."""
    lines, skipped, seen = [], [], set()
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = parse_line(decode_line(raw), number)
            if line.id in seen:
                raise InvalidLine(f"id {json.dumps(line.id)} appears twice; ids must be unique")
        except ValueError as exc:  # InvalidLine, or not UTF-8 (decode_line)
            if not skip_invalid:
                raise EcruError(f"{path}:{number}: {exc}{hint}") from None
            skipped.append(f"{path}:{number}: {exc}")
            continue
        seen.add(line.id)
        lines.append(line)
    if not lines:
        raise EcruError(f"{path}: no valid input lines; each line is a JSON object with a prompt or messages")
    return lines, skipped


def _answer_id(value) -> bool:
    """Whether `value` can be an answer's id: what an input line's "id" can be (a string or an integer)."""
    return isinstance(value, str | int) and not isinstance(value, bool)


def read_answers(path: Path) -> list[dict]:
    """The answers already in `path`. A last line without its newline (a crash mid-write) is dropped if torn,
    kept if whole; either way the file is rewritten to end with a newline, so appending can go on."""
    if not path.is_file():
        return []
    rows, data = [], path.read_bytes()
    lines = data.splitlines()
    for n, raw in enumerate(lines, 1):
        try:
            row = json.loads(raw)
            if not isinstance(row, dict) or not _answer_id(row.get("id")):
                raise ValueError
        except ValueError:  # UnicodeDecodeError and JSONDecodeError included
            if n == len(lines) and not data.endswith(b"\n"):
                break  # torn by a crash
            raise EcruError(f"{path}:{n}: not an answer line written by ecru serve run; "
                            "choose another --out") from None  # fmt: skip
        rows.append(row)
    if data and not data.endswith(b"\n"):
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


@dataclass(frozen=True)
class Encoded:
    line: BatchLine
    prompt_ids: list[int]
    params: SamplingParams


def encode_lines(served, lines: Sequence[BatchLine], base: SamplingParams, *, path: Path,
                 skip_invalid: bool, skipped: list[str], hint: str = SKIP_HINT) -> list[Encoded]:  # fmt: skip
    """Token ids and sampling of each line; a prompt too long for the context is an invalid line."""
    out = []
    for line in lines:
        params = base if line.max_tokens is None else replace(base, max_tokens=line.max_tokens)
        try:
            ids = served.encode(line.prompt) if line.prompt is not None else served.encode_chat(line.messages)
            if len(ids) + params.max_tokens > served.context_len:
                raise InvalidLine(
                    f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                    f"context of {served.context_len} tokens"
                )
        except Exception as exc:  # noqa: BLE001 - a chat template may raise anything on odd messages
            if not skip_invalid:
                raise EcruError(f"{path}:{line.line}: {exc}{hint}") from None
            skipped.append(f"{path}:{line.line}: {exc}")
            continue
        out.append(Encoded(line, ids, params))
    return out


def run_batch(engine: RequestEngine, todo: Sequence[Encoded], *, out: Path, progress: bool = True) -> int:
    """Serve `todo` on `engine`, appending each answer to `out` as it finishes; returns tokens generated."""
    from tqdm.auto import tqdm

    lines = {str(i): e.line for i, e in enumerate(todo)}
    for i, e in enumerate(todo):
        engine.add_request(e.prompt_ids, e.params, request_id=str(i))
    tokens = 0
    with out.open("a") as f, tqdm(total=len(todo), desc="serve run", unit="req", disable=not progress) as bar:
        while engine.has_unfinished():
            for req in engine.step():
                row = {"id": lines[req.request_id].id, "text": req.text,
                       "output_tokens": len(req.output), "finish_reason": req.finish_reason}  # fmt: skip
                f.write(json.dumps(row) + "\n")
                f.flush()  # a crash loses only the requests still in flight
                tokens += len(req.output)
                bar.update(1)
    return tokens


def reorder(out: Path, lines: Sequence[BatchLine]) -> None:
    """Rewrite `out` in input order (answers for ids not in the input stay, at the end)."""
    rows = read_answers(out)
    rank = {line.id: k for k, line in enumerate(lines)}
    rows.sort(key=lambda r: rank.get(r["id"], len(rank)))
    atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
