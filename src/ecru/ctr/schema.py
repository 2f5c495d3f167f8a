"""A practitioner's own table (CSV, TSV or Parquet) described by a schema: which column is the label, which
are dense, categorical or multi-hot, and how tokens become ids.

    {"label": "clicked", "dense": ["price", "age"], "categorical": ["user", "item", "city"],
     "multi_hot": {"tags": "|"}}

Defaults (every key but `label` and one feature column is optional):
- `hash_buckets`: 65536 ids per column, each column hashed on its own (`ecru.ctr.tokens.HashingEncoder`);
  0: vocabularies built from the file (tokens seen fewer than `--min-count` times share id 0);
- `max_tags`: 8 tokens kept per multi-hot cell (the first ones), pooled by their mean;
- dense values: sign(x) * log(1 + |x|), empty -> 0; categorical and multi-hot tokens are bytes, the empty
  token is id 0. A label must be 0 or 1 (a file to score may lack it).

Criteo and Avazu are presets of the same reader (`ecru.ctr.reader.sniff_layout`). `propose_schema` reads the
start of a file and proposes one (`ecru ctr schema --data FILE`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ecru.errors import EcruError

DEFAULT_BUCKETS = 1 << 16
DEFAULT_MAX_TAGS = 8
_KEYS = {"label", "dense", "categorical", "multi_hot", "hash_buckets", "max_tags"}


@dataclass(frozen=True)
class TableSchema:
    """Which columns of a table hold what (see the module docstring)."""

    label: str | None
    """The 0/1 label column (None: not named; files to score may lack it anyway)."""
    dense: tuple[str, ...] = ()
    """Numeric columns, fed as sign(x) * log(1 + |x|)."""
    categorical: tuple[str, ...] = ()
    """One-token columns, one embedding field each."""
    multi_hot: dict[str, str] = field(default_factory=dict)
    """Column -> the separator of its tokens ("a|b|c"); one pooled field each."""
    hash_buckets: int = DEFAULT_BUCKETS
    """Ids per column by hashing (>= 2), or 0: vocabularies built from the training file."""
    max_tags: int = DEFAULT_MAX_TAGS
    """Tokens kept per multi-hot cell."""

    def __post_init__(self) -> None:
        columns = [*self.dense, *self.categorical, *self.multi_hot]
        if not self.categorical and not self.multi_hot:
            raise EcruError(
                "the schema names no categorical or multi_hot column; the models need at least one"
            )
        if len(set(columns)) != len(columns) or self.label in columns:
            raise EcruError(f"the schema names a column twice: {columns} (label {self.label!r})")
        if self.hash_buckets < 0 or self.hash_buckets == 1 or self.max_tags < 1:
            raise EcruError(
                f"schema: hash_buckets must be 0 or >= 2 and max_tags >= 1, got {self.hash_buckets}, {self.max_tags}"
            )
        if any(not isinstance(sep, str) or not sep for sep in self.multi_hot.values()):
            raise EcruError(
                f"schema: every multi_hot column needs a non-empty separator, got {self.multi_hot}"
            )

    def columns(self) -> list[str]:
        return [*([self.label] if self.label else []), *self.dense, *self.categorical, *self.multi_hot]

    def to_json(self) -> dict:
        return {**asdict(self), "dense": list(self.dense), "categorical": list(self.categorical)}


def schema_from_dict(raw: object, *, where: str = "the schema") -> TableSchema:
    """A TableSchema from its JSON object; a bad one is one line saying what to fix."""
    if not isinstance(raw, dict) or not raw:
        raise EcruError(
            f'{where} is empty or not a JSON object; e.g. {{"label": "clicked", "categorical": ["user"]}}'
        )
    unknown = set(raw) - _KEYS
    if unknown:
        raise EcruError(f"{where}: unknown key(s) {sorted(unknown)}; the keys are {sorted(_KEYS)}")
    lists = {k: raw.get(k, []) for k in ("dense", "categorical")}
    if any(not isinstance(v, list) or not all(isinstance(c, str) for c in v) for v in lists.values()):
        raise EcruError(f"{where}: dense and categorical are lists of column names")
    if not isinstance(raw.get("multi_hot", {}), dict):
        raise EcruError(f'{where}: multi_hot maps column names to separators, e.g. {{"tags": "|"}}')
    if raw.get("label") is not None and not isinstance(raw["label"], str):
        raise EcruError(f"{where}: label is a column name")
    ints = {k: raw.get(k, d) for k, d in (("hash_buckets", DEFAULT_BUCKETS), ("max_tags", DEFAULT_MAX_TAGS))}
    if any(not isinstance(v, int) or isinstance(v, bool) for v in ints.values()):
        raise EcruError(f"{where}: hash_buckets and max_tags are integers")
    return TableSchema(
        raw.get("label"),
        tuple(lists["dense"]),
        tuple(lists["categorical"]),
        dict(raw.get("multi_hot", {})),
        **ints,
    )


def load_schema(path: str | Path) -> TableSchema:
    path = Path(path)
    if not path.is_file():
        raise EcruError(f"--schema {path} not found; `ecru ctr schema --data FILE` proposes one")
    try:
        raw = json.loads(path.read_text(encoding="utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EcruError(f"--schema {path} is not valid JSON ({exc})") from None
    return schema_from_dict(raw, where=str(path))


def check_columns(schema: TableSchema, names: list[str], path: Path, *, labelled_required: bool) -> bool:
    """Raise if the schema names a column the file lacks; whether the file has the label column."""
    missing = [c for c in schema.columns() if c not in names and c != schema.label]
    if missing:
        raise EcruError(
            f"{path}: the schema names column(s) {missing} that the file lacks (it has {names[:30]})"
        )
    has_label = schema.label is not None and schema.label in names
    if labelled_required and not has_label:
        raise EcruError(f"{path}: no label column {schema.label!r}; training needs it (it has {names[:30]})")
    return has_label


# ---------------------------------------------------------------- proposing a schema from a file

_LABEL_NAMES = ("label", "click", "clicked", "y", "target", "is_click", "converted")
_SEPARATORS = ("|", ";", " ", ",")


def _sample(path: Path, rows: int):
    """The first `rows` rows of a table as a pyarrow Table (types inferred)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from ecru.ctr.reader import table_names

    names, delimiter = table_names(path)
    if delimiter is None:
        return next(pq.ParquetFile(str(path)).iter_batches(batch_size=rows)).to_pydict(), names
    read = pacsv.ReadOptions(block_size=1 << 20, use_threads=False)
    try:
        reader = pacsv.open_csv(
            str(path), read_options=read, parse_options=pacsv.ParseOptions(delimiter=delimiter)
        )
        batch = reader.read_next_batch()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds; any is one line here
        raise EcruError(f"{path}: cannot read it as a table ({str(exc).splitlines()[0]})") from None
    return batch.slice(0, rows).to_pydict(), names


