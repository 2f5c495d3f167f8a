"""One benchmark run, wired from configs: stream, evaluator, the cached teacher, the pretrained row."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ecru.lifelong.evaluate import EvalRow, Evaluator, OpenSetEvaluator
from ecru.lifelong.methods import Method, TrainConfig, make_method, needs_teacher
from ecru.lifelong.methods.registry import Config
from ecru.lifelong.reference import TeacherCache
from ecru.lifelong.runner import RunResult, run_stream
from ecru.lifelong.stream import StreamConfig, build_clinc_stream
from ecru.models import cache_dir, load_minilm

MODEL_ID = "all-MiniLM-L6-v2"


class Experiment:
    """A stream with what every method on it shares: the evaluator, the teacher cache and R0."""

    def __init__(self, stream: StreamConfig, *, cache: Path | None = None, log: Callable[[str], None] = print,
                 open_set_scale: float | None = None):  # fmt: skip
        """`open_set_scale`: also measure CLINC's out-of-scope texts after each task (`OpenSetEvaluator`,
        probabilities at this logit scale)."""
        self.stream_cfg, self.log = stream, log
        self.evaluator = _evaluator(build_clinc_stream(stream), open_set_scale)
        self.teacher = TeacherCache(self.evaluator.stream.reference, load_minilm(), model_id=MODEL_ID,
                                    folder=cache if cache is not None else cache_dir() / "lifelong")  # fmt: skip
        self._r0: EvalRow | None = None

    def r0(self) -> EvalRow:
        """The pretrained model's evaluation, computed once for all methods."""
        if self._r0 is None:
            self.log("evaluating the pretrained model (row R0)")
            self._r0 = self.evaluator.evaluate(self.teacher.teacher, seen=0)
        return self._r0

    def make(self, method: str, train: TrainConfig, *, config: Config | None = None) -> Method:
        """A fresh `method` (with `config` instead of its preset, if given), sharing this stream's teacher."""
        teacher = self.teacher if needs_teacher(method, config) else None
        if teacher is not None:
            teacher.embeddings()  # encode the reference set before the clock of the first task starts
        return make_method(method, load_minilm(), train=train, teacher=teacher, config=config)

    def run(self, method: str | Method, train: TrainConfig | None = None, *, checkpoint_dir: Path | None = None,
            config: Config | None = None) -> RunResult:  # fmt: skip
        """Run `method` (a name, made with `train` and `config`, or a method from `make`) on the stream."""
        m = self.make(method, train, config=config) if isinstance(method, str) else method
        return run_stream(m, self.evaluator, r0=self.r0(), checkpoint_dir=checkpoint_dir, log=self.log)


def _evaluator(stream, open_set_scale: float | None) -> Evaluator:
    if open_set_scale is None:
        return Evaluator(stream)
    from ecru.datasets import load_clinc

    clinc = load_clinc()
    return OpenSetEvaluator(stream, scale=open_set_scale, oos_val=[e.text for e in clinc["oos_val"]],
                            oos_test=[e.text for e in clinc["oos_test"]])  # fmt: skip
