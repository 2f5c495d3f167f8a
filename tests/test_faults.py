"""Fault injection: `ecru l2l train` killed with SIGKILL at many instants (while starting, between and
inside checkpoint writes, during the export) is finished by the same command with `--resume`, and the
result equals a run that was never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SRC = Path(__file__).resolve().parents[1] / "src"
ARGS = ["l2l", "train", "--batch-size", "4", "--micro-batch-size", "2", "--lr", "3e-3", "--steps", "8"]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ecru", *ARGS, "--save-every", "1", "--out", str(out), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


def _kill_after(cmd: list[str], seconds: float) -> None:
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_l2l_train_killed_at_many_instants_is_finished_by_resume(tmp_path, store):
    straight = tmp_path / "straight"
    subprocess.run(_cmd(straight, "--store", store), env=_env(), check=True, capture_output=True)
    out = tmp_path / "killed"
    # instants from the interpreter's start to the export (import ~2-4 s, 8 steps of ~0.05 s, checkpoints)
    for seconds in (0.2, 2.5, 3.2, 3.6, 4.0, 4.5, 5.5):
        _kill_after(_cmd(out, "--store", store, "--resume"), seconds)
    done = subprocess.run(_cmd(out, "--store", store, "--resume"), env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    want = json.loads((straight / "metrics.json").read_text())
    got = json.loads((out / "metrics.json").read_text())
    assert got["losses"] == want["losses"] and got["steps"] == 8
    a, b = load_file(straight / "hf" / "model.safetensors"), load_file(out / "hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_a_kill_between_the_checkpoint_and_state_json_loses_no_loss(tmp_path, store):
    """Each tier commits a step's loss with its weights (the RAM tier's checkpoint, the disk tier's store):
    resuming after a kill that left state.json a step behind (the weights committed, state.json, the export and
    that step's evaluation not) reports every loss, none NaN, and the same evaluations."""
    import shutil

    held = tmp_path / "held.txt"
    held.write_text("what is my balance\nbook a table for two\nplay some jazz\nwill it rain tomorrow\n")
    extra = ("--store", store, "--eval-data", str(held), "--eval-every", "4")
    straight = tmp_path / "straight"
    subprocess.run(_cmd(straight, *extra), env=_env(), check=True, capture_output=True)
    out = tmp_path / "killed"
    shutil.copytree(straight, out)
    state = json.loads((out / "state.json").read_text())
    cut = {**state, "losses": state["losses"][:-1], "eval": state["eval"][:-1], "steps": state["steps"] - 1}
    (out / "state.json").write_text(json.dumps(cut))
    shutil.rmtree(out / "hf"), (out / "metrics.json").unlink()
    done = subprocess.run(_cmd(out, *extra, "--resume"), env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    want, got = (json.loads((d / "metrics.json").read_text()) for d in (straight, out))
    assert got["losses"] == want["losses"] and got["eval"] == want["eval"] and len(want["eval"]) == 2
