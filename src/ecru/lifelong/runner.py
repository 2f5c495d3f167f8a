"""Runs a method over a stream: train task i, evaluate everything, checkpoint, repeat.

The checkpoint after task i holds the method's state, the evaluation rows so far and the per-task costs,
so a long run killed mid-way resumes at task i+1 and ends with the same matrix as an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from ecru.errors import EcruError
from ecru.lifelong.evaluate import EvalRow, Evaluator
from ecru.lifelong.methods.base import Method, TaskCost, tensor_bytes
from ecru.lifelong.metrics import cl_metrics


@dataclass
class RunResult:
    """Accuracy matrices (percent), metrics and costs of one method on one stream."""

    method: str
    tasks: list[str]
    R: list[list[float]]
    """Task-incremental accuracy: R[i][j] on task j after training through task i."""
    R0: list[float]
    """The pretrained model's task-incremental accuracy per task."""
    R_ci: list[list[float]]
    """Class-incremental variant: task j scored among the intents of tasks seen so far (plus its own)."""
    R0_ci: list[float]
    heldout: list[float]
    """Banking77 accuracy before training and after each task (T + 1 numbers)."""
    metrics: dict[str, float] = field(default_factory=dict)
    metrics_ci: dict[str, float] = field(default_factory=dict)
    cost: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class PeakRSS:
    """Samples this process's resident memory in a background thread; `peak_mb` is the maximum seen."""

    def __init__(self, *, interval_s: float = 0.05):
        self.interval_s, self.peak = interval_s, 0
        self._stop = threading.Event()
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self.peak = self._proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


@dataclass
class _Progress:
    rows: list[EvalRow]
    costs: list[dict[str, float]]


def _checkpoint(folder: Path | None) -> Path | None:
    return None if folder is None else Path(folder) / "last.pt"


def stream_digest(stream) -> str:
    """A hash of every text and label of the stream (tasks, held-out probe, reference sentences): two
    streams built with another split, seed or size differ here even when their task sizes agree."""
    h = hashlib.sha256()
    for examples in [*(t.train + t.test for t in stream.tasks), stream.heldout]:
        for e in examples:
            h.update(f"{e.text}\x1f{e.label}\x1e".encode())
        h.update(b"\x1d")
    for text in stream.reference:
        h.update(f"{text}\x1e".encode())
    return h.hexdigest()[:16]


