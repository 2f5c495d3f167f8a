"""Continual-learning metrics from an accuracy matrix, as defined by ZSCL (Zheng et al., ICCV 2023).

`R[i][j]` is the accuracy on task j+1 after training through task i+1 (0-based rows and columns here);
`R0[j]` is the pretrained model's accuracy on task j+1 before any training. Every metric is returned in
the units of `R` (fractions in, fractions out; percentages in, percentages out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ecru.errors import EcruError

Matrix = torch.Tensor | Sequence[Sequence[float]]


def _as_matrix(R: Matrix) -> torch.Tensor:
    R = torch.as_tensor(R, dtype=torch.float64)
    if R.ndim != 2 or R.shape[0] != R.shape[1] or R.shape[0] == 0:
        raise EcruError(
            f"R must be a square T x T accuracy matrix (row = after task, column = task); got shape {tuple(R.shape)}"
        )
    if not torch.isfinite(R).all():
        raise EcruError("R holds NaN or infinite accuracies; evaluate every task after every training task")
    return R


def _as_row(R0: Matrix, T: int) -> torch.Tensor:
    R0 = torch.as_tensor(R0, dtype=torch.float64)
    if R0.shape != (T,) or not torch.isfinite(R0).all():
        raise EcruError(
            f"R0 must be the pretrained model's {T} finite accuracies, one per task; got shape {tuple(R0.shape)}"
        )
    return R0


def transfer(R: torch.Tensor) -> float:
    """Mean over tasks j >= 2 of the mean accuracy on j before it was learned (rows 1..j-1)."""
    cols = [R[:j, j].mean() for j in range(1, R.shape[0])]
    return torch.stack(cols).mean().item() if cols else math.nan


def backward_transfer(R: torch.Tensor) -> float:
    """Mean over j < T of (final accuracy on j) - (accuracy on j right after learning it); < 0 = forgetting."""
    T = R.shape[0]
    return (R[-1, : T - 1] - R.diagonal()[: T - 1]).mean().item() if T > 1 else math.nan


def cl_metrics(R: Matrix, R0: Matrix | None = None) -> dict[str, float]:
    """Last, Avg., Transfer and BWT of `R`; with the pretrained row `R0` also FWT and transfer retention.

    Undefined metrics (Transfer, BWT, FWT with a single task) are NaN.
    """
    R = _as_matrix(R)
    T = R.shape[0]
    out = {
        "last": R[-1].mean().item(),
        "avg": R.mean().item(),
        "transfer": transfer(R),
        "bwt": backward_transfer(R),
    }
    if R0 is not None:
        R0 = _as_row(R0, T)
        unseen = R0[1:].mean().item() if T > 1 else math.nan
        out["fwt"] = (R.diagonal(1) - R0[1:]).mean().item() if T > 1 else math.nan
        out["transfer_retention"] = out["transfer"] - unseen
    return out
