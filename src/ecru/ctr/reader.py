"""Columnar streaming readers of the Criteo TSV and Avazu CSV formats (pyarrow).

Criteo (Kaggle display advertising): `label \\t I1..I13 \\t C1..C26` (39 columns without the label); counts
may be empty (-> 0) and become log(1 + max(x, 0)); categoricals are 8-hex-digit hashes or empty. Avazu: a
CSV with a header, `id,click,hour,C1,banner_pos,...,C21` (`click` may be absent); the 21 categorical
columns plus the hour of day become 22 fields.

`pyarrow.csv.open_csv` parses 1 MB blocks (cache-sized: measured ~2x less CPU than 16 MB ones), gathered
into blocks of about `block_bytes` of text; every check and conversion is a columnar operation
on the block (labels in {0, 1}, integer counts, hexadecimal tokens, the Avazu hour), and tokens become ids
through `ecru.ctr.tokens` on each block's distinct values. A malformed line is either skipped and counted or
reported by file and line: the (slow) line-by-line parser below then locates the first bad line.
"""

from __future__ import annotations

import csv
import io
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import torch

from ecru.ctr.data import CTRData, concat
from ecru.ctr.schema import TableSchema, check_columns
from ecru.ctr.tokens import (
    Encoder,
    HashingEncoder,
    VocabularyBuilder,
    VocabularyEncoder,
    dictionary,
    encode,
)
from ecru.errors import EcruError, MissingAssetError

CRITEO_FIELDS, CRITEO_DENSE = 26, 13
AVAZU_FIELDS = 22
FORMATS = ("criteo", "avazu", "table")  # a table is read with its TableSchema
_PARSE_BLOCK = 1 << 20
_INT, _HEX = re.compile(r"-?[0-9]+"), re.compile(r"[0-9a-fA-F]*")
_FLOAT_RE = r"\s*[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?\s*"
_FLOAT = re.compile(_FLOAT_RE)


class MalformedLineError(EcruError, ValueError):
    """A line of a data file that does not parse; the message names the file and line number."""


@dataclass(frozen=True)
class ReaderConfig:
    """How raw CTR files become ids."""

    hash_buckets: int = 0
    """> 0: hash each field's tokens into this many ids; 0: build vocabularies (in the same pass)."""
    min_count: int = 1
    """Vocabulary mode: tokens seen fewer times share the out-of-vocabulary id 0."""
    skip_malformed: bool = False
    """Skip and count malformed lines instead of raising an error naming the line."""
    block_bytes: int = 16 << 20
    """About this many bytes of text are checked and encoded together (the parse itself runs in 1 MB blocks)."""

    def __post_init__(self) -> None:
        if self.hash_buckets < 0 or self.hash_buckets == 1:
            raise ValueError(f"hash buckets must be 0 (vocabularies) or >= 2, got {self.hash_buckets}")
        if self.min_count < 1 or self.block_bytes < 1:
            raise ValueError(
                f"min_count and block_bytes must be >= 1, got {self.min_count}, {self.block_bytes}"
            )


Format = str | TableSchema
"""A preset's name ("criteo", "avazu") or a table's schema."""


def n_fields(fmt: Format) -> int:
    if isinstance(fmt, TableSchema):
        return len(fmt.categorical) + len(fmt.multi_hot)
    return CRITEO_FIELDS if fmt == "criteo" else AVAZU_FIELDS


# ---------------------------------------------------------------- the line parser (locates bad lines)


def parse_criteo(line: str, *, labelled: bool = True) -> None:
    """Raise ValueError if `line` is not a Criteo row (the same rules as the columnar checks)."""
    parts = line.rstrip("\r\n").split("\t")
    if len(parts) != labelled + CRITEO_DENSE + CRITEO_FIELDS:
        raise ValueError(f"expected {labelled + 39} tab-separated fields, got {len(parts)}")
    if labelled and parts[0] not in ("0", "1"):
        raise ValueError(f"label must be 0 or 1, got {parts[0]!r}")
    for x in parts[labelled : labelled + CRITEO_DENSE]:
        if x and not _INT.fullmatch(x):
            raise ValueError(f"integer feature {x!r} is not an integer")
    for c in parts[labelled + CRITEO_DENSE :]:
        if not _HEX.fullmatch(c):
            raise ValueError(f"categorical {c!r} is not hexadecimal")