def signature(method: Method, evaluator: Evaluator) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the method, its config and training, the stream."""
    train = getattr(method, "train", None)
    stream = evaluator.stream
    return {
        "method": method.name,
        "config": repr(getattr(method, "cfg", None)),
        "train": None if train is None else repr(dataclasses.replace(train, progress=True)),
        "stream": [[t.name, len(t.train), len(t.test)] for t in stream.tasks] + [len(stream.heldout)],
        "texts": stream_digest(stream),
    }


def _mean_or_none(costs: list[dict[str, float]], key: str, reduce=None) -> float | None:
    """Over tasks, when every task recorded `key` (checkpoints written before it was recorded lack it)."""
    values = [c.get(key) for c in costs]
    if any(v is None for v in values):
        return None
    return reduce(values) if reduce else sum(values) / len(values)


def _summarise(costs: list[dict[str, float]]) -> dict[str, float | None]:
    return {
        "trainable_params": max(c["trainable_params"] for c in costs),
        "optimizer_bytes": max(c["optimizer_bytes"] for c in costs),
        "wall_s": sum(c["wall_s"] for c in costs) / len(costs),
        "wall_total_s": sum(c["wall_s"] for c in costs),
        "cpu_s": _mean_or_none(costs, "cpu_s"),
        "eval_s": sum(c["eval_s"] for c in costs) / len(costs),
        "steps": sum(c["steps"] for c in costs),
        "peak_rss_mb": _mean_or_none(costs, "peak_rss_mb", max),
        "stored_bytes": sum(c["stored_bytes"] for c in costs) / len(costs),
    }


def run_stream(
    method: Method,
    evaluator: Evaluator,
    *,
    r0: EvalRow | None = None,
    checkpoint_dir: str | Path | None = None,
    stop_after: int | None = None,
    log: Callable[[str], None] = print,
) -> RunResult | None:
    """Train `method` on every task of `evaluator.stream` in order, evaluating after each.

    `r0` is the pretrained model's evaluation (shared by all methods of a benchmark; computed if None).
    With `checkpoint_dir`, resumes from its last task checkpoint. `stop_after=k` stops after task k and
    returns None (an interrupted run, for testing resumption).
    """
    tasks, ckpt = evaluator.stream.tasks, _checkpoint(checkpoint_dir)
    progress = _Progress([], [])
    if ckpt is not None and ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        want, got = signature(method, evaluator), saved.get("signature")
        if got is None:
            log(f"{ckpt} predates run signatures: resuming without checking that it is the same run")
        elif unchecked := [k for k in want if k not in got]:
            log(f"{ckpt} predates the {', '.join(unchecked)} check: resuming without it")
        if got is not None and any(got[k] != want[k] for k in want if k in got):
            diff = ", ".join(k for k in want if k in got and got[k] != want[k])
            raise EcruError(
                f"{ckpt} was written by a different run (its {diff} differ from this one's); "
                "fix: give this run its own checkpoint folder, or delete that one to start again"
            )
        method.load_state_dict(saved["method"])
        progress, r0 = saved["progress"], saved["r0"]
        log(f"{method.name}: resumed after task {len(progress.rows)} of {len(tasks)} from {ckpt}")
    if r0 is None:
        r0 = evaluator.evaluate(method.encoder(), seen=0)
    for i in range(len(progress.rows), len(tasks)):
        if stop_after is not None and i >= stop_after:
            return None
        progress.costs.append(_train_and_evaluate(method, evaluator, i, progress.rows))
        r = progress.rows[-1]
        log(f"{method.name}: task {i + 1}/{len(tasks)} ({tasks[i].name}) learned: acc {r.ti[i]:.1f}, "
            f"mean over tasks {sum(r.ti) / len(r.ti):.1f}, held-out {r.heldout:.1f}")  # fmt: skip
        if ckpt is not None:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "method": method.state_dict(),
                    "progress": progress,
                    "r0": r0,
                    "signature": signature(method, evaluator),
                },
                ckpt.with_suffix(".tmp"),
            )
            ckpt.with_suffix(".tmp").replace(ckpt)  # atomic: a kill mid-save keeps the previous checkpoint
    return _result(method.name, tasks, r0, progress)


def _train_and_evaluate(
    method: Method, evaluator: Evaluator, i: int, rows: list[EvalRow]
) -> dict[str, float]:
    with PeakRSS() as rss:
        start, cpu = time.perf_counter(), time.process_time()
        cost: TaskCost = method.learn(evaluator.stream.tasks[i], index=i)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    rows.append(evaluator.evaluate(method.encoder(), seen=i + 1))
    return {**asdict(cost), "wall_s": wall, "cpu_s": cpu, "eval_s": time.perf_counter() - start - wall,
            "peak_rss_mb": rss.peak_mb, "stored_bytes": tensor_bytes(method.state_dict())}  # fmt: skip


def _result(name: str, tasks, r0: EvalRow, progress: _Progress) -> RunResult:
    R = [r.ti for r in progress.rows]
    R_ci = [r.ci for r in progress.rows]
    res = RunResult(
        name,
        [t.name for t in tasks],
        R,
        r0.ti,
        R_ci,
        r0.ci,
        [r0.heldout] + [r.heldout for r in progress.rows],
    )
    res.metrics = cl_metrics(R, r0.ti)
    res.metrics["diag"] = sum(R[j][j] for j in range(len(R))) / len(R)
    res.metrics["heldout_drop"] = res.heldout[-1] - res.heldout[0]
    res.metrics["heldout_worst_drop"] = min(res.heldout[1:]) - res.heldout[0]
    res.metrics_ci = cl_metrics(R_ci, r0.ci)
    res.cost = _summarise(progress.costs)
    return res
