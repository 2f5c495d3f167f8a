"""CowClip: per-id adaptive gradient clipping and scaling rules for large-batch CTR training."""

from ecru.cowclip.clip import cowclip, zeta_from_paper
from ecru.cowclip.ids import UniqueIds
from ecru.cowclip.recipes import RECIPES, Recipe, cowclip_recipe, scaled_recipe
from ecru.cowclip.row_sparse_adam import RowSparseAdam
from ecru.cowclip.wrapper import ClipStats, CowClip

__all__ = [
    "RECIPES",
    "ClipStats",
    "CowClip",
    "Recipe",
    "RowSparseAdam",
    "UniqueIds",
    "cowclip",
    "cowclip_recipe",
    "scaled_recipe",
    "zeta_from_paper",
]
