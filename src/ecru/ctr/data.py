"""In-memory CTR data, its splits and batches, and streaming readers of the Criteo TSV and Avazu CSV formats.

Criteo (Kaggle display advertising): `label \\t I1..I13 \\t C1..C26`, counts may be empty (-> 0), categoricals
are 8-hex-digit hashes or empty. Counts become log(1 + max(x, 0)). Avazu: a CSV with a header,
`id,click,hour,C1,banner_pos,...,C21`; the 21 categorical columns plus hour-of-day become 22 fields.
Categorical tokens become per-field ids by hashing or by a vocabulary with a frequency threshold (ids
rarer than `min_count`, and empty tokens, share id 0).
"""

from __future__ import annotations

import gzip
import math
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ecru.errors import EcruError, MissingAssetError

CRITEO_FIELDS, CRITEO_DENSE = 26, 13
AVAZU_COLUMNS = 24  # id, click, hour + 21 categoricals


@dataclass
class CTRData:
    """Rows of a CTR data set held in memory, in file (chronological) order."""

    dense: Tensor
    """Numeric features [N, n_dense] float32 (already log-transformed)."""
    cats: Tensor
    """Per-field local categorical ids [N, F] int32 (field f's ids in [0, cardinalities[f]))."""
    labels: Tensor
    """Clicks [N] float32 in {0, 1}."""
    cardinalities: tuple[int, ...]
    """Number of ids of each field."""
    info: dict = field(default_factory=dict)
    """Provenance and extra facts (e.g. the synthetic teacher's click probabilities)."""

    def __post_init__(self) -> None:
        n = self.labels.shape[0]
        if (
            self.dense.shape[0] != n
            or self.cats.shape[0] != n
            or self.cats.shape[1] != len(self.cardinalities)
        ):
            raise ValueError(
                f"inconsistent shapes: dense {tuple(self.dense.shape)}, cats {tuple(self.cats.shape)}, "
                f"labels {tuple(self.labels.shape)}, {len(self.cardinalities)} fields"
            )

    def __len__(self) -> int:
        return self.labels.shape[0]

    def subset(self, idx: Tensor | slice) -> CTRData:
        info = {
            k: (v[idx] if isinstance(v, Tensor) and v.shape[:1] == self.labels.shape else v)
            for k, v in self.info.items()
        }
        return CTRData(self.dense[idx], self.cats[idx], self.labels[idx], self.cardinalities, info)

    def split_random(self, test_fraction: float, *, seed: int = 0) -> tuple[CTRData, CTRData]:
        """A seeded random (train, test) split, as the CowClip paper's 90/10 Criteo split."""
        n_test = _n_test(len(self), test_fraction)
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        return self.subset(perm[n_test:].sort().values), self.subset(perm[:n_test].sort().values)

    def split_chronological(self, test_fraction: float) -> tuple[CTRData, CTRData]:
        """The last `test_fraction` of the rows (in file order, which is time order) is the test set."""
        n_train = len(self) - _n_test(len(self), test_fraction)
        return self.subset(slice(0, n_train)), self.subset(slice(n_train, None))

    def batches(
        self, batch_size: int, *, seed: int | None = None, drop_last: bool = False
    ) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """(dense, cats int64, labels) batches, shuffled by `seed` (None: file order)."""
        order = (
            None if seed is None else torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        )
        stop = len(self) - (len(self) % batch_size if drop_last else 0)
        for start in range(0, stop, batch_size):
            idx = slice(start, start + batch_size) if order is None else order[start : start + batch_size]
            yield self.dense[idx], self.cats[idx].long(), self.labels[idx]


def _n_test(n: int, fraction: float) -> int:
    if not 0 < fraction < 1:
        raise ValueError(f"test fraction must be in (0, 1), got {fraction}")
    return max(1, round(n * fraction))


def concat(parts: list[CTRData]) -> CTRData:
    if not parts:
        raise EcruError("no rows were read")
    return CTRData(
        torch.cat([p.dense for p in parts]),
        torch.cat([p.cats for p in parts]),
        torch.cat([p.labels for p in parts]),
        parts[0].cardinalities,
        dict(parts[0].info),
    )


