"""Scores that are probabilities: temperature scaling (Guo et al., ICML 2017) and expected calibration error.

A task's classifier scores a text by cosine similarities to its label names; softmax(scale x cosines) is a
probability only for the right `scale`. `fit_scale` picks it on texts the adapter was not trained on (held out
of the task's training texts when it is learned), `expected_calibration_error` measures how far the scores are
from the accuracy they claim.
"""

from __future__ import annotations

import torch

SCALE_RANGE = (0.5, 200.0)
"""The scales `fit_scale` searches (log-spaced): a held-out set answered all right would push the scale to
infinity, so it stops at the range's end."""


def fit_scale(cosines: torch.Tensor, labels: torch.Tensor, *, prior: float | None = None, strength: float = 0.0,
              steps: int = 400) -> float:  # fmt: skip
    """The scale s in `SCALE_RANGE` minimising the summed negative log-likelihood of softmax(s x `cosines`)
    [N, C] for the true classes `labels` [N], plus `strength` x (ln s - ln `prior`)^2: the most probable scale
    under a log-normal prior centred on `prior` (MAP temperature scaling; `strength` 0: plain temperature
    scaling, Guo et al., 2017). The prior keeps a small held-out set answered all right from sending the
    scale to the range's end; the likelihood outweighs it as held-out texts accumulate. A grid in log space
    (one parameter, no optimiser needed); of equal losses the smallest scale, the least confident."""
    if cosines.ndim != 2 or labels.shape != cosines.shape[:1] or cosines.shape[0] == 0:
        raise ValueError(f"fit_scale needs cosines [N, C] and labels [N], N >= 1; got {tuple(cosines.shape)}")
    if strength < 0 or (strength > 0 and not (prior is not None and prior > 0)):
        raise ValueError(
            f"fit_scale needs strength >= 0 and, with a strength, a prior > 0; got {strength}, {prior}"
        )
    grid = torch.logspace(*torch.tensor(SCALE_RANGE).log10().tolist(), steps, dtype=torch.float64)
    cosines = cosines.double()
    nll = torch.stack([torch.nn.functional.cross_entropy(s * cosines, labels, reduction="sum") for s in grid])
    if strength > 0:
        nll = nll + strength * (grid.log() - torch.tensor(float(prior)).log()) ** 2
    return grid[nll.argmin()].item()


def expected_calibration_error(confidence: torch.Tensor, correct: torch.Tensor, *, bins: int = 15) -> float:
    """ECE: sum over `bins` equal-width confidence bins (0, 1/bins], ... of |bin| / N x |accuracy - mean
    confidence| of the answers in the bin; `confidence` [N] in [0, 1], `correct` [N] booleans (Naeini et al.,
    2015; a confidence of exactly 0 falls in the first bin)."""
    if confidence.shape != correct.shape or confidence.ndim != 1:
        raise ValueError("expected_calibration_error needs confidence [N] and correct [N]")
    if confidence.numel() == 0:
        return 0.0
    conf, hit = confidence.double(), correct.double()
    which = (conf * bins).ceil().long().clamp(1, bins) - 1
    count = torch.bincount(which, minlength=bins).double()
    gap = torch.bincount(which, weights=hit - conf, minlength=bins).abs()
    return (gap.sum() / count.sum()).item()


def holdout_split(labels: list[str], fraction: float, *, seed: int) -> tuple[list[int], list[int]]:
    """Indices (kept, held out) of examples with `labels`: per label, round(`fraction` x its count) of its
    examples drawn with `seed` are held out, leaving at least two of each label to train on (a task's router
    needs two texts of a label). Both lists in the examples' order."""
    import random

    rng, held = random.Random(seed), set()
    for label in dict.fromkeys(labels):
        members = [i for i, x in enumerate(labels) if x == label]
        take = max(0, min(round(fraction * len(members)), len(members) - 2))
        held.update(rng.sample(members, take))
    return [i for i in range(len(labels)) if i not in held], sorted(held)