def _counts_rows(values: list) -> bool:
    """Integers that rise (or fall) from row to row: a numbered row id, not a quantity."""
    if not all(isinstance(v, int) for v in values):
        return False
    steps = [b - a for a, b in zip(values, values[1:], strict=False)]
    return all(d > 0 for d in steps) or all(d < 0 for d in steps)


def _column_kind(name: str, values: list) -> tuple[str, dict]:
    """(label | dense | categorical | multi_hot:SEP, facts seen) of one sampled column."""
    present = [v for v in values if v is not None and v != ""]
    distinct = {str(v) for v in present}
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in present)
    facts = {"distinct": len(distinct), "empty": len(values) - len(present)}
    if distinct <= {"0", "1"} and (name.lower() in _LABEL_NAMES):
        return "label", facts
    if len(present) > 100 and len(distinct) == len(present) and (not numeric or _counts_rows(present)):
        return "id", facts  # every value distinct: a row id (e.g. for predict --id-column), not a feature
    if numeric and (any(isinstance(v, float) for v in present) or len(distinct) > 100):
        return "dense", facts
    for sep in _SEPARATORS:
        share = sum(sep in str(v) for v in present) / max(1, len(present))
        if share >= 0.1:
            facts["separator_share"] = round(share, 3)
            return f"multi_hot:{sep}", facts
    return "categorical", facts


def propose_schema(path: str | Path, *, rows: int = 10_000) -> tuple[dict, dict]:
    """(a schema as JSON, per-column facts: kind, distinct values and empties among the first `rows` rows)."""
    path = Path(path)
    if not path.is_file():
        raise EcruError(f"--data {path} not found")
    sample, names = _sample(path, rows)
    schema: dict = {"label": None, "dense": [], "categorical": [], "multi_hot": {}}
    facts = {}
    for name in names:
        kind, seen = _column_kind(name, sample[name])
        facts[name] = {"kind": kind, **seen}
        if kind == "label" and schema["label"] is None:
            schema["label"] = name
        elif kind == "id":
            continue
        elif kind.startswith("multi_hot:"):
            schema["multi_hot"][name] = kind.split(":", 1)[1]
        else:
            schema["dense" if kind == "dense" else "categorical"].append(name)
    schema.update(hash_buckets=DEFAULT_BUCKETS, max_tags=DEFAULT_MAX_TAGS)
    return schema, facts


def predict_table(
    folder: str | Path, path: str | Path, *, batch_size: int = 65536, skip_malformed: bool = False
):
    """(probabilities, labels) per data row of a table scored by a model trained on `table:FILE`, in file
    order; NaN for skipped malformed rows (with `skip_malformed`). The schema is the model folder's."""
    from ecru.ctr.model_dir import line_aligned, load_model
    from ecru.ctr.reader import ReaderConfig, load_ctr_file

    predictor, schema = load_model(folder), load_schema(Path(folder) / "schema.json")
    cfg = ReaderConfig(skip_malformed=skip_malformed)
    data, skipped = load_ctr_file(path, schema, cfg=cfg, encoder=predictor.encoder)
    probs = predictor.predict_data(data, batch_size=batch_size)
    return line_aligned(probs, data.labels, Path(path), schema, skipped, header=True)


__all__ = [
    "DEFAULT_BUCKETS",
    "DEFAULT_MAX_TAGS",
    "TableSchema",
    "load_schema",
    "predict_table",
    "propose_schema",
    "schema_from_dict",
]