class MalformedLineError(EcruError, ValueError):
    """A line of a data file that does not parse; the message names the file and line number."""


@dataclass(frozen=True)
class ReaderConfig:
    """How raw CTR files become ids."""

    hash_buckets: int = 0
    """> 0: hash each field's tokens into this many ids; 0: build vocabularies (a first pass over the file)."""
    min_count: int = 1
    """Vocabulary mode: tokens seen fewer times share the out-of-vocabulary id 0."""
    skip_malformed: bool = False
    """Skip and count malformed lines instead of raising an error naming the line."""
    chunk_rows: int = 100_000
    """Rows per chunk yielded by the streaming readers."""

    def __post_init__(self) -> None:
        if self.hash_buckets < 0 or self.hash_buckets == 1 or self.min_count < 1 or self.chunk_rows < 1:
            raise ValueError(
                f"invalid reader config {self}: hash_buckets 0 or >= 2, min_count >= 1, chunk_rows >= 1"
            )


def parse_criteo(line: str) -> tuple[float, list[float], list[str]]:
    parts = line.rstrip("\r\n").split("\t")
    if len(parts) != 1 + CRITEO_DENSE + CRITEO_FIELDS:
        raise ValueError(f"expected 40 tab-separated fields, got {len(parts)}")
    if parts[0] not in ("0", "1"):
        raise ValueError(f"label must be 0 or 1, got {parts[0]!r}")
    try:
        dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in parts[1 : 1 + CRITEO_DENSE]]
    except ValueError as exc:
        raise ValueError(f"integer feature: {exc}") from None
    cats = parts[1 + CRITEO_DENSE :]
    for c in cats:
        if c and not all(ch in "0123456789abcdefABCDEF" for ch in c):
            raise ValueError(f"categorical {c!r} is not hexadecimal")
    return float(parts[0]), dense, cats


def parse_avazu(line: str) -> tuple[float, list[float], list[str]]:
    parts = line.rstrip("\r\n").split(",")
    if len(parts) != AVAZU_COLUMNS:
        raise ValueError(f"expected {AVAZU_COLUMNS} comma-separated columns, got {len(parts)}")
    if parts[1] not in ("0", "1"):
        raise ValueError(f"click must be 0 or 1, got {parts[1]!r}")
    if len(parts[2]) != 8 or not parts[2].isdigit():
        raise ValueError(f"hour must be YYMMDDHH, got {parts[2]!r}")
    return float(parts[1]), [], [*parts[3:], parts[2][-2:]]


FORMATS = {"criteo": (parse_criteo, CRITEO_FIELDS, CRITEO_DENSE, False), "avazu": (parse_avazu, 22, 0, True)}


def _open(path: Path):
    if not path.is_file():
        raise MissingAssetError(f"data file {path} not found")
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def parsed_lines(
    path: Path, fmt: str, *, skip_malformed: bool, skipped: Counter
) -> Iterator[tuple[float, list[float], list[str]]]:
    """Parsed rows of a file; malformed lines raise MalformedLineError (file:line) or are counted."""
    parse, _, _, header = FORMATS[fmt]
    with _open(path) as f:
        for line_no, line in enumerate(f, 1):
            if (header and line_no == 1) or not line.strip():
                continue
            try:
                yield parse(line)
            except ValueError as exc:
                if not skip_malformed:
                    raise MalformedLineError(
                        f"{path}:{line_no}: malformed {fmt} line ({exc}); "
                        "fix the file or pass skip_malformed=True (--skip-malformed)"
                    ) from None
                skipped["lines"] += 1


