"""Large-batch scaling recipes: learning rates, L2, zeta and warm-up as functions of the batch size.

`cowclip_recipe` is the paper's table (Zheng et al., AAAI 2023, and its reference code); `scaled_recipe`
gives the baselines (no scaling, sqrt, linear) and the "tempered" rule measured best for few-step
large-batch runs (embedding LR x s, dense LR x s^0.75, L2 x sqrt(s), warm-up over 1/s of an epoch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

RECIPES = ("adam", "adam-sqrt", "linear", "cowclip", "tempered")
_ALIASES = {"ecru": "tempered"}  # the name "tempered" had before (kept so old scripts still run)
_BASE = {  # 1K settings of the reference runs: (embedding LR, dense LR, L2 lambda)
    "criteo": (1e-4, 8e-4, 1e-5),
    "avazu": (1e-4, 1e-4, 1e-5),
}


@dataclass(frozen=True)
class Recipe:
    """Optimizer settings for one batch size (two Adams: embeddings and dense layers)."""

    name: str
    """Which rule produced it (one of RECIPES)."""
    batch_size: int
    """The global batch size the settings are for."""
    embed_lr: float
    """Adam learning rate of the embedding tables (fixed, no warm-up)."""
    dense_lr: float
    """Adam learning rate of the dense layers (after warm-up)."""
    l2: float
    """Keras-style L2 coefficient lambda on the embedding tables (loss term lambda * ||W||^2)."""
    clip: bool = False
    """Apply the CowClip per-id clip to the dim > 1 embedding tables."""
    r: float = 1.0
    """CowClip threshold ratio to the row's weight norm."""
    zeta: float = 1e-5
    """CowClip per-coordinate floor of the threshold (ecru.cowclip.clip: the reference code's form)."""
    warmup_epochs: float = 1.0
    """Linear warm-up of the dense learning rate over this many epochs (then constant)."""
    eps: float = 1e-7
    """Adam epsilon (Keras' default, as in the reference runs)."""

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or min(self.embed_lr, self.dense_lr) <= 0 or self.l2 < 0:
            raise ValueError(f"invalid recipe {self}: batch size and learning rates must be > 0, l2 >= 0")
        if self.warmup_epochs < 0:
            raise ValueError("warmup_epochs must be >= 0")

    @property
    def threshold(self) -> str:
        """The form of `zeta`: always the reference code's (see ecru.cowclip.clip)."""
        return "code"

    @property
    def weight_decay(self) -> float:
        """PyTorch weight decay equivalent to Keras l2(lambda): the gradient of lambda ||w||^2."""
        return 2 * self.l2


def _scale(batch_size: int, base_batch: int, dataset: str) -> float:
    if batch_size <= 0 or base_batch <= 0:
        raise ValueError(f"batch sizes must be positive, got {batch_size} and base {base_batch}")
    if dataset not in _BASE:
        raise ValueError(f"dataset must be one of {sorted(_BASE)}, got {dataset!r}")
    return batch_size / base_batch


def _base(dataset: str, embed_lr: float | None) -> tuple[float, float, float]:
    """The base batch's (embedding LR, dense LR, L2 lambda): the table's, with `embed_lr` if given."""
    table_embed_lr, dense_lr, l2 = _BASE[dataset]
    return (table_embed_lr if embed_lr is None else embed_lr), dense_lr, l2


def cowclip_recipe(
    batch_size: int, *, base_batch: int = 1024, dataset: str = "criteo", embed_lr: float | None = None
) -> Recipe:
    """The CowClip paper's settings: embedding LR fixed, dense LR x sqrt(s), L2 x s, r = 1, zeta fixed.

    Avazu's table departs from the rule at 128x (dense LR 16e-4, L2 96e-5) and uses zeta 1e-3 up to 2x.
    `embed_lr`: the embedding LR at the base batch (None: the table's).
    """
    s = _scale(batch_size, base_batch, dataset)
    embed_lr, dense_lr, l2 = _base(dataset, embed_lr)
    dense_lr, l2, zeta = dense_lr * math.sqrt(s), l2 * s, 1e-5
    if dataset == "avazu":
        zeta = 1e-3 if s <= 2 else 1e-4
        if s >= 128:
            dense_lr, l2 = 16e-4, 96e-5
    return Recipe("cowclip", batch_size, embed_lr, dense_lr, l2, clip=True, zeta=zeta)


def scaled_recipe(
    name: str,
    batch_size: int,
    *,
    base_batch: int = 1024,
    dataset: str = "criteo",
    embed_lr: float | None = None,
) -> Recipe:
    """A named recipe at `batch_size`; `embed_lr` replaces the table's embedding LR at the base batch (each
    recipe then scales it as it scales the table's).

    - adam: the 1K settings unchanged.
    - adam-sqrt: dense LR x sqrt(s), L2 x s (the CowClip rules without the clip).
    - linear: both LRs x s, L2 x s.
    - cowclip: `cowclip_recipe`.
    - tempered: embedding LR x s, dense LR x s^0.75, L2 x sqrt(s), dense warm-up over 1/s epochs, no clip
      (called "ecru" before; that name still selects it).

    Why the tempered rule: Adam moves each coordinate by about its learning rate per step whatever the gradient's
    size, so s times fewer steps need an s times larger embedding LR for frequent rows to travel as far
    (rare rows get about one update per occurrence at any batch size); the dense layers' gradient noise
    falls with the batch, and between the sqrt and linear rules s^0.75 was best measured. A rare id's
    batch-mean data gradient shrinks like cnt/B while the L2 gradient does not, so L2 x s over-regularises
    rare rows at large batch; L2 x sqrt(s) measured better. A whole-epoch warm-up would spend most of a
    few-step run warming up. Chosen among 9 candidate rules on the quick benchmark's setting (seed 0), then
    checked against 3 others on held-out seeds 10-12 (data, teacher, init and batch order;
    bench/experiments/ctr_recipe_search.py, bench/results/ctr_recipe_search.json): 32x within 0.0018 AUC of
    1K on each. Measured on that synthetic setting at ~30 large-batch steps, not proven in general.
    """
    name = _ALIASES.get(name, name)
    s = _scale(batch_size, base_batch, dataset)
    embed_lr, dense_lr, l2 = _base(dataset, embed_lr)
    if name == "cowclip":
        return cowclip_recipe(batch_size, base_batch=base_batch, dataset=dataset, embed_lr=embed_lr)
    if name == "adam":
        return Recipe("adam", batch_size, embed_lr, dense_lr, l2)
    if name == "adam-sqrt":
        return replace(
            cowclip_recipe(batch_size, base_batch=base_batch, dataset=dataset, embed_lr=embed_lr),
            name=name,
            clip=False,
        )
    if name == "linear":
        return Recipe("linear", batch_size, embed_lr * s, dense_lr * s, l2 * s)
    if name == "tempered":
        return Recipe(
            "tempered", batch_size, embed_lr * s, dense_lr * s**0.75, l2 * math.sqrt(s), warmup_epochs=1 / s
        )
    raise ValueError(f"unknown recipe {name!r}; choose from {RECIPES}")
