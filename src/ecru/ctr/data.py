"""In-memory CTR data (dense features, per-field categorical ids, labels), its splits and batches.

The file readers are in `ecru.ctr.reader`; tokens become ids in `ecru.ctr.tokens` (id 0 of every field is
the out-of-vocabulary / empty id).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ecru.ctr.tokens import VocabularyEncoder
from ecru.errors import EcruError


@dataclass
class CTRData:
    """Rows of a CTR data set held in memory, in file (chronological) order."""

    dense: Tensor
    """Numeric features [N, n_dense] float32 (already log-transformed)."""
    cats: Tensor
    """Per-field local categorical ids [N, F] int32 (field f's ids in [0, cardinalities[f]))."""
    labels: Tensor
    """Clicks [N] float32 in {0, 1} (NaN for a file read without its label column)."""
    cardinalities: tuple[int, ...]
    """Number of ids of each field."""
    info: dict = field(default_factory=dict)
    """Provenance and extra facts (e.g. the synthetic teacher's click probabilities)."""
    sequence_fields: int = 0
    """How many of the last fields are multi-hot: each takes `sequence_length` columns of `cats` (-1 = padding)."""
    sequence_length: int = 0
    """Id columns per sequence field."""

    def __post_init__(self) -> None:
        n = self.labels.shape[0]
        columns = len(self.cardinalities) + self.sequence_fields * (self.sequence_length - 1)
        if self.dense.shape[0] != n or self.cats.shape[0] != n or self.cats.shape[1] != columns:
            raise ValueError(
                f"inconsistent shapes: dense {tuple(self.dense.shape)}, cats {tuple(self.cats.shape)} "
                f"({self.sequence_fields} sequence fields of {self.sequence_length}), "
                f"labels {tuple(self.labels.shape)}, {len(self.cardinalities)} fields"
            )

    def __len__(self) -> int:
        return self.labels.shape[0]

    def subset(self, idx: Tensor | slice) -> CTRData:
        info = {
            k: (v[idx] if isinstance(v, Tensor) and v.shape[:1] == self.labels.shape else v)
            for k, v in self.info.items()
        }
        return CTRData(
            self.dense[idx],
            self.cats[idx],
            self.labels[idx],
            self.cardinalities,
            info,
            self.sequence_fields,
            self.sequence_length,
        )

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
        parts[0].sequence_fields,
        parts[0].sequence_length,
    )


def restrict_vocabulary_to_train(train: CTRData, test: CTRData, *, min_count: int) -> tuple[CTRData, CTRData]:
    """Map ids seen fewer than `min_count` times in `train` to the out-of-vocabulary id 0, in both splits.

    The reader fits its vocabulary on the whole file, before any split; without this step, test rows
    would decide which training ids get their own embedding row, and test-only ids would get rows that
    are never trained. Cardinalities are unchanged (the freed rows are simply never looked up).
    """
    if train.sequence_fields:
        raise ValueError("restrict_vocabulary_to_train handles single-hot fields only")
    train_cats, test_cats, live = train.cats.clone(), test.cats.clone(), []
    for f, card in enumerate(train.cardinalities):
        rare = torch.bincount(train.cats[:, f].long(), minlength=card) < min_count
        rare[0] = True
        live.append((~rare).numpy())
        for cats in (train_cats, test_cats):
            cats[:, f] = torch.where(rare[cats[:, f].long()], 0, cats[:, f])
    train_info, test_info = dict(train.info), dict(test.info)
    encoder = train.info.get("encoder")
    if isinstance(encoder, VocabularyEncoder):  # the saved vocabulary maps the freed tokens to id 0 as well
        train_info["encoder"] = test_info["encoder"] = encoder.restricted(live)
    return (
        CTRData(train.dense, train_cats, train.labels, train.cardinalities, train_info),
        CTRData(test.dense, test_cats, test.labels, test.cardinalities, test_info),
    )