class Encoder:
    """Token -> per-field id, by hashing or by vocabularies fitted on a first pass."""

    def __init__(self, n_fields: int, cfg: ReaderConfig) -> None:
        self.cfg, self.vocab = cfg, [dict() for _ in range(n_fields)]

    def fit(self, rows: Iterator[tuple[float, list[float], list[str]]]) -> Encoder:
        if self.cfg.hash_buckets:
            return self
        counts = [Counter() for _ in self.vocab]
        for _, _, cats in rows:
            for c, tok in zip(counts, cats, strict=True):
                c[tok] += 1
        for v, c in zip(self.vocab, counts, strict=True):
            kept = sorted(t for t, n in c.items() if n >= self.cfg.min_count and t)
            v.update((t, i) for i, t in enumerate(kept, 1))
        return self

    @property
    def cardinalities(self) -> tuple[int, ...]:
        return tuple(self.cfg.hash_buckets or len(v) + 1 for v in self.vocab)

    def encode(self, cats: list[str]) -> list[int]:
        if self.cfg.hash_buckets:
            b = self.cfg.hash_buckets - 1
            return [zlib.crc32(t.encode()) % b + 1 if t else 0 for t in cats]
        return [v.get(t, 0) for v, t in zip(self.vocab, cats, strict=True)]


def read_ctr_file(
    path: str | Path,
    fmt: str,
    *,
    cfg: ReaderConfig = ReaderConfig(),
    encoder: Encoder | None = None,
    skipped: Counter | None = None,
) -> Iterator[CTRData]:
    """Stream a Criteo TSV (`fmt="criteo"`) or Avazu CSV (`"avazu"`) file as CTRData chunks.

    Without an `encoder` one is fitted first (a pass over the file in vocabulary mode). Malformed lines
    raise `MalformedLineError` naming file and line, or are skipped and counted in `skipped["lines"]`.
    """
    if fmt not in FORMATS:
        raise EcruError(f"unknown data format {fmt!r}; choose from {sorted(FORMATS)}")
    path, skipped = Path(path), skipped if skipped is not None else Counter()
    _, n_fields, n_dense, _ = FORMATS[fmt]
    if encoder is None:
        encoder = Encoder(n_fields, cfg).fit(
            parsed_lines(path, fmt, skip_malformed=cfg.skip_malformed, skipped=Counter())
        )
    labels, dense, cats = [], [], []
    for label, d, c in parsed_lines(path, fmt, skip_malformed=cfg.skip_malformed, skipped=skipped):
        labels.append(label), dense.append(d), cats.append(encoder.encode(c))
        if len(labels) == cfg.chunk_rows:
            yield _chunk(labels, dense, cats, n_dense, encoder, path, fmt)
            labels, dense, cats = [], [], []
    if labels:
        yield _chunk(labels, dense, cats, n_dense, encoder, path, fmt)


def _chunk(labels, dense, cats, n_dense, encoder, path, fmt) -> CTRData:
    return CTRData(
        torch.tensor(dense, dtype=torch.float32).reshape(len(labels), n_dense),
        torch.tensor(cats, dtype=torch.int32),
        torch.tensor(labels, dtype=torch.float32),
        encoder.cardinalities,
        {"source": f"{fmt}:{path}"},
    )


def restrict_vocabulary_to_train(train: CTRData, test: CTRData, *, min_count: int) -> tuple[CTRData, CTRData]:
    """Map ids seen fewer than `min_count` times in `train` to the out-of-vocabulary id 0, in both splits.

    The reader fits its vocabulary on the whole file, before any split; without this step, test rows
    would decide which training ids get their own embedding row, and test-only ids would get rows that
    are never trained. Cardinalities are unchanged (the freed rows are simply never looked up).
    """
    train_cats, test_cats = train.cats.clone(), test.cats.clone()
    for f, card in enumerate(train.cardinalities):
        rare = torch.bincount(train.cats[:, f].long(), minlength=card) < min_count
        rare[0] = True
        for cats in (train_cats, test_cats):
            cats[:, f] = torch.where(rare[cats[:, f].long()], 0, cats[:, f])
    return (
        CTRData(train.dense, train_cats, train.labels, train.cardinalities, dict(train.info)),
        CTRData(test.dense, test_cats, test.labels, test.cardinalities, dict(test.info)),
    )


def load_ctr_file(path: str | Path, fmt: str, *, cfg: ReaderConfig = ReaderConfig()) -> tuple[CTRData, int]:
    """The whole file in memory (in file order) and the number of malformed lines skipped."""
    skipped: Counter = Counter()
    data = concat(list(read_ctr_file(path, fmt, cfg=cfg, skipped=skipped)))
    data.info["skipped_lines"] = skipped["lines"]
    return data, skipped["lines"]