def parse_avazu(line: str, *, labelled: bool = True) -> None:
    parts = line.rstrip("\r\n").split(",")
    if len(parts) != AVAZU_FIELDS + 1 + labelled:
        raise ValueError(f"expected {AVAZU_FIELDS + 1 + labelled} comma-separated columns, got {len(parts)}")
    if labelled and parts[1] not in ("0", "1"):
        raise ValueError(f"click must be 0 or 1, got {parts[1]!r}")
    hour = parts[1 + labelled]
    if len(hour) != 8 or not hour.isdigit():
        raise ValueError(f"hour must be YYMMDDHH, got {hour!r}")


def parse_table(line: str, layout: Layout) -> None:
    """Raise ValueError if `line` is not a row of the table `layout` (the columnar checks' rules)."""
    parts = next(csv.reader([line.rstrip("\r\n")], delimiter=layout.delimiter))
    if len(parts) != len(layout.names):
        raise ValueError(f"expected {len(layout.names)} columns, got {len(parts)}")
    row = dict(zip(layout.names, parts, strict=True))
    if layout.label and row[layout.label] not in ("0", "1"):
        raise ValueError(f"label {layout.label} must be 0 or 1, got {row[layout.label]!r}")
    for name in layout.dense:
        if row[name].strip() and not _FLOAT.fullmatch(row[name]):
            raise ValueError(f"dense column {name}: {row[name]!r} is not a number")


def _line_parser(fmt: Format, layout: Layout):
    if isinstance(fmt, TableSchema):
        return lambda line, labelled: parse_table(line, layout)
    return parse_criteo if fmt == "criteo" else parse_avazu


def malformed_lines(
    path: Path, fmt: Format, *, labelled: bool, layout: Layout | None = None
) -> Iterator[tuple[int, int, str]]:
    """(data row index, line number, reason) of every malformed line, by the line parser (slow: Python)."""
    layout = layout or sniff_layout(Path(path), fmt)
    parse, row = _line_parser(fmt, layout), 0
    with pa.input_stream(str(path), compression="detect") as raw:
        for line_no, data in enumerate(io.BufferedReader(raw), 1):
            if (layout.header and line_no == 1) or not data.rstrip(b"\r\n"):
                continue  # the header; empty lines are not rows (pyarrow skips them too)
            try:
                parse(data.decode("utf-8", errors="replace"), labelled=labelled)
            except ValueError as exc:
                yield row, line_no, _undecodable(data) or str(exc)
            row += 1


def _undecodable(line: bytes) -> str | None:
    """Why a line that does not parse does not: its invalid UTF-8 (the columnar checks reject the same rows)."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"undecodable bytes (invalid UTF-8) at byte {exc.start + 1}"
    return None


def first_bad_line(
    path: Path, fmt: Format, *, labelled: bool, layout: Layout | None = None
) -> tuple[int, str] | None:
    """(line number, reason) of the first malformed line; None if every line parses."""
    for _, line_no, why in malformed_lines(path, fmt, labelled=labelled, layout=layout):
        return line_no, why
    return None


def with_blank_lines(values, path: str | Path, *, header: bool):
    """`values` of the rows pyarrow read, with NaN inserted at the file's blank lines: one per input line."""
    import numpy as np
    import torch

    blank = blank_lines(path)
    blank = blank[blank > 0] - 1 if header else blank
    if not len(blank):
        return values
    keep = np.ones(len(values) + len(blank), bool)
    keep[blank] = False
    full = torch.full((len(keep),), float("nan"), dtype=values.dtype)
    full[torch.from_numpy(keep)] = values
    return full


