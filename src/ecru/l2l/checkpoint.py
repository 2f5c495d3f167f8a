"""Full training checkpoints of an `L2L` engine: weights, optimizer states, step, RNG, loss scale.

One file, `l2l_checkpoint.pt`, inside the checkpoint folder, written to a temporary name and renamed
into place (`os.replace` is atomic), so a crash leaves either the previous checkpoint or the new one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ecru.errors import MissingAssetError
from ecru.l2l.config import L2LConfig
from ecru.l2l.store import OptimizerFactory
from ecru.l2l.workspace import fsync_dir

if TYPE_CHECKING:
    from ecru.l2l.engine import L2L

FILE = "l2l_checkpoint.pt"
FORMAT = "ecru-l2l/1"


def save(engine: L2L, path: str | os.PathLike) -> Path:
    """Write `engine`'s full training state to `path/l2l_checkpoint.pt` atomically; returns the file."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "kind": engine.parts.kind,
        "options": engine.parts.options,
        "steps": engine.steps,
        "config": dataclasses.asdict(engine.config),
        "model": {k: v.detach().cpu() for k, v in engine.state_dict().items()},
        "optimizers": engine.store.optimizer_state(),
        "loss_scale": dataclasses.asdict(engine.scaler) if engine.scaler else None,
        "rng": {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        },
    }
    target = folder / FILE
    tmp = folder / f".{FILE}.{os.getpid()}.partial"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_dir(folder)  # the rename itself survives a power loss
    return target


def load(path: str | os.PathLike) -> dict:
    """The payload of a checkpoint folder (or file), or a clear error."""
    file = Path(path)
    file = file / FILE if file.is_dir() else file
    if not file.is_file():
        raise MissingAssetError(f"no L2L checkpoint at {file}; write one with engine.save(folder)")
    payload = torch.load(file, map_location="cpu", weights_only=False)
    if payload.get("format") != FORMAT:
        raise MissingAssetError(f"{file} is not an {FORMAT} checkpoint (format {payload.get('format')!r})")
    return payload


def resume(
    cls: type[L2L],
    path,
    model: nn.Module,
    *,
    optimizer: OptimizerFactory,
    config: L2LConfig | None,
    loss_fn: Callable | None,
) -> L2L:
    """A new engine over `model` in the checkpoint's exact training state (`config` overrides the saved one)."""
    payload = load(path)
    config = config or L2LConfig(**payload["config"])
    if payload["kind"] == "hf":
        engine = cls.from_hf(model, optimizer=optimizer, config=config)
    else:
        if loss_fn is None:
            raise ValueError("resuming a Sequential checkpoint needs loss_fn=")
        engine = cls.from_sequential(
            model,
            loss_fn=loss_fn,
            optimizer=optimizer,
            config=config,
            reduction=payload["options"].get("reduction", "mean"),
        )
    engine.load_state_dict(payload["model"])
    engine.store.load_optimizer_state(payload["optimizers"])
    engine.steps = payload["steps"]
    if engine.scaler and payload["loss_scale"]:
        engine.scaler.__dict__.update(payload["loss_scale"])
    torch.set_rng_state(payload["rng"]["cpu"])
    if payload["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["rng"]["cuda"])
    return engine
