"""The CTR training loop: two Adams (embeddings, dense layers), CowClip between backward and step.

    logits = model(dense, cats); loss = mean BCE
    loss.backward()                 # DDP all-reduces (averages) the gradients across ranks
    clipper.clip_(ids)              # L2 on the tables (+ the per-id clip), ids of the *global* batch
    embed_opt.step(); dense_opt.step(); warmup.step()

Under `torchrun` (torch.distributed initialised) each rank takes an equal contiguous shard of every
global batch; the averaged gradient equals the global batch's mean gradient, so N ranks follow the same
trajectory as one process on the same global batch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ecru.cowclip import ClipStats, CowClip, Recipe, UniqueIds, scaled_recipe
from ecru.cowclip.row_sparse_adam import RowSparseAdam
from ecru.cowclip.wrapper import Mode
from ecru.ctr.data import CTRData
from ecru.ctr.metrics import auc, logloss
from ecru.ctr.models import MODELS, CTRConfig, CTRModel, build_model
from ecru.errors import EcruError
from ecru.io import load_state, save_state


@dataclass(frozen=True)
class TrainConfig:
    """One CTR training run."""

    model: str = "deepfm"
    """One of ecru.ctr.MODELS."""
    batch_size: int = 1024
    """Global batch size (split evenly across ranks under torchrun)."""
    epochs: int = 1
    """Passes over the training split."""
    recipe: str = "cowclip"
    """Scaling recipe (ecru.cowclip.RECIPES) applied at `batch_size` relative to `base_batch`."""
    mode: Mode = "full"
    """'full': faithful full-table L2 + Adam; 'sparse': row-sparse embeddings and RowSparseAdam."""
    base_batch: int = 1024
    """The batch size the recipe's base settings are for."""
    dataset: str = "criteo"
    """Which column of the recipe table (criteo or avazu)."""
    mlp: tuple[int, ...] = (400, 400, 400)
    """Hidden widths of the deep part."""
    embed_dim: int = 10
    """Embedding dimension."""
    embed_lr: float | None = None
    """Adam learning rate of the embeddings at `base_batch`, scaled by the recipe like the table's value
    (None: the recipe table's, the CowClip paper's 1e-4, set for Criteo's 45M rows). `ecru ctr train`
    defaults to 1e-3."""
    init_std: float = 0.01
    """Std of the N(0, std^2) embedding initialisation (the CowClip paper discusses 1e-2 and 1e-4)."""
    summed_loss: bool = False
    """Optimise the batch's summed BCE (and L2 x batch size, the same objective up to a constant) instead of
    its mean: Adam is unchanged up to eps, but CowClip's threshold, which does not scale with the loss, fires."""
    patience: int | None = None
    """Early stopping: stop once the validation AUC (rows given to `train` as `val_data`) has not improved
    for this many epochs, and end with the best epoch's weights; None: train all `epochs`, keep the last."""
    seed: int = 0
    """Seed of the model initialisation and of the per-epoch shuffles."""
    eval_batch: int = 65536
    """Batch size of the held-out evaluation."""
    eval_every: int = 0
    """Also evaluate the test rows every this many steps (0: only at the end of each epoch); every
    evaluation is a point of `TrainResult.curve`, timed in training seconds (evaluations excluded). In the
    row-sparse mode an evaluation first brings every row up to date, as an epoch's end does."""
    target_auc: float | None = None
    """Stop once an evaluation of the test rows reaches this AUC: for measuring the time to an AUC (the
    test split then decides when to stop; early stopping on validation rows is `patience`)."""
    checkpoint: str | None = None
    """File written at the end of every epoch (rank 0); None: no checkpoints."""
    resume: bool = False
    """Continue from `checkpoint` if it exists."""
    data_id: str = ""
    """Content hash of the training data (file digest and how it was read and split): saved in the
    checkpoint, and a resume on other data is refused."""
    progress: bool = True
    """Show a tqdm progress bar (rank 0)."""
    device: str = "cpu"
    """Where the model trains ("cuda" under torchrun: each rank uses cuda:LOCAL_RANK); data stays on the host."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise EcruError(f"unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        if self.batch_size < 1 or self.epochs < 1 or self.base_batch < 1 or self.eval_batch < 1:
            raise EcruError("batch sizes and epochs must be >= 1")
        if self.mode not in ("full", "sparse"):
            raise EcruError(f"mode must be 'full' or 'sparse', got {self.mode!r}")
        if self.embed_lr is not None and not self.embed_lr > 0:
            raise EcruError(f"embed_lr must be > 0, got {self.embed_lr}")
        if self.eval_every < 0:
            raise EcruError(f"eval_every must be >= 0 (0: at epoch ends only), got {self.eval_every}")
        if self.target_auc is not None and not 0 < self.target_auc < 1:
            raise EcruError(f"target_auc must lie in (0, 1), got {self.target_auc}")
        if self.patience is not None and self.patience < 1:
            raise EcruError(f"patience must be >= 1 (or None: no early stopping), got {self.patience}")
        if self.init_std <= 0:
            raise EcruError(f"init_std must be > 0, got {self.init_std}")
        if self.resume and not self.checkpoint:
            raise EcruError("--resume needs --checkpoint PATH")


@dataclass
class TrainResult:
    """What a run measured."""

    auc: float
    logloss: float
    steps: int
    epochs: int
    samples_per_s: float
    wall_s: float
    clip: ClipStats
    recipe: Recipe
    history: list[dict] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    curve: list[dict] = field(default_factory=list)
    """Test AUC over training, this call's epochs: {"step", "train_s" (training seconds so far, evaluations
    excluded), "auc"} at every `eval_every` steps and at each epoch's end."""
    model: CTRModel | None = field(default=None, repr=False, compare=False)
    """The trained model (left out of `as_dict`)."""

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}
        d["clip"], d["recipe"] = asdict(self.clip), asdict(self.recipe)
        d["clipped_fraction"] = self.clip.clipped_fraction
        return d