def blank_lines(path: str | Path, *, chunk_bytes: int = 16 << 20) -> np.ndarray:
    """0-based numbers of the empty lines ("" or "\\r") of a file, found in byte chunks (pyarrow's parser skips
    them, so scores are re-aligned with the input lines from these)."""
    found, line0, carry, last = [], 0, 0, 0
    with pa.input_stream(str(path), compression="detect") as raw:
        while chunk := raw.read(chunk_bytes):
            buf = np.frombuffer(chunk, np.uint8)
            ends = np.flatnonzero(buf == 10)
            if len(ends):
                lengths = np.diff(ends, prepend=-1) - 1
                lengths[0] += carry
                before = np.where(ends > 0, buf[np.maximum(ends - 1, 0)], last)  # the byte before each "\n"
                blank = (lengths == 0) | ((lengths == 1) & (before == 13))
                found.append(line0 + np.flatnonzero(blank))
                line0, carry = line0 + len(ends), len(buf) - int(ends[-1]) - 1
            else:
                carry += len(buf)
            last = int(buf[-1])
    return np.concatenate(found) if found else np.zeros(0, np.int64)


def open_text(raw):
    return io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace")  # utf-8-sig: Excel writes a BOM


# ---------------------------------------------------------------- columnar reading


@dataclass(frozen=True)
class Layout:
    """Which columns of a file hold what."""

    names: list[str]
    """Column names as read."""
    label: str | None
    """The label column (None: an unlabelled file, e.g. one to score)."""
    dense: list[str]
    """Integer count columns (Criteo)."""
    cats: list[str]
    """Categorical columns in field order (Avazu: the hour column last, its hour of day used)."""
    header: bool
    """The first line names the columns (Avazu, tables)."""
    name: str = "criteo"
    """The format, for messages and provenance ("criteo", "avazu", "table")."""
    delimiter: str = "\t"
    """Column separator (ignored for Parquet)."""
    dense_kind: str = "count"
    """count: integers, log(1 + max(x, 0)) (Criteo); float: any number, sign(x) log(1 + |x|) (tables)."""
    hex_tokens: bool = False
    """Categorical tokens must be hexadecimal (Criteo)."""
    hour: str | None = None
    """A YYMMDDHH column whose hour of day is the last categorical field (Avazu)."""
    multi_hot: tuple[tuple[str, str], ...] = ()
    """(column, separator) of the multi-hot fields, after the categorical ones."""
    max_tags: int = 0
    """Tokens kept per multi-hot cell."""
    parquet: bool = False
    """A Parquet file (read by row groups) instead of delimited text."""
    quoted: bool = False
    """Delimited text may quote cells with '"' (tables)."""


def _criteo_width(path: Path, *, lines: int = 1000) -> int:
    """39 or 40: the column count of the first of the first `lines` lines that has one of them (a malformed
    first line does not decide the layout; it is then reported or skipped like any other)."""
    with pa.input_stream(str(path), compression="detect") as raw, open_text(raw) as f:
        for _, line in zip(range(lines), f, strict=False):
            width = line.rstrip("\r\n").count("\t") + 1
            if width in (39, 40):
                return width
    raise MalformedLineError(
        f"{path}: no line among the first {lines} has Criteo's 40 tab-separated columns (39 without the label)"
    )


