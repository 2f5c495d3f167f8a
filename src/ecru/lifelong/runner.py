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

from ecru.errors import EcruError
from ecru.io import load_state, save_state
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
    R_agnostic: list[list[float]]
    """Task-agnostic: task j among the labels of the tasks learned so far plus its own (no task given)."""
    R0_agnostic: list[float]
    heldout: list[float]
    """Banking77 accuracy among its own labels, before training and after each task (T + 1 numbers)."""
    heldout_agnostic: list[float]
    """Banking77 among the learned labels plus its own, before training and after each task."""
    metrics: dict[str, float] = field(default_factory=dict)
    """ZSCL's metrics of `R` (learned tasks with the task given; unseen ones without)."""
    agnostic: dict[str, float] = field(default_factory=dict)
    """The headline: last, avg, transfer, transfer_retention, bwt, heldout_change of the task-agnostic protocol;
    with a held-out probe also last_with_heldout_labels (Last with Banking77's labels as extra candidates)."""
    gated: dict[str, Any] = field(default_factory=dict)
    """The label-gated protocol, every method given the same gate: learned tasks with the task given, unseen
    tasks and Banking77 through the frozen model; the keys in `by_construction` hold by construction."""
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

    def state(self) -> dict[str, Any]:
        """Plain containers only, so that a checkpoint loads with `weights_only=True`."""
        return {"rows": [asdict(r) for r in self.rows], "costs": list(self.costs)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> _Progress:
        return cls([EvalRow(**r) for r in state["rows"]], list(state["costs"]))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A run checkpoint, loaded safely (tensors and plain containers only, no pickled code)."""
    try:
        return load_state(path)
    except EcruError as exc:  # damaged, or an older pickle checkpoint (never unpickled)
        raise EcruError(
            f"{path}: not a checkpoint this version of ecru reads ({exc}); "
            "fix: delete that folder to start the run again"
        ) from None


def _checkpoint(folder: Path | None) -> Path | None:
    return None if folder is None else Path(folder) / "last.safetensors"


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
        # what the method keeps after the last task (adapters, exemplars, router, class means), per task
        "stored_bytes_per_task": costs[-1]["stored_bytes"] / len(costs),
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
        saved = load_checkpoint(ckpt)
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
        progress, r0 = _Progress.from_state(saved["progress"]), EvalRow(**saved["r0"])
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
            state = {
                "method": method.state_dict(),
                "progress": progress.state(),
                "r0": asdict(r0),
                "signature": signature(method, evaluator),
            }
            save_state(ckpt, state)  # atomic: a kill mid-save keeps the previous checkpoint; no pickle
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


def gated_matrix(R: list[list[float]], R0: list[float]) -> list[list[float]]:
    """The label-gated matrix: a learned task's cell as measured (task given), an unseen task's the frozen
    model's (R0), which is what the gate sends it to."""
    return [[R[i][j] if j <= i else R0[j] for j in range(len(R0))] for i in range(len(R))]


def protocol_metrics(R: list[list[float]], R0: list[float], heldout: list[float]) -> dict[str, float]:
    """last, avg, transfer, transfer_retention, bwt of `R` and heldout_change (after the last task minus
    before the first, points)."""
    m = cl_metrics(R, R0)
    keys = ("last", "avg", "transfer", "transfer_retention", "bwt")
    return {**{k: m[k] for k in keys}, "heldout_change": heldout[-1] - heldout[0]}


def _result(name: str, tasks, r0: EvalRow, progress: _Progress) -> RunResult:
    rows = progress.rows
    R, R_agn = [r.ti for r in rows], [r.agnostic for r in rows]
    heldout = [r0.heldout] + [r.heldout for r in rows]
    heldout_agn = [r0.heldout_agnostic] + [r.heldout_agnostic for r in rows]
    res = RunResult(name, [t.name for t in tasks], R, r0.ti, R_agn, r0.agnostic, heldout, heldout_agn)
    res.metrics = cl_metrics(R, r0.ti)
    res.metrics["diag"] = sum(R[j][j] for j in range(len(R))) / len(R)
    res.metrics["heldout_drop"] = res.heldout[-1] - res.heldout[0]
    res.metrics["heldout_worst_drop"] = min(res.heldout[1:]) - res.heldout[0]
    res.agnostic = protocol_metrics(R_agn, r0.agnostic, heldout_agn)
    if (
        rows[-1].distractor is not None
    ):  # the learned tasks' texts with Banking77's labels as extra candidates
        res.agnostic["last_with_heldout_labels"] = rows[-1].distractor
    gated = protocol_metrics(gated_matrix(R, r0.ti), r0.ti, [heldout[0]] * len(heldout))
    res.gated = {**gated, "by_construction": ["transfer_retention", "heldout_change"]}
    res.cost = _summarise(progress.costs)
    return res