def _global_mean(value: torch.Tensor, world: int) -> float:
    """The global batch's mean loss (each rank holds its shard's mean; shards are equal)."""
    if world > 1:
        value = value.clone()
        dist.all_reduce(value)
        value /= world
    return value.item()


def _world() -> tuple[int, int]:
    return (
        (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    )


@torch.no_grad()
def predict_probs(model: nn.Module, data: CTRData, *, batch_size: int = 65536) -> torch.Tensor:
    """Click probabilities [N] of the rows, in order (the model is left in training mode)."""
    model.eval()
    device = next(model.parameters()).device
    probs = torch.cat(
        [torch.sigmoid(model(d.to(device), c.to(device))).cpu() for d, c, _ in data.batches(batch_size)]
    )
    model.train()
    return probs


def _check_both_classes(data: CTRData) -> None:
    if not (data.labels == 1).any() or not (data.labels == 0).any():
        raise EcruError(
            f"the {len(data)} held-out rows are all one class, so AUC is undefined; "
            "raise --test-fraction or use more data"
        )


def evaluate(model: nn.Module, data: CTRData, *, batch_size: int = 65536) -> tuple[float, float]:
    """Held-out AUC and logloss."""
    _check_both_classes(data)
    probs = predict_probs(model, data, batch_size=batch_size)
    return auc(data.labels, probs), logloss(data.labels, probs)


def _base_rate(data: CTRData) -> float | None:
    """The training click rate the model starts at (None if the labels are all one class)."""
    rate = float(data.labels.float().mean())
    return rate if 0 < rate < 1 else None


TABLE_COPIES = 3
"""Copies of the embedding tables training holds at least: the weights and Adam's two moments (gradients aside)."""


def table_bytes(cardinalities, embed_dim: int) -> int:
    """Bytes of the fp32 embedding tables (each id's `embed_dim` row and its linear weight) training holds."""
    return (sum(cardinalities) + 1) * (embed_dim + 1) * 4 * TABLE_COPIES


def check_table_memory(cardinalities, embed_dim: int, device: str) -> None:
    """Refuse, before any allocation, tables that do not fit the device's free memory (a huge hash_buckets)."""
    need = table_bytes(cardinalities, embed_dim)
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    if need > free:
        raise EcruError(f"the embedding tables need {need / 2**30:,.1f} GiB ({sum(cardinalities):,} ids x "
                        f"{embed_dim + 1} floats, with Adam's moments), more than the {free / 2**30:,.1f} GiB free: "
                        "lower hash_buckets (--hash-buckets, or the schema's) or raise --min-count")  # fmt: skip


def make_model(cfg: TrainConfig, data: CTRData) -> CTRModel:
    check_table_memory(data.cardinalities, cfg.embed_dim, cfg.device)
    ctr = CTRConfig(
        data.cardinalities,
        n_dense=data.dense.shape[1],
        embed_dim=cfg.embed_dim,
        init_std=cfg.init_std,
        mlp=cfg.mlp,
        sparse=cfg.mode == "sparse",
        sequence_fields=data.sequence_fields,
        sequence_length=data.sequence_length,
        base_rate=_base_rate(data),
    )
    torch.manual_seed(cfg.seed)
    return build_model(cfg.model, ctr)


def make_optimizers(
    model: CTRModel, recipe: Recipe, *, mode: Mode, steps_per_epoch: int, loss_scale: float = 1.0
):
    """The two Adams, the dense warm-up and CowClip; `loss_scale` multiplies the L2 term with the loss."""
    tables = model.embedding_tables()
    # fused: Adam's update in one pass over each tensor (the full-table step is ~3x faster than foreach's
    # seven passes on a CPU); the same formula, equal to torch.optim.Adam's default to float round-off
    if mode == "sparse":
        embed_opt = RowSparseAdam(tables, lr=recipe.embed_lr, eps=recipe.eps)
    else:
        embed_opt = torch.optim.Adam(tables, lr=recipe.embed_lr, eps=recipe.eps, fused=True)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=recipe.dense_lr, eps=recipe.eps, fused=True)
    warmup = max(1.0, recipe.warmup_epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(dense_opt, lambda step: min(1.0, (step + 1) / warmup))
    clipper = CowClip(
        tables,
        weight_decay=recipe.weight_decay * loss_scale,
        r=recipe.r,
        zeta=recipe.zeta,
        mode=mode,
        clip=recipe.clip,
    )
    return embed_opt, dense_opt, sched, clipper


def _step(
    net: nn.Module,
    model: CTRModel,
    batch: list,
    mine: slice,
    opts: tuple,
    clipper: CowClip,
    loss_scale: float = 1.0,
) -> torch.Tensor:
    """One optimizer step on this rank's shard `mine` of the global batch (the mean loss x `loss_scale`
    differentiated); returns the shard's mean loss."""
    dense, cats, labels = batch
    embed_opt, dense_opt, sched = opts
    ids = model.tables.global_ids(cats)
    if isinstance(embed_opt, RowSparseAdam) or clipper.needs_ids:
        ids = UniqueIds.of(ids)  # one sort of the ids, shared by the catch-up and the clip
    if isinstance(embed_opt, RowSparseAdam):  # absent rows' missed Adam steps, before the forward reads them
        embed_opt.catch_up(ids)
    loss = F.binary_cross_entropy_with_logits(net(dense[mine], cats[mine]), labels[mine])
    embed_opt.zero_grad(set_to_none=True), dense_opt.zero_grad(set_to_none=True)
    (loss * loss_scale if loss_scale != 1.0 else loss).backward()  # DDP: the global batch's mean, x scale
    clipper.clip_(ids)  # counts over the whole global batch, as one process would
    embed_opt.step(), dense_opt.step(), sched.step()
    return loss


def resolve_recipe(cfg: TrainConfig) -> Recipe:
    """The recipe's settings at `cfg.batch_size`, its embedding LR scaled from `cfg.embed_lr` at the base batch
    (None: the table's)."""
    return scaled_recipe(
        cfg.recipe, cfg.batch_size, base_batch=cfg.base_batch, dataset=cfg.dataset, embed_lr=cfg.embed_lr
    )


def train(
    cfg: TrainConfig,
    train_data: CTRData,
    test_data: CTRData,
    *,
    recipe: Recipe | None = None,
    val_data: CTRData | None = None,
) -> TrainResult:
    """Train `cfg.model` on `train_data`, evaluate on `test_data` (and `val_data`) after every epoch; with
    `cfg.patience`, stop early on the validation AUC and return the best epoch's model and test metrics."""
    rank, world = _world()
    if cfg.batch_size % world:
        raise EcruError(f"batch size {cfg.batch_size} must be divisible by the number of ranks ({world})")
    recipe = recipe or resolve_recipe(cfg)
    _check_both_classes(test_data)  # before any work, not after an epoch
    if cfg.patience is not None:
        if val_data is None:
            raise EcruError("early stopping (patience) needs validation rows (val_data)")
        _check_both_classes(val_data)
    steps_per_epoch = len(train_data) // cfg.batch_size
    if steps_per_epoch < 1:
        raise EcruError(f"batch size {cfg.batch_size} exceeds the {len(train_data)} training rows")
    model = make_model(cfg, train_data).to(cfg.device)
    loss_scale = float(cfg.batch_size) if cfg.summed_loss else 1.0  # the global batch's sum, not mean
    embed_opt, dense_opt, sched, clipper = make_optimizers(
        model, recipe, mode=cfg.mode, steps_per_epoch=steps_per_epoch, loss_scale=loss_scale
    )
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    start_epoch, history, best_state, curve = _resume(cfg, model, embed_opt, dense_opt, sched, clipper)
    if history and _stopped(cfg, history):  # an early-stopped run is finished: resuming adds no epoch
        start_epoch = cfg.epochs
    shard = cfg.batch_size // world
    losses, reached = [], False
    for epoch in range(start_epoch, cfg.epochs):
        done = sum(h.get("steps", 0) for h in history), sum(h.get("wall_s", 0.0) for h in history)
        bar = tqdm(
            total=steps_per_epoch,
            desc=f"epoch {epoch + 1}/{cfg.epochs} b={cfg.batch_size}",
            disable=not cfg.progress or rank != 0,
            leave=False,
        )
        start, steps = time.perf_counter(), 0
        for dense, cats, labels in train_data.batches(
            cfg.batch_size, seed=cfg.seed * 1000 + epoch, drop_last=True
        ):
            batch = [t.to(cfg.device, non_blocking=True) for t in (dense, cats, labels)]
            loss = _step(
                net,
                model,
                batch,
                slice(rank * shard, (rank + 1) * shard),
                (embed_opt, dense_opt, sched),
                clipper,
                loss_scale,
            )
            steps += 1
            if len(losses) < 1000:
                losses.append(_global_mean(loss.detach(), world))
            bar.update()
            if cfg.eval_every and (done[0] + steps) % cfg.eval_every == 0 and steps < steps_per_epoch:
                paused = time.perf_counter()
                point = _probe(cfg, model, embed_opt, test_data, done[0] + steps, done[1] + paused - start)
                curve.append(point)
                start += time.perf_counter() - paused  # an evaluation is not training time
                if reached := _reached(cfg, point["auc"], world):
                    break
        bar.close()
        if isinstance(embed_opt, RowSparseAdam):
            embed_opt.flush()  # every row up to date before evaluating and saving
        if cfg.device.startswith("cuda"):
            torch.cuda.synchronize()
        # each epoch keeps its own steps and time: after a resume the totals still cover the whole run
        timing = {"steps": steps, "wall_s": time.perf_counter() - start}
        history.append({**_epoch_metrics(cfg, model, epoch, test_data, val_data), **timing})
        total = {"step": done[0] + steps, "train_s": done[1] + timing["wall_s"]}
        if not (curve and curve[-1]["step"] == total["step"]):
            curve.append({**total, "auc": history[-1]["auc"]})
            reached = _reached(cfg, history[-1]["auc"], world)
        if cfg.progress and rank == 0:
            tqdm.write(_epoch_line(history[-1]))
        if cfg.patience is not None and best_epoch(history) is history[-1]:
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        _save(cfg, rank, (model, embed_opt, dense_opt, sched, clipper), epoch, history, curve, best_state)
        if _stopped(cfg, history) or reached:
            break
    if not history:
        raise EcruError(f"checkpoint {cfg.checkpoint} already has all {cfg.epochs} epochs; raise --epochs")
    final = history[-1]
    if cfg.patience is not None:
        final = best_epoch(history)
        if final is not history[-1] and best_state is not None:
            model.load_state_dict(best_state)
    steps = sum(h.get("steps", 0) for h in history)
    wall = sum(h.get("wall_s", 0.0) for h in history)
    samples = steps * cfg.batch_size
    return TrainResult(
        final["auc"],
        final["logloss"],
        steps,
        len(history),
        samples / max(wall, 1e-9),
        wall,
        clipper.stats(),
        recipe,
        history,
        losses,
        curve,
        model,
    )


def _probe(cfg: TrainConfig, model, embed_opt, test_data: CTRData, step: int, train_s: float) -> dict:
    """A point of the test-AUC curve in the middle of an epoch."""
    if isinstance(embed_opt, RowSparseAdam):
        embed_opt.flush()  # the absent rows' missed steps, as dense Adam has them (the end of an epoch does so)
    return {"step": step, "train_s": train_s, "auc": evaluate(model, test_data, batch_size=cfg.eval_batch)[0]}


def _reached(cfg: TrainConfig, value: float, world: int) -> bool:
    """Whether `value` reaches `cfg.target_auc`, rank 0's answer on every rank (they stop together)."""
    if cfg.target_auc is None:
        return False
    flag = torch.tensor([float(value >= cfg.target_auc)], device=cfg.device)
    if world > 1:
        dist.broadcast(flag, 0)
    return bool(flag.item())


def _epoch_metrics(cfg: TrainConfig, model, epoch: int, test_data: CTRData, val_data: CTRData | None) -> dict:
    test_auc, test_ll = evaluate(model, test_data, batch_size=cfg.eval_batch)
    entry = {"epoch": epoch + 1, "auc": test_auc, "logloss": test_ll}
    if val_data is not None:
        entry["val_auc"], entry["val_logloss"] = evaluate(model, val_data, batch_size=cfg.eval_batch)
    return entry


def _epoch_line(entry: dict) -> str:
    line = f"epoch {entry['epoch']}: test AUC {entry['auc']:.5f} logloss {entry['logloss']:.5f}"
    return line + (f" (validation AUC {entry['val_auc']:.5f})" if "val_auc" in entry else "")


def _stopped(cfg: TrainConfig, history: list[dict]) -> bool:
    """Early stopping: `patience` epochs without a better validation AUC."""
    return cfg.patience is not None and history[-1]["epoch"] - best_epoch(history)["epoch"] >= cfg.patience


def best_epoch(history: list[dict]) -> dict:
    """The epoch of the highest validation AUC (the first of equals)."""
    return max(history, key=lambda h: (h["val_auc"], -h["epoch"]))


def _save(
    cfg: TrainConfig,
    rank: int,
    parts: tuple,
    epoch: int,
    history: list,
    curve: list,
    best_state: dict | None = None,
) -> None:
    """`parts`: the model, both optimizers, the scheduler and the clip (its statistics), as `_resume` reads them."""
    if not cfg.checkpoint or rank != 0:
        return
    path = Path(cfg.checkpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    model, embed_opt, dense_opt, sched, clipper = parts
    state = {
        "model": model.state_dict(),
        "embed_opt": embed_opt.state_dict(),
        "dense_opt": dense_opt.state_dict(),
        "sched": sched.state_dict(),
        "clip": clipper.state_dict(),
        "curve": curve,
        "epoch": epoch,
        "history": history,
        "config": asdict(cfg),
        "data_id": cfg.data_id,
    }
    if best_state is not None:
        state["best_model"] = best_state
    save_state(path, state)  # atomic, and no pickle: safetensors with a JSON skeleton (ecru.io)


def _to_device(state, device: torch.device):
    """`state` with every tensor on `device` (as a `map_location` load would place them)."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to_device(v, device) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_to_device(v, device) for v in state)
    return state


def _plain(value):
    return list(value) if isinstance(value, tuple | list) else value


def _load_checkpoint(cfg: TrainConfig) -> dict:
    try:
        state = load_state(cfg.checkpoint)
        state["config"], state["model"]  # noqa: B018 - a file without these is not a checkpoint
    except (EcruError, KeyError, TypeError) as exc:
        raise EcruError(
            f"checkpoint {cfg.checkpoint} is unreadable ({type(exc).__name__}); delete it to start over"
        ) from None
    return _to_device(state, torch.device(cfg.device))


def _resume(
    cfg: TrainConfig, model, embed_opt, dense_opt, sched, clipper
) -> tuple[int, list, dict | None, list]:
    """(the next epoch, the history, the best epoch's weights, the AUC curve) of the checkpoint, whose states are
    loaded into the model, optimizers, scheduler and clip statistics; a fresh run's without one."""
    if not (cfg.resume and cfg.checkpoint and Path(cfg.checkpoint).is_file()):
        return 0, [], None, []
    state = _load_checkpoint(cfg)
    if state.get("data_id", "") != cfg.data_id:
        raise EcruError(
            f"checkpoint {cfg.checkpoint} was made on other data (content hash {state.get('data_id') or '?'}, "
            f"this run's {cfg.data_id or '?'}: another file or another split); give the same --data and "
            "split flags, or a new --out"
        )
    saved = state["config"]
    for key in (
        "model",
        "batch_size",
        "recipe",
        "mode",
        "mlp",
        "embed_dim",
        "seed",
        "init_std",
        "embed_lr",
        "patience",
        "summed_loss",
    ):
        was = saved.get(key, getattr(TrainConfig(), key))  # a key added later: its default
        if _plain(was) != _plain(getattr(cfg, key)):
            raise EcruError(
                f"checkpoint {cfg.checkpoint} was made with {key}={was!r}, not {getattr(cfg, key)!r}"
            )
    try:
        model.load_state_dict(state["model"])
        embed_opt.load_state_dict(state["embed_opt"]), dense_opt.load_state_dict(state["dense_opt"])
        sched.load_state_dict(state["sched"])
        if "clip" in state:  # checkpoints before it: the statistics count the resumed epochs only
            clipper.load_state_dict(state["clip"])
    except (KeyError, RuntimeError, ValueError, TypeError) as exc:
        raise EcruError(f"checkpoint {cfg.checkpoint} does not fit this model ({exc})"[:300]) from None
    return state["epoch"] + 1, state["history"], state.get("best_model"), list(state.get("curve", []))