def sniff_layout(path: Path, fmt: Format) -> Layout:
    """Criteo with (40 columns) or without (39) the label; Avazu's columns from its header; a table's from
    its header (or Parquet schema) and its TableSchema."""
    if not isinstance(fmt, TableSchema) and fmt not in FORMATS:
        raise EcruError(f"unknown data format {fmt!r}; choose from {', '.join(FORMATS)}")
    if not path.is_file():
        raise MissingAssetError(f"data file {path} not found")
    if isinstance(fmt, TableSchema):
        return _table_layout(path, fmt)
    if fmt == "table":
        raise EcruError(f"{path}: a table is read with its schema (a TableSchema, or --schema FILE)")
    if fmt == "criteo":
        labelled = _criteo_width(path) == 40
        dense = [f"I{i}" for i in range(1, CRITEO_DENSE + 1)]
        cats = [f"C{i}" for i in range(1, CRITEO_FIELDS + 1)]
        names = ["label"] * labelled + dense + cats
        return Layout(names, "label" if labelled else None, dense, cats, False, hex_tokens=True)
    with pa.input_stream(str(path), compression="detect") as raw, open_text(raw) as f:
        names = f.readline().rstrip("\r\n").split(",")
    labelled = "click" in names
    if len(names) != AVAZU_FIELDS + 1 + labelled or "hour" not in names:
        raise MalformedLineError(
            f"{path}:1: an Avazu header names id,[click,]hour and 21 categorical columns, got {len(names)} names"
        )
    cats = [n for n in names if n not in ("id", "click", "hour")] + ["hour"]
    return Layout(names, "click" if labelled else None, [], cats, True, "avazu", ",", hour="hour")


def table_names(path: Path) -> tuple[list[str], str | None]:
    """(column names, delimiter or None for Parquet) of a table: its header line or Parquet schema."""
    if _is_parquet(path):
        import pyarrow.parquet as pq

        return pq.ParquetFile(str(path)).schema_arrow.names, None
    with pa.input_stream(str(path), compression="detect") as raw, open_text(raw) as f:
        first = f.readline().rstrip("\r\n")
    suffix = path.name.removesuffix(".gz").rsplit(".", 1)[-1].lower()
    delimiter = "\t" if suffix in ("tsv", "tab") or (suffix != "csv" and "\t" in first) else ","
    return next(csv.reader([first], delimiter=delimiter), []), delimiter


