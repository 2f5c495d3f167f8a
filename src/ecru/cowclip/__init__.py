"""CowClip: per-id adaptive gradient clipping and scaling rules for large-batch CTR training."""

from ecru.cowclip.clip import cowclip, id_counts, zeta_from_paper
from ecru.cowclip.recipes import RECIPES, Recipe, cowclip_recipe, scaled_recipe
from ecru.cowclip.row_sparse_adam import RowSparseAdam
from ecru.cowclip.wrapper import ClipStats, CowClip

__all__ = [
    "RECIPES",
    "ClipStats",
    "CowClip",
    "Recipe",
    "RowSparseAdam",
    "cowclip",
    "cowclip_recipe",
    "id_counts",
    "scaled_recipe",
    "zeta_from_paper",
]
