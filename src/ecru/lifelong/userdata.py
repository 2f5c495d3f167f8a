"""A user's examples: JSONL lines `{"text": ..., "label": ...}` or a CSV file with `text,label` columns, in
UTF-8 with or without a byte-order mark (Excel's "CSV UTF-8" writes one).

Labels are any strings; the zero-shot head reads each through `label_name`: underscores and hyphens become
spaces, runs of whitespace become one space, and the ends are trimmed (case is kept): `freeze_account`,
`freeze-account` and ` freeze  account ` all read "freeze account", so they are one label.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ecru.errors import EcruError


@dataclass(frozen=True)
class Record:
    """One input line: its text and, when the file gives one, its label (as written)."""

    text: str
    label: str | None = None


def label_name(label: str) -> str:
    """The name the zero-shot head embeds for `label` (module docstring)."""
    return re.sub(r"\s+", " ", re.sub(r"[_-]", " ", label)).strip()


def _field(row: dict, key: str, where: str, *, required: bool) -> str | None:
    value = row.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise EcruError(f"{where}: no {key!r}; every line needs a non-empty {key!r}")
        return None
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise EcruError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    return str(value)


def _rows_jsonl(path: Path):
    with path.open(encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EcruError(f"{path}:{n}: not JSON ({exc.msg}); give one JSON object per line") from None
            if not isinstance(row, dict):
                raise EcruError(
                    f'{path}:{n}: a JSON line must be an object like {{"text": ..., "label": ...}}'
                )
            yield f"{path}:{n}", row


def _rows_csv(path: Path):
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "text" not in reader.fieldnames:
            raise EcruError(f"{path}: a CSV file needs a header row with a 'text' column (and 'label')")
        for n, row in enumerate(reader, 2):
            yield f"{path}:{n}", row


def read_records(path: str | Path, *, labels: bool) -> list[Record]:
    """The records of a JSONL or CSV file (by suffix; otherwise JSONL if it starts with '{'). `labels=True`:
    every record must carry a label; else labels are optional but all-or-none."""
    path = Path(path)
    try:
        head = path.read_text(encoding="utf-8-sig").lstrip()[:1]  # utf-8-sig: Excel writes a BOM
    except (OSError, UnicodeDecodeError) as exc:
        raise EcruError(f"{path}: cannot read it as UTF-8 text ({exc})") from None
    jsonl = path.suffix.lower() in (".jsonl", ".json", ".ndjson") or (
        path.suffix.lower() != ".csv" and head.startswith("{")
    )
    rows = _rows_jsonl(path) if jsonl else _rows_csv(path)
    out = [
        Record(_field(row, "text", where, required=True), _field(row, "label", where, required=labels))
        for where, row in rows
    ]
    if not out:
        raise EcruError(f"{path}: no examples; give one JSON line or CSV row per text")
    if not labels and len({r.label is None for r in out}) > 1:
        raise EcruError(f"{path}: some lines have a 'label' and some do not; give all or none")
    return out


def task_labels(records: list[Record], *, source: str) -> dict[str, str]:
    """{name: label as first written} of a task's training records; refuses fewer than two labels, an empty
    name, and two spellings of one name that differ beyond the rule (e.g. 'A b' and 'a b')."""
    names: dict[str, str] = {}
    for r in records:
        name = label_name(r.label or "")
        if not name:
            raise EcruError(f"{source}: label {r.label!r} has no letters once '_' and '-' are spaces")
        names.setdefault(name, r.label)
    if len(names) < 2:
        raise EcruError(
            f"{source}: a task needs at least two different labels, got {sorted(names) or 'none'}"
        )
    lower: dict[str, str] = {}
    for name in names:
        if lower.setdefault(name.lower(), name) != name:
            raise EcruError(
                f"{source}: labels {lower[name.lower()]!r} and {name!r} differ only in case; use one"
            )
    return names