def _is_parquet(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def _table_layout(path: Path, schema: TableSchema) -> Layout:
    names, delimiter = table_names(path)
    labelled = check_columns(schema, names, path, labelled_required=False)
    return Layout(
        names,
        schema.label if labelled else None,
        list(schema.dense),
        list(schema.categorical),
        True,
        "table",
        delimiter or ",",
        dense_kind="float",
        multi_hot=tuple(schema.multi_hot.items()),
        max_tags=schema.max_tags,
        parquet=delimiter is None,
        quoted=True,
    )


def _used(layout: Layout) -> list[str]:
    used = {layout.label, *layout.dense, *layout.cats, *(c for c, _ in layout.multi_hot)}
    return [c for c in layout.names if c in used]


def _text_batches(path: Path, layout: Layout, cfg: ReaderConfig, bad: list) -> Iterator[pa.RecordBatch]:
    def invalid(row) -> str:
        bad.append(row.number)
        return "skip"

    read = pacsv.ReadOptions(
        column_names=None if layout.header else layout.names,
        block_size=min(_PARSE_BLOCK, cfg.block_bytes),
        use_threads=False,
    )
    quote = '"' if layout.quoted else False
    parse = pacsv.ParseOptions(delimiter=layout.delimiter, quote_char=quote, invalid_row_handler=invalid)
    # bytes: undecodable text is a bad row, not an ArrowInvalid; empty cells stay "" (strings_can_be_null
    # costs ~40% of the parse): counts pad them to "0"
    convert = pacsv.ConvertOptions(
        column_types={n: pa.binary() for n in layout.names}, include_columns=_used(layout)
    )
    with pa.input_stream(str(path), compression="detect") as raw:
        yield from pacsv.open_csv(raw, read_options=read, parse_options=parse, convert_options=convert)


def _parquet_batches(path: Path, layout: Layout) -> Iterator[pa.RecordBatch]:
    """Row groups of a Parquet file with every used column as bytes (numbers as their text, null -> "")."""
    import pyarrow.parquet as pq

    names = _used(layout)
    for batch in pq.ParquetFile(str(path)).iter_batches(batch_size=1 << 16, columns=names):
        cols = [pc.fill_null(pc.cast(pc.cast(c, pa.string()), pa.binary()), b"") for c in batch.columns]
        yield pa.RecordBatch.from_arrays(cols, names=names)


def _batches(path: Path, layout: Layout, cfg: ReaderConfig, bad: list) -> Iterator[pa.RecordBatch]:
    source = _parquet_batches(path, layout) if layout.parquet else _text_batches(path, layout, cfg, bad)
    group, size = [], 0
    for batch in source:
        group.append(batch)
        size += batch.nbytes
        if size >= cfg.block_bytes:
            yield _combine(group)
            group, size = [], 0
    if group:
        yield _combine(group)


def _combine(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One record batch of contiguous columns (per-column work then runs once per group, not per batch)."""
    if len(batches) == 1:
        return batches[0]
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


def _valid_rows(batch: pa.RecordBatch, layout: Layout) -> np.ndarray:
    """Rows whose label and hour parse (counts: `_counts`; hexadecimal tokens: on the distinct values)."""
    ok = np.ones(batch.num_rows, bool)
    if layout.label:
        label = pc.is_in(batch.column(layout.label), pa.array([b"0", b"1"], pa.binary()))
        ok &= pc.fill_null(label, False).to_numpy(zero_copy_only=False)
    if layout.hour:
        hour = pc.match_substring_regex(batch.column(layout.hour), rb"^[0-9]{8}$")
        ok &= pc.fill_null(hour, False).to_numpy(zero_copy_only=False)
    return ok


def _counts(batch: pa.RecordBatch, layout: Layout, ok: np.ndarray) -> np.ndarray:
    """The dense columns [n, n_dense] float32 (empty -> 0): counts log(1 + max(x, 0)), floats
    sign(x) log(1 + |x|); clears `ok` where a value does not parse."""
    out = np.zeros((batch.num_rows, len(layout.dense)), np.float32)
    counts = layout.dense_kind == "count"
    kind, pattern = (pa.int64(), rb"^-?[0-9]*$") if counts else (pa.float64(), f"^({_FLOAT_RE})?$".encode())
    for j, name in enumerate(layout.dense):
        col = batch.column(name)
        try:  # the common case: every value parses; the regex runs only on a column where one does not
            x = pc.cast(_pad_empty(pc.cast(col, pa.string())), kind)
        except pa.ArrowInvalid:  # a non-number or undecodable (invalid UTF-8) value
            good = pc.fill_null(pc.match_substring_regex(col, pattern), True)
            ok &= good.to_numpy(zero_copy_only=False)
            kept = pc.cast(pc.if_else(good, col, pa.scalar(None, pa.binary())), pa.string())
            x = pc.cast(_pad_empty(pc.utf8_trim_whitespace(kept)), kind)
        v = pc.fill_null(x, 0).to_numpy(zero_copy_only=False)
        out[:, j] = np.log1p(np.maximum(v, 0)) if counts else np.sign(v) * np.log1p(np.abs(v))
    if counts:
        return out
    ok &= np.isfinite(out).all(1)  # "inf", "nan" parse as floats but are not values to learn from
    return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0)


def _pad_empty(col: pa.Array) -> pa.Array:
    return pc.utf8_lpad(col, width=1, padding="0")  # "" -> "0"


@dataclass(frozen=True)
class Tokens:
    """One field of a block: its tokens as distinct values + indices, and for a multi-hot field where each
    token goes ([n, max_tags] index into the tokens, -1: padding)."""

    tokens: pa.DictionaryArray
    slots: np.ndarray | None = None

    def filter(self, keep: np.ndarray) -> Tokens:
        if self.slots is None:
            return Tokens(self.tokens.filter(pa.array(keep)))
        return Tokens(self.tokens, self.slots[keep])

    def spread(self, ids: np.ndarray) -> np.ndarray:
        """Per-token ids -> the field's id columns ([n] or [n, max_tags] with -1 padding)."""
        if self.slots is None:
            return ids
        return np.where(self.slots >= 0, ids[np.maximum(self.slots, 0)], -1).astype(np.int32)


def _multi_hot(column: pa.Array, separator: str, max_tags: int) -> Tokens:
    """A multi-hot column ("a|b|c") as its first `max_tags` tokens per row, flattened, and their slots."""
    tags = pc.list_slice(pc.split_pattern(column, separator.encode()), 0, max_tags)
    lengths = pc.list_value_length(tags).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    slots = np.full((len(lengths), max_tags), -1, np.int64)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    slots[rows, np.arange(len(rows)) - starts[rows]] = np.arange(len(rows))
    return Tokens(dictionary(pc.list_flatten(tags)), slots)


def _categoricals(batch: pa.RecordBatch, layout: Layout) -> list[Tokens]:
    """The categorical columns as distinct tokens + row indices (encoded once, checked and mapped from it),
    then the multi-hot ones."""
    cols = [batch.column(n) for n in layout.cats]
    if layout.hour:  # Avazu: the hour of day (YYMMDDHH -> HH)
        cols[-1] = pc.binary_slice(cols[-1], 6, 8)
    multi = [_multi_hot(batch.column(c), sep, layout.max_tags) for c, sep in layout.multi_hot]
    return [Tokens(dictionary(c)) for c in cols] + multi


def _hex_ok(column: pa.DictionaryArray) -> np.ndarray | None:
    """Rows whose token is hexadecimal (or empty), checked on the distinct tokens; None if all are."""
    good = pc.match_substring_regex(column.dictionary, rb"^[0-9a-fA-F]*$")
    if pc.all(good).as_py() is not False:
        return None
    index = column.indices.fill_null(-1).to_numpy(zero_copy_only=False)
    return np.append(good.to_numpy(zero_copy_only=False), True)[index]


class _Source:
    """One pass over a file: blocks of checked rows (label, dense, categorical columns)."""

    def __init__(self, path: str | Path, fmt: Format, cfg: ReaderConfig) -> None:
        self.path, self.fmt, self.cfg = Path(path), fmt, cfg
        self.layout = sniff_layout(self.path, fmt)
        self.bad: list = []  # rows pyarrow could not split into the right number of columns
        self.skipped = 0

    def blocks(self) -> Iterator[tuple[np.ndarray | None, torch.Tensor, list[Tokens]]]:
        for batch in _batches(self.path, self.layout, self.cfg, self.bad):
            ok = _valid_rows(batch, self.layout)
            dense = _counts(batch, self.layout, ok)
            cats = _categoricals(batch, self.layout)
            if self.layout.hex_tokens:
                for col in cats:
                    good = _hex_ok(col.tokens)
                    ok = ok if good is None else ok & good
            self._check(int((~ok).sum()))
            if not ok.all():
                batch, cats, dense = batch.filter(pa.array(ok)), [c.filter(ok) for c in cats], dense[ok]
            labels = (
                pc.equal(batch.column(self.layout.label), b"1").to_numpy(zero_copy_only=False)
                if self.layout.label
                else None
            )
            yield labels, torch.from_numpy(dense), cats

    def _check(self, bad_rows: int) -> None:
        """Count the bad rows of this block, or report the first bad line of the file."""
        bad_rows += len(self.bad)
        self.bad.clear()
        if not bad_rows:
            return
        if not self.cfg.skip_malformed:
            labelled = self.layout.label is not None
            found = first_bad_line(self.path, self.fmt, labelled=labelled, layout=self.layout)
            where, why = found if found else ("?", "rejected by the columnar checks")
            raise MalformedLineError(
                f"{self.path}:{where}: malformed {self.layout.name} line ({why}); "
                "fix the file or pass skip_malformed=True (--skip-malformed)"
            )
        self.skipped += bad_rows


def read_ctr_file(
    path: str | Path,
    fmt: Format,
    *,
    encoder: Encoder,
    cfg: ReaderConfig = ReaderConfig(),
    skipped: Counter | None = None,
) -> Iterator[CTRData]:
    """Stream a Criteo TSV or Avazu CSV file as CTRData blocks, its tokens mapped by a fitted `encoder`.

    An unlabelled file (no label/click column) gets labels NaN. Malformed lines raise `MalformedLineError`
    naming file and line, or are skipped and counted in `skipped["lines"]`.
    """
    source = _Source(path, fmt, cfg)
    for labels, dense, cats in source.blocks():
        ids = _rows([c.spread(encode(encoder, f, c.tokens)) for f, c in enumerate(cats)])
        yield _block(labels, dense, ids, encoder.cardinalities, source)
        if skipped is not None:
            skipped["lines"] = source.skipped


def _block(labels, dense, ids, cardinalities, source: _Source) -> CTRData:
    n = len(dense)
    y = torch.full((n,), float("nan")) if labels is None else torch.from_numpy(labels.astype(np.float32))
    multi = len(source.layout.multi_hot)
    return CTRData(
        dense,
        torch.from_numpy(ids.reshape(n, -1)),
        y,
        tuple(cardinalities),
        {"source": f"{source.layout.name}:{source.path}"},
        multi,
        source.layout.max_tags if multi else 0,
    )


def load_ctr_file(
    path: str | Path, fmt: Format, *, cfg: ReaderConfig = ReaderConfig(), encoder: Encoder | None = None
) -> tuple[CTRData, int]:
    """The whole file in memory (in file order) and the number of malformed lines skipped.

    Without an `encoder` one is built in the same pass (hashing, or vocabularies with `cfg.min_count`) and
    returned as `data.info["encoder"]`.
    """
    if encoder is not None:
        skipped: Counter = Counter()
        data = concat(list(read_ctr_file(path, fmt, encoder=encoder, cfg=cfg, skipped=skipped)))
        data.info["encoder"], data.info["skipped_lines"] = encoder, skipped["lines"]
        return data, skipped["lines"]
    source = _Source(path, fmt, cfg)
    if cfg.hash_buckets:
        hashed = HashingEncoder(n_fields(fmt), cfg.hash_buckets)
        return load_ctr_file(path, fmt, cfg=cfg, encoder=hashed)
    builders = [VocabularyBuilder() for _ in range(n_fields(fmt))]
    labels, dense, pids = [], [], [[] for _ in builders]
    for y, d, cats in source.blocks():
        labels.append(y), dense.append(d)
        for b, c, out in zip(builders, cats, pids, strict=True):
            out.append((c, b.add(c.tokens)))  # provisional ids per token (-1: empty)
    if not dense:
        raise EcruError(f"{path}: no rows were read")
    keys, ids, columns = [], [], []
    for b, field_pids in zip(builders, pids, strict=True):
        k, i, final = b.finish(cfg.min_count)
        spread = [c.spread(final[p]) for c, p in field_pids]  # final[-1]: the empty token's id 0
        keys.append(k), ids.append(i), columns.append(np.concatenate(spread))
    encoder = VocabularyEncoder(keys, ids, tuple(len(k) + 1 for k in keys))
    y = None if labels[0] is None else np.concatenate(labels)
    data = _block(y, torch.cat(dense), _rows(columns), encoder.cardinalities, source)
    data.info.update(encoder=encoder, skipped_lines=source.skipped)
    return data, source.skipped


def _rows(columns: list[np.ndarray]) -> np.ndarray:
    """Per-field id columns -> [n, F] int32, row-major (training gathers rows); column writes into one
    buffer measured faster than numpy's or torch's stack-and-transpose."""
    width = sum(1 if c.ndim == 1 else c.shape[1] for c in columns)
    out, at = np.empty((len(columns[0]), width), np.int32), 0
    for col in columns:
        step = 1 if col.ndim == 1 else col.shape[1]
        out[:, at : at + step] = col if col.ndim == 2 else col[:, None]
        at += step
    return out


__all__ = [
    "FORMATS",
    "blank_lines",
    "MalformedLineError",
    "ReaderConfig",
    "load_ctr_file",
    "read_ctr_file",
]
