"""Full training checkpoints of an `L2L` engine: weights, optimizer states, step, RNG, loss scale.

A checkpoint folder holds `l2l-state-s{step}.safetensors` (every tensor, and the rest as JSON in its
metadata: no pickle anywhere) and `manifest.json`, which names that file with its sha256 and size. The
manifest is written last and is the commit point: a crash leaves the previous checkpoint or the new one,
and a damaged or changed file is refused when the checkpoint is loaded. The manifest also keeps the
caller's JSON `meta` (the CLI's arguments and losses), so it commits with the weights (`read_meta`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ecru.errors import MissingAssetError
from ecru.io import MANIFEST, load_state, read_manifest, save_state, verify_manifest, write_manifest
from ecru.l2l.config import L2LConfig
from ecru.l2l.store import OptimizerFactory

if TYPE_CHECKING:
    from ecru.l2l.engine import L2L

FORMAT = "ecru-l2l/2"
_STATE = re.compile(r"l2l-state-s(\d+)\.safetensors")
_HINT = "the checkpoint was changed after ecru wrote it; train again without --resume"


def save(engine: L2L, path: str | os.PathLike, *, meta: dict[str, Any] | None = None) -> Path:
    """Write `engine`'s full training state into the folder `path` (see the module docstring); returns the
    state file."""
    folder = Path(path)
    payload = {
        "format": FORMAT,
        "kind": engine.parts.kind,
        "options": engine.parts.options,
        "steps": engine.steps,
        "config": dataclasses.asdict(engine.config),
        "model": _trained_state(engine),
        "optimizers": engine.store.optimizer_state(),
        "loss_scale": dataclasses.asdict(engine.scaler) if engine.scaler else None,
        "rng": {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        },
    }
    name = f"l2l-state-s{engine.steps:09d}.safetensors"
    target = save_state(folder / name, payload)
    write_manifest(folder, [name], meta=meta)
    for old in folder.iterdir():  # older states, no longer named by the manifest
        if _STATE.fullmatch(old.name) and old.name != name:
            old.unlink(missing_ok=True)
    return target


def _trained_state(engine: L2L) -> dict[str, torch.Tensor]:
    """The weights a checkpoint must keep: all of them, or with frozen parameters (a LoRA run) only the
    trainable ones and the buffers; resume reads the frozen base from the model it is given."""
    frozen = {n for n, p in engine.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    state = engine.state_dict()
    return {k: v.detach().cpu() for k, v in state.items() if k not in frozen}


def load(path: str | os.PathLike) -> dict:
    """The payload of a checkpoint folder (its files verified against the manifest), or a clear error."""
    folder = Path(path)
    manifest = read_manifest(folder) if folder.is_dir() else None
    if manifest is None:
        legacy = " (an older pickle checkpoint, not loaded for safety)" if any(folder.glob("*.pt")) else ""
        raise MissingAssetError(f"no L2L checkpoint at {folder}{legacy}; write one with engine.save(folder)")
    names = [n for n in manifest["files"] if _STATE.fullmatch(n)]
    if len(names) != 1:
        raise MissingAssetError(f"{folder / MANIFEST} names no L2L state file; {_HINT}")
    verify_manifest(folder, names)
    payload = load_state(folder / names[0], hint=_HINT)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise MissingAssetError(f"{folder} is not an {FORMAT} checkpoint; {_HINT}")
    return payload


def read_meta(path: str | os.PathLike) -> dict[str, Any] | None:
    """The `meta` saved with the checkpoint in folder `path`, or None if it holds none."""
    manifest = read_manifest(path) if Path(path).is_dir() else None
    return None if manifest is None else manifest["meta"]


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
    engine.load_state_dict(payload["model"], frozen_from_model=True)
    engine.store.load_optimizer_state(payload["optimizers"])
    engine.steps = payload["steps"]
    if engine.scaler and payload["loss_scale"]:
        engine.scaler.__dict__.update(payload["loss_scale"])
    torch.set_rng_state(payload["rng"]["cpu"])
    if payload["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["rng"]["cuda"])
    return engine
