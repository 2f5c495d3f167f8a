"""Synthetic Criteo-shaped CTR data with a known optimum.

26 categorical fields at Criteo's cardinalities x `scale`, bounded Zipf ids, 13 log-normal count
features, and a teacher factorisation machine giving each row's true click probability

    logit = b0 + sum_f u_f[id_f] + sum_{f<g} <v_f[id_f], v_g[id_g]> + beta . x_dense,

b0 calibrated to the label rate, y ~ Bernoulli(sigmoid(logit)). Ranking by the true probability is
Bayes-optimal, so the oracle AUC and logloss bound every model. The rows can be written as Criteo TSV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ecru.ctr.data import CTRData
from ecru.ctr.metrics import auc, logloss
from ecru.io import atomic_path

CRITEO_CARDINALITIES = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)


@dataclass(frozen=True)
class SyntheticConfig:
    """Size and teacher of a synthetic Criteo-shaped data set."""

    n_rows: int = 200_000
    """Rows to generate."""
    scale: float = 1e-2
    """Cardinalities are Criteo's times this (at least 2 ids per field)."""
    zipf: float = 1.1
    """Exponent of the bounded Zipf law of ids within a field."""
    teacher_dim: int = 4
    """Dimension of the teacher FM's factors."""
    u_std: float = 0.2
    """Std of the teacher's first-order id weights."""
    v_std: float = 0.16
    """Std of the teacher's factor entries."""
    beta_std: float = 0.15
    """Std of the teacher's weights on the dense features."""
    label_rate: float = 0.25
    """Mean click probability (b0 is calibrated to it)."""
    seed: int = 0
    """Seed of the teacher and of the rows."""
    fields: int = 26
    """Categorical fields: the first `fields` of Criteo's 26 (fewer make a cheaper reduced setting)."""

    def __post_init__(self) -> None:
        if self.n_rows < 1 or self.scale <= 0 or self.zipf <= 0 or self.teacher_dim < 1:
            raise ValueError(f"invalid synthetic config {self}")
        if not 1 <= self.fields <= len(CRITEO_CARDINALITIES):
            raise ValueError(f"fields must be in [1, {len(CRITEO_CARDINALITIES)}], got {self.fields}")
        if not 0 < self.label_rate < 1:
            raise ValueError(f"label_rate must be in (0, 1), got {self.label_rate}")

    @property
    def cardinalities(self) -> tuple[int, ...]:
        return tuple(max(2, round(c * self.scale)) for c in CRITEO_CARDINALITIES[: self.fields])


def zipf_ids(n: int, cardinality: int, exponent: float, gen: torch.Generator) -> Tensor:
    """n ids in [0, cardinality) with P(k) proportional to (k + 1)^-exponent."""
    cdf = torch.arange(1, cardinality + 1, dtype=torch.float64).pow(-exponent).cumsum(0)
    return torch.searchsorted(cdf / cdf[-1], torch.rand(n, generator=gen, dtype=torch.float64)).clamp_(
        max=cardinality - 1
    )


def _calibrate(z: Tensor, rate: float) -> float:
    """b0 with mean(sigmoid(b0 + z)) = rate (bisection; the mean is increasing in b0)."""
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if torch.sigmoid(z + mid).mean() < rate else (lo, mid)
    return (lo + hi) / 2


def generate(cfg: SyntheticConfig) -> CTRData:
    """Rows with `info["prob"]` (true click probability) and `info["counts"]` (raw dense counts, -1 = empty)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    cards = cfg.cardinalities
    cats = torch.stack([zipf_ids(cfg.n_rows, c, cfg.zipf, gen) for c in cards], 1)
    counts = torch.exp(torch.randn(cfg.n_rows, 13, generator=gen) * 1.2 + 1.0).floor() - 1
    counts[torch.rand(cfg.n_rows, 13, generator=gen) < 0.1] = -1  # empty in the TSV
    dense = torch.log1p(counts.clamp(min=0))
    z = dense @ (torch.randn(13, generator=gen) * cfg.beta_std)
    pair = torch.zeros(cfg.n_rows, cfg.teacher_dim)
    sq = torch.zeros(cfg.n_rows)
    for f, c in enumerate(cards):  # one field at a time keeps memory at one [V_f, k] table
        u = torch.randn(c, generator=gen) * cfg.u_std
        v = torch.randn(c, cfg.teacher_dim, generator=gen) * cfg.v_std
        z += u[cats[:, f]]
        vf = v[cats[:, f]]
        pair += vf
        sq += vf.pow(2).sum(1)
    z += 0.5 * (pair.pow(2).sum(1) - sq)
    prob = torch.sigmoid(z + _calibrate(z, cfg.label_rate))
    labels = torch.bernoulli(prob, generator=gen)
    info = {"source": f"synthetic:{cfg}", "prob": prob, "counts": counts}
    return CTRData(dense.float(), cats.int(), labels.float(), cards, info)


def expected_oracle(prob: Tensor) -> tuple[float, float]:
    """Expected AUC and logloss of ranking by the true probability, over labels y ~ Bernoulli(prob).

    AUC: sum over pairs i != j of p_i (1 - p_j) [p_i > p_j] over sum of p_i (1 - p_j) (a ratio of
    expectations, exact as n grows); logloss: the mean binary entropy.
    """
    p = prob.double().sort().values
    below = torch.cumsum(1 - p, 0) - (1 - p)  # sum of (1 - p_j) over j ranked below i
    pairs = p.sum() * (1 - p).sum() - (p * (1 - p)).sum()
    entropy = -(p * p.clamp_min(1e-12).log() + (1 - p) * (1 - p).clamp_min(1e-12).log())
    return float((p * below).sum() / pairs), float(entropy.mean())


def realised_oracle(data: CTRData) -> tuple[float, float]:
    """AUC and logloss of the true probability on the drawn labels (what a perfect model scores)."""
    return auc(data.labels, data.info["prob"]), logloss(data.labels, data.info["prob"])


def write_criteo_tsv(data: CTRData, path: str | Path) -> Path:
    """Write the rows as Criteo TSV: label, 13 counts (empty where missing), 26 8-hex-digit hashes (through a
    temporary file renamed into place: never a half-written file)."""
    path = Path(path)
    counts, cats = data.info["counts"].long().tolist(), data.cats.long().tolist()
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for y, row_counts, row_cats in zip(data.labels.long().tolist(), counts, cats, strict=True):
            ints = ["" if c < 0 else str(c) for c in row_counts]
            hexes = [f"{(i * 2654435761 + fld * 40503 + 1) % 2**32:08x}" for fld, i in enumerate(row_cats)]
            f.write("\t".join([str(y), *ints, *hexes]) + "\n")
    return path


def oracle_summary(data: CTRData) -> dict[str, float]:
    a, ll = realised_oracle(data)
    ea, ell = expected_oracle(data.info["prob"])
    return {
        "oracle_auc": a,
        "oracle_logloss": ll,
        "expected_oracle_auc": ea,
        "expected_oracle_logloss": ell,
        "label_rate": float(data.labels.mean()),
        "rows": len(data),
        "ids": sum(data.cardinalities),
        "entropy_bits": ell / math.log(2),
    }
