"""CTR models: DeepFM, Wide&Deep, DCN and DCN-v2 over one shared feature layout.

Every model has the same two embedding tables, so the optimizer and CowClip treat all of them alike:
- `embedding`: all fields' ids in one `nn.Embedding(sum(cardinalities), embed_dim)`, field f's local id i
  at global row offsets[f] + i (ids of different fields never collide, so a batch's ids `[B, F]` are the
  multi-hot id tensor CowClip counts samples with);
- `linear`: the first-order (dim-1, zero-initialised) table, never clipped.

Multi-hot (sequence) fields: the last `sequence_fields` fields of the config take `sequence_length` id
columns each (-1 = padding) and are pooled, mean of the ids present, by `F.embedding_bag` over the same
tables (an extra padding row at the end, excluded from the mean and from the gradient); each pooled vector is
one more field for the interaction part. CowClip counts a sequence's ids once per sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MODELS = ("deepfm", "wdl", "dcn", "dcnv2")


@dataclass(frozen=True)
class CTRConfig:
    """Shape and hyper-parameters of a CTR model (defaults: the CowClip paper's)."""

    cardinalities: tuple[int, ...]
    """Number of ids of each categorical field."""
    n_dense: int = 13
    """Number of numeric features (fed to the deep part and the linear part)."""
    embed_dim: int = 10
    """Embedding dimension of every field."""
    mlp: tuple[int, ...] = (400, 400, 400)
    """Hidden widths of the deep part."""
    cross_layers: int = 3
    """Cross layers of DCN / DCN-v2."""
    init_std: float = 0.01
    """Standard deviation of the N(0, std^2) embedding initialisation."""
    sparse: bool = False
    """Sparse embedding gradients (for the row-sparse update mode)."""
    sequence_fields: int = 0
    """How many of the last fields are multi-hot (sequence) fields."""
    sequence_length: int = 0
    """Id columns per sequence field (padded with -1)."""
    base_rate: float | None = None
    """The training click rate: if set, the model starts by predicting it for every sample (output layer and
    dense linear term zero-initialised, output bias = its logit), so the first loss is the label entropy
    instead of that of a random logit; None keeps PyTorch's default initialisation."""

    def __post_init__(self) -> None:
        if not self.cardinalities or min(self.cardinalities) < 1:
            raise ValueError(
                f"cardinalities must be a non-empty list of positive ints, got {self.cardinalities}"
            )
        if self.base_rate is not None and not 0 < self.base_rate < 1:
            raise ValueError(f"base_rate must lie in (0, 1), got {self.base_rate}")
        if not 0 <= self.sequence_fields <= len(self.cardinalities) or (
            (self.sequence_fields > 0) != (self.sequence_length > 0)
        ):
            raise ValueError(
                f"sequence_fields ({self.sequence_fields}) must be in [0, {len(self.cardinalities)}] and "
                f"sequence_length ({self.sequence_length}) > 0 exactly when there are sequence fields"
            )
        if self.n_dense < 0 or self.embed_dim < 1 or self.cross_layers < 0 or any(w < 1 for w in self.mlp):
            raise ValueError(f"invalid model sizes in {self}")

    @property
    def n_columns(self) -> int:
        """Id columns of a batch: one per single-hot field, `sequence_length` per sequence field."""
        return len(self.cardinalities) + self.sequence_fields * (self.sequence_length - 1)


class FeatureTables(nn.Module):
    """The field embeddings [B, F, d] and the first-order logit [B] of a batch."""

    def __init__(self, cfg: CTRConfig) -> None:
        super().__init__()
        total = sum(cfg.cardinalities)
        fields = torch.tensor([0, *cfg.cardinalities[:-1]]).cumsum(0)
        self.single = len(cfg.cardinalities) - cfg.sequence_fields
        self.bags, self.bag_length = cfg.sequence_fields, cfg.sequence_length
        offsets = torch.cat([fields[: self.single], fields[self.single :].repeat_interleave(self.bag_length)])
        self.register_buffer("offsets", offsets, persistent=False)
        self.pad = total  # the padding row of sequence fields (only present when there are any)
        rows = total + (1 if self.bags else 0)
        self.embedding = nn.Embedding(rows, cfg.embed_dim, sparse=cfg.sparse)
        self.linear = nn.Embedding(rows, 1, sparse=cfg.sparse)
        self.dense_linear = nn.Linear(cfg.n_dense, 1) if cfg.n_dense else None
        nn.init.normal_(self.embedding.weight, std=cfg.init_std)
        nn.init.zeros_(self.linear.weight)
        if self.bags:
            with torch.no_grad():
                self.embedding.weight[self.pad].zero_()

    def global_ids(self, cats: Tensor) -> Tensor:
        """Per-column local ids [B, C] -> rows of the shared tables [B, C] (padding stays -1)."""
        ids = cats + self.offsets
        return torch.where(cats >= 0, ids, -1) if self.bags else ids

    def _pooled(self, table: nn.Embedding, bags: Tensor) -> Tensor:
        """Mean of the present ids of each bag [N, L] -> [N, dim] (an empty bag gives zeros)."""
        ids = torch.where(bags >= 0, bags, self.pad)
        return F.embedding_bag(ids, table.weight, mode="mean", padding_idx=self.pad, sparse=table.sparse)

    def _lookup(self, table: nn.Embedding, ids: Tensor) -> Tensor:
        """[B, fields, dim]: single-hot rows, then each sequence field's pooled row."""
        single = ids[:, : self.single]
        if table.sparse:
            out = table(single)
        else:  # same values and gradient; index_select's backward (index_add_) is ~6x faster on CPU
            out = table.weight.index_select(0, single.reshape(-1)).view(*single.shape, table.weight.shape[1])
        if self.bags:
            bags = ids[:, self.single :].reshape(-1, self.bag_length)
            out = torch.cat([out, self._pooled(table, bags).view(ids.shape[0], self.bags, -1)], 1)
        return out

    def forward(self, dense: Tensor, cats: Tensor) -> tuple[Tensor, Tensor]:
        ids = self.global_ids(cats)
        first = self._lookup(self.linear, ids).sum((1, 2))
        if self.dense_linear is not None:
            first = first + self.dense_linear(dense).squeeze(-1)
        return self._lookup(self.embedding, ids), first


def mlp(widths: Sequence[int], n_in: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for w in widths:
        layers += [nn.Linear(n_in, w), nn.ReLU()]
        n_in = w
    return nn.Sequential(*layers)


class CTRModel(nn.Module):
    """A CTR model: first-order logit + the variant's interaction logit. `forward` returns logits [B]."""

    def __init__(self, cfg: CTRConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tables = FeatureTables(cfg)
        self.n_in = len(cfg.cardinalities) * cfg.embed_dim + cfg.n_dense

    def embedding_tables(self) -> list[nn.Parameter]:
        """The tables CowClip registers: the dim-d table (clipped) and the dim-1 table (L2 only)."""
        return [self.tables.embedding.weight, self.tables.linear.weight]

    def dense_parameters(self) -> list[nn.Parameter]:
        tables = {id(p) for p in self.embedding_tables()}
        return [p for p in self.parameters() if id(p) not in tables]

    def forward(self, dense: Tensor, cats: Tensor) -> Tensor:
        emb, first = self.tables(dense, cats)
        return first + self.interaction(emb, torch.cat([emb.flatten(1), dense], 1))

    def interaction(self, emb: Tensor, flat: Tensor) -> Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def start_at(self, rate: float) -> None:
        """Predict `rate` for every sample before training: zero output layer and dense linear term, bias
        logit(rate) (the FM term of the small initial embeddings stays, ~1e-3)."""
        self.head.weight.zero_()
        self.head.bias.fill_(math.log(rate / (1 - rate)))
        if self.tables.dense_linear is not None:
            self.tables.dense_linear.weight.zero_(), self.tables.dense_linear.bias.zero_()


class WideDeep(CTRModel):
    """Wide&Deep (Cheng et al. 2016): linear part + MLP on the concatenated embeddings."""

    def __init__(self, cfg: CTRConfig) -> None:
        super().__init__(cfg)
        self.deep = mlp(cfg.mlp, self.n_in)
        self.head = nn.Linear(cfg.mlp[-1] if cfg.mlp else self.n_in, 1)

    def interaction(self, emb: Tensor, flat: Tensor) -> Tensor:
        return self.head(self.deep(flat)).squeeze(-1)


def fm_logit(emb: Tensor) -> Tensor:
    """Sum over field pairs f < g of <v_f, v_g>, as 0.5 * ((sum v)^2 - sum v^2) summed over dims."""
    return 0.5 * (emb.sum(1).pow(2) - emb.pow(2).sum(1)).sum(-1)


class DeepFM(WideDeep):
    """DeepFM (Guo et al. 2017): Wide&Deep plus the FM pairwise term on the shared embeddings."""

    def interaction(self, emb: Tensor, flat: Tensor) -> Tensor:
        return fm_logit(emb) + super().interaction(emb, flat)


class CrossLayer(nn.Module):
    """x_{l+1} = x0 * (x_l . w) + b + x_l (DCN), or x0 * (W x_l + b) + x_l (DCN-v2, `full=True`)."""

    def __init__(self, n: int, *, full: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(n, n if full else 1, bias=full)
        self.bias = None if full else nn.Parameter(torch.zeros(n))

    def forward(self, x0: Tensor, x: Tensor) -> Tensor:
        out = x0 * self.proj(x) + x
        return out if self.bias is None else out + self.bias


class DCN(CTRModel):
    """Deep & Cross Network (Wang et al. 2017; DCN-v2 2021 with `full=True`): cross stack beside an MLP."""

    full = False

    def __init__(self, cfg: CTRConfig) -> None:
        super().__init__(cfg)
        self.cross = nn.ModuleList(CrossLayer(self.n_in, full=self.full) for _ in range(cfg.cross_layers))
        self.deep = mlp(cfg.mlp, self.n_in)
        self.head = nn.Linear(self.n_in + (cfg.mlp[-1] if cfg.mlp else 0), 1)

    def interaction(self, emb: Tensor, flat: Tensor) -> Tensor:
        x = flat
        for layer in self.cross:
            x = layer(flat, x)
        deep = self.deep(flat) if len(self.deep) else flat[:, :0]
        return self.head(torch.cat([x, deep], 1)).squeeze(-1)


class DCNv2(DCN):
    full = True


def build_model(name: str, cfg: CTRConfig) -> CTRModel:
    """One of MODELS ("deepfm", "wdl", "dcn", "dcnv2") with `cfg`."""
    classes = {"deepfm": DeepFM, "wdl": WideDeep, "dcn": DCN, "dcnv2": DCNv2}
    if name not in classes:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    model = classes[name](cfg)
    if cfg.base_rate is not None:
        model.start_at(cfg.base_rate)
    return model
