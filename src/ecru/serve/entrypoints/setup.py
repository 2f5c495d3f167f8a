"""What `ecru serve api`, `run` and `probe` build: a model, its request engine and cb-sjf's and cb-srpt's
predictors, every setting checked before the model loads (`EngineSetup`); `simulate`'s trace replay
(`ReplaySetup`). `cli.py` only maps its arguments onto these."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ecru.errors import EcruError
from ecru.serve.sched.names import SJF_POLICIES
from ecru.serve.sched.queues import DEFAULT_AGING

if TYPE_CHECKING:
    from ecru.serve.engine.models import ServedModel
    from ecru.serve.engine.request_engine import EngineConfig, RequestEngine
    from ecru.serve.engine.sampling import SamplingParams
    from ecru.serve.entrypoints.openai_api import APIConfig
    from ecru.serve.predict.remaining import RemainingProbe

MIN_PROBE_PROMPTS = 10
"""`ecru serve probe` fits on at least this many prompts (hundreds are better)."""


@contextmanager
def one_line(prefix: str = "") -> Iterator[None]:
    """A ValueError raised inside becomes one `EcruError` line: `prefix` (the flag or file it concerns), then
    the message."""
    try:
        yield
    except ValueError as exc:
        raise EcruError(f"{prefix}{exc}") from None


@dataclass(frozen=True)
class EngineSetup:
    """A model to load and its engine's settings (`ecru serve api/run/probe`); checked on construction, before
    any model loads: a wrong combination or predictor folder is one `EcruError` naming the flag to change."""

    model: str = "smollm2"
    """smollm2 (bundled), tiny (random, for tests) or the path of a local Hugging Face model folder."""
    policy: str = "cb"
    """Admission (`EngineConfig.policy`): cb first come first served, cb-sjf shortest predicted answer first
    (aged; by --length-predictor, or by max_tokens without it), cb-srpt cb-sjf plus shortest predicted
    remaining first, re-predicted every 16 tokens by --remaining-probe, cb-kv KV memory reserved per request
    (more rows)."""
    max_batch_size: int = 16
    """Rows decoded together at most."""
    max_new_tokens: int = 256
    """max_tokens of a request that gives none, and the largest one may ask for."""
    prefix_cache: int = 16
    """Recent prompts whose KV is kept so that prompts starting alike (a system prompt) skip recomputing the
    start; 0: off."""
    fcfs_slack: float | None = None
    """cb-sjf, cb-srpt (`EngineConfig.fcfs_slack`): a request that has waited (1 + S) x the wait first come
    first served would now impose is admitted first (the wait estimated from the predicted lengths;
    docs/serve.md); None: the policy's shipped default (cb-srpt's 0.15), inf: off (aged instead)."""
    length_predictor: str | None = None
    """cb-sjf, cb-srpt: predict each answer's length from the prompt with the predictor `ecru serve probe
    --out DIR` fitted for this model (a lookup of its own embeddings and a dot product per request);
    cb-srpt's default: the --remaining-probe folder's, when it holds one (the shipped configuration)."""
    remaining_probe: str | None = None
    """cb-srpt (required there, only there): the remaining-length probe `ecru serve probe --out DIR` fitted
    for this model."""
    packed_weights: bool = True
    """Multiply by a copy of the linear layers' weights pre-packed for the CPU (`ecru.serve.engine.packed`):
    faster decode steps, those weights twice in memory (--no-packed-weights: once)."""

    def __post_init__(self):
        if self.fcfs_slack is not None and self.policy not in SJF_POLICIES:
            raise EcruError(
                "--fcfs-slack applies to --policy cb-sjf or cb-srpt only: drop it or add --policy cb-sjf"
            )
        object.__setattr__(self, "length_predictor", self._length_folder())
        if self.length_predictor is not None:
            self._check_length_file()
        if (self.policy == "cb-srpt") != (self.remaining_probe is not None):
            raise EcruError("--policy cb-srpt needs --remaining-probe DIR (fit one with `ecru serve probe`), and only "
                            "it takes one")  # fmt: skip
        self.engine_config  # noqa: B018 - EngineConfig's own checks, now

    def _length_folder(self) -> str | None:
        if self.length_predictor is not None or self.policy != "cb-srpt" or self.remaining_probe is None:
            return self.length_predictor
        from ecru.serve.predict.predictors import LENGTH_FILE

        return self.remaining_probe if (Path(self.remaining_probe) / LENGTH_FILE).is_file() else None

    def _check_length_file(self) -> None:
        """A policy that uses the predictor, and a folder holding one for this model with a cap at least
        `max_new_tokens`."""
        from ecru.serve.predict.predictors import model_key, read_length_file

        if self.policy not in SJF_POLICIES:
            raise EcruError(
                "--length-predictor orders cb-sjf's and cb-srpt's queue: drop it or add --policy cb-sjf"
            )
        where = f"--length-predictor {self.length_predictor}"
        with one_line("--length-predictor "):
            meta, _, _ = read_length_file(self.length_predictor)
        _check_fit(where, meta["model"], model_key(self.model), self.model)
        _check_cap(where, "answers", meta["cap"], self.max_new_tokens)

    @property
    def engine_config(self) -> EngineConfig:
        from ecru.serve.sched.scheduler import EngineConfig

        with one_line():
            return EngineConfig(
                policy=self.policy,
                max_batch_size=self.max_batch_size,
                max_new_tokens=self.max_new_tokens,
                prefix_cache=self.prefix_cache,
                fcfs_slack=self.fcfs_slack,
            )

    def load_remaining(self) -> RemainingProbe | None:
        """The `remaining_probe` folder's probe, read before the model loads (None without one)."""
        from ecru.serve.predict.remaining import RemainingProbe

        if self.remaining_probe is None:
            return None
        with one_line("--remaining-probe "):
            return RemainingProbe.load(self.remaining_probe)

    def fitted_cap(self, remaining: RemainingProbe | None) -> int | None:
        """The longest answer the predictors in use were fitted for (None: none in use)."""
        from ecru.serve.predict.predictors import read_length_file

        caps = [] if remaining is None else [remaining.cap]
        if self.length_predictor is not None:
            caps.append(read_length_file(self.length_predictor)[0]["cap"])
        return min(caps, default=None)

    def load_model(self) -> ServedModel:
        from ecru.serve.engine.models import ServedModel

        return ServedModel.load(self.model, packed=self.packed_weights)

    def attach(self, served: ServedModel, remaining: RemainingProbe | None) -> RequestEngine:
        """The engine of the loaded model with its predictors, each checked against it."""
        from ecru.serve.predict.predictors import EmbeddingPredictor

        if remaining is not None:
            _check_probe(f"--remaining-probe {self.remaining_probe}", remaining, served, self.max_new_tokens)
        predict = None
        if self.length_predictor is not None:
            with one_line("--length-predictor "):
                length = EmbeddingPredictor.load(self.length_predictor, served.model, served.tokenizer)
            predict = length.engine_predict
        # the engine's own checks (e.g. kept KV on a model with chunked attention), in its own words
        with one_line():
            return served.engine(self.engine_config, remaining=remaining, predict=predict)


def _check_fit(where: str, fitted: str, key: str, model: str) -> None:
    if fitted != key:
        raise EcruError(f"{where}: fitted for model {fitted!r}, not {key!r}; fit one for it with `ecru serve probe "
                        f"--model {model}`")  # fmt: skip


def _check_cap(where: str, what: str, cap: int, max_new_tokens: int) -> None:
    if max_new_tokens > cap:
        raise EcruError(f"{where}: it predicts {what} up to {cap} tokens, below --max-new-tokens {max_new_tokens}; "
                        f"lower it or fit with `ecru serve probe --max-new-tokens {max_new_tokens}`")  # fmt: skip


def _check_probe(where: str, probe: RemainingProbe, served: ServedModel, max_new_tokens: int) -> None:
    from ecru.serve.predict.predictors import model_key

    _check_fit(where, probe.model, model_key(served.name), served.name)
    width = served.model.config.get_text_config().hidden_size
    if probe.hidden_size != width:
        raise EcruError(f"{where}: it reads hidden states of width {probe.hidden_size}, the model's are {width}; fit "
                        f"one for this model with `ecru serve probe --model {served.name}`")  # fmt: skip
    _check_cap(where, "remainders of answers", probe.cap, max_new_tokens)


# ---- the front ends ------------------------------------------------------------------------------------
def serve_api(setup: EngineSetup, api: APIConfig, *, host: str, port: int) -> None:
    """`ecru serve api`: serve until Ctrl-C (KeyboardInterrupt after the requests in flight drained)."""
    from ecru.serve.entrypoints.server import check_bindable, serve_forever

    remaining = setup.load_remaining()
    check_bindable(host, port)  # a busy port is refused before the model loads
    served = setup.load_model()
    engine = setup.attach(served, remaining)
    print(f"serving {served.describe()} on http://{host}:{port}/v1 (policy {setup.policy})", file=sys.stderr)
    serve_forever(served, engine, host=host, port=port, api=api)


def run_file(setup: EngineSetup, base: SamplingParams, *, src: Path, out: Path, skip_invalid: bool) -> str:
    """`ecru serve run`: answer the lines of `src` not yet in `out` (appended as they finish, then put in input
    order); the summary line. `setup.max_new_tokens` is raised to the largest line's max_tokens."""
    from ecru.serve.entrypoints import batch_run

    lines, skipped = batch_run.read_batch(src, skip_invalid=skip_invalid)
    done = {r["id"] for r in batch_run.read_answers(out)} & {line.id for line in lines}
    todo = [line for line in lines if line.id not in done]
    remaining, tokens = setup.load_remaining(), 0
    _check_line_caps(todo, setup.fitted_cap(remaining), src=src)
    if todo:
        served = setup.load_model()
        print(f"loaded {served.describe()}", file=sys.stderr)
        todo = batch_run.encode_lines(
            served, todo, base, path=src, skip_invalid=skip_invalid, skipped=skipped
        )
    if todo:
        cap = max(setup.max_new_tokens, *(e.params.max_tokens for e in todo))
        engine = dataclasses.replace(setup, max_new_tokens=cap).attach(served, remaining)
    for message in skipped:
        print(f"skipped {message}", file=sys.stderr)
    if todo:
        tokens = batch_run.run_batch(engine, todo, out=out)
    batch_run.reorder(out, lines)
    return (f"{len(todo)} answered ({tokens} tokens), {len(done)} already in {out}, {len(skipped)} invalid "
            "line(s) skipped")  # fmt: skip


def _check_line_caps(lines: list, fitted: int | None, *, src: Path) -> None:
    """A line's max_tokens within what the predictors were fitted for, said of the line (it raises the engine's
    cap above --max-new-tokens), before the model loads."""
    over = [line for line in lines if fitted is not None and (line.max_tokens or 0) > fitted]
    if over:
        raise EcruError(f"{src}:{over[0].line}: max_tokens {over[0].max_tokens} is above {fitted}, the longest answer "
                        f"the predictors were fitted for; lower it or fit them with `ecru serve probe "
                        f"--max-new-tokens {over[0].max_tokens}`")  # fmt: skip


def probe_prompts(src: Path) -> list:
    """`ecru serve probe`'s input lines (as `serve run` reads them), at least `MIN_PROBE_PROMPTS`."""
    from ecru.serve.entrypoints import batch_run

    lines, _ = batch_run.read_batch(src, skip_invalid=False, hint="")
    if len(lines) < MIN_PROBE_PROMPTS:
        raise EcruError(f"{src}: {len(lines)} prompt(s); a probe needs at least {MIN_PROBE_PROMPTS} (hundreds are "
                        "better)")  # fmt: skip
    return lines


def fit_probe_folder(setup: EngineSetup, lines: list, *, src: Path, out: Path) -> str:
    """`ecru serve probe`: answer `lines` greedily (capped at `setup.max_new_tokens`, each line's own
    max_tokens ignored), fit cb-srpt's remaining-length probe and the prompt-length predictor on them and
    write both to `out` with their held-out reports (probe.json) and a manifest; the summary line."""
    from ecru.serve.engine.sampling import SamplingParams
    from ecru.serve.entrypoints import batch_run
    from ecru.serve.predict.remaining import greedy_answers

    served, cap = setup.load_model(), setup.max_new_tokens
    print(f"loaded {served.describe()}; answering {len(lines)} prompts greedily", file=sys.stderr)
    lines = [dataclasses.replace(x, max_tokens=None) for x in lines]
    todo = batch_run.encode_lines(served, lines, SamplingParams(max_tokens=cap), path=src, skip_invalid=False,
                                  skipped=[], hint="")  # fmt: skip
    prompts = [e.prompt_ids for e in todo]
    answers = greedy_answers(served, prompts, cap=cap, config=setup.engine_config, progress=True)
    with one_line(f"{src}: "):
        report, length_report = save_predictors(served, prompts, answers, cap=cap, out=out)
    return (f"fitted on {report['answers']} greedy answers ({report['answer_tokens']} tokens); held out "
            f"{report['held_out_answers']}: remaining-length Spearman {_rho(report)} over "
            f"{report['held_out_points']} re-predictions, prompt-length Spearman {_rho(length_report)}; wrote "
            f"{out}")  # fmt: skip


def fit_predictors(served: ServedModel, prompts, answers, *, cap: int):
    """What plain cb-srpt serves with, fitted on `prompts` (token ids) and their greedy `answers`: the
    remaining-length probe and the prompt-length `EmbeddingPredictor`, with their held-out reports."""
    from ecru.serve.predict.predictors import fit_length_predictor
    from ecru.serve.predict.remaining import fit_probe

    probe, report = fit_probe(served, prompts, answers, cap=cap)
    length, length_report = fit_length_predictor(served, prompts, [len(a) for a in answers], cap=cap)
    return probe, report, length, length_report


def save_predictors(served: ServedModel, prompts, answers, *, cap: int, out: Path) -> tuple[dict, dict]:
    """`fit_predictors`, written to `out` (the report first: the weight files are what serving reads; the
    manifest last, checked when either is loaded)."""
    from ecru.io import atomic_write_json, write_manifest
    from ecru.serve.predict.predictors import model_key

    probe, report, length, length_report = fit_predictors(served, prompts, answers, cap=cap)
    meta = {"model": model_key(served.name), "cap": cap, "held_out": report,
            "length_predictor_held_out": length_report}  # fmt: skip
    atomic_write_json(out / "probe.json", meta)
    write_manifest(out, [probe.save(out).name, length.save(out).name, "probe.json"])
    return report, length_report


def _rho(report: dict) -> str:
    return "n/a" if report["spearman"] is None else f"{report['spearman']:.2f}"


def check_keep_kv(*, keep_kv: bool, resume_failures: bool) -> None:
    """`--keep-kv` only with `--resume-failures` (`PlanConfig`'s rule, said in the flags' words)."""
    if keep_kv and not resume_failures:
        raise EcruError("--keep-kv keeps the KV of the rows --resume-failures resumes: add --resume-failures")


# ---- label and cost: what the simulators and the benchmark read ---------------------------------------
def label_file(model: str, prompts: str, *, out: str, n: int, split: str, samples: int, max_new_tokens: int,
               batch_size: int) -> str:  # fmt: skip
    """`ecru serve label`: the model's own answer lengths for `n` prompts of a source, cached in `out`
    (appended to); the summary line."""
    from ecru.serve.engine.models import load_model
    from ecru.serve.predict.labels import drop_torn_tail, label_prompts, read_labels
    from ecru.serve.predict.predictors import model_key
    from ecru.serve.prompts import load_prompts

    drop_torn_tail(out)  # what a kill mid-append left: the same command finishes the run
    read_labels(out)  # a malformed cache stops here, before any work
    texts = load_prompts(prompts, n=n, split=split)
    lm, tokenizer = load_model(model)
    labels = label_prompts(lm, tokenizer, texts, out=out, model_key=model_key(model), samples=samples,
                           max_new_tokens=max_new_tokens, batch_size=batch_size)  # fmt: skip
    lengths = sorted(r.label for r in labels)
    at_cap = sum(x >= max_new_tokens for x in lengths)
    return f"{len(labels)} labels in {out}; median {lengths[len(lengths) // 2]}, at cap {at_cap}"


def measure_cost(model: str, *, reps: int, out: str) -> str:
    """`ecru serve cost`: the model's step times on this machine, written to `out`; the summary line."""
    import torch

    from ecru.serve.engine.models import load_model
    from ecru.serve.sim.cost import measure_cost_model

    lm, _ = load_model(model)
    cost = measure_cost_model(lm, reps=reps, source=f"{model}, {torch.get_num_threads()} thread(s), measured")
    cost.save(out)
    return f"wrote {out}: {cost}"


# ---- simulate ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplaySetup:
    """`ecru serve simulate`: a length trace replayed through one policy on a cost model."""

    trace: Path
    """JSONL lines {"prompt_len", "output_len", "predicted_len"}."""
    policy: str = "fcfs"
    """A static or continuous policy (`names.POLICIES`)."""
    batch_size: int = 16
    """Rows per batch."""
    max_new_tokens: int = 512
    """Global cap on answer tokens."""
    token_budget: int | None = None
    """fcr+vbs: rows x (prompt + cap) per batch."""
    max_batch_size: int | None = None
    """fcr+vbs: hard row limit per batch."""
    resume_failures: bool = False
    """fcr*: a row cut at its predicted cap is resumed, not recomputed."""
    keep_kv: bool = False
    """With `resume_failures`: a cut row keeps its KV for its rerun."""
    cost_model: Path | None = None
    """Cost model JSON (`ecru serve cost`); None: SmolLM2 on one CPU thread."""
    refill_min: int = 4
    """Continuous policies: admit when this many rows are free."""
    aging: float = DEFAULT_AGING
    """cb-sjf, cb-ljf: priority tokens per step waited."""
    predict_s: float = 0.0
    """Seconds of length prediction added."""

    def __post_init__(self):
        check_keep_kv(keep_kv=self.keep_kv, resume_failures=self.resume_failures)
        self.plan  # noqa: B018 - PlanConfig's own checks, now

    @property
    def plan(self):
        from ecru.serve.sched.policies import PlanConfig

        with one_line():
            return PlanConfig(batch_size=self.batch_size, max_new_tokens=self.max_new_tokens,
                              token_budget=self.token_budget, max_batch_size=self.max_batch_size,
                              resume=self.resume_failures, keep_kv=self.keep_kv)  # fmt: skip

    def run(self) -> dict:
        """The replay's result JSON, with the settings it ran under."""
        from ecru.serve.sim.cost import SMOLLM2_CPU, CostModel
        from ecru.serve.sim.simulator import read_trace, simulate

        cost = CostModel.load(self.cost_model) if self.cost_model else SMOLLM2_CPU
        trace = read_trace(self.trace)
        with one_line():
            result = simulate(trace, policy=self.policy, config=self.plan, cost=cost, predict_s=self.predict_s,
                              aging=self.aging, refill_min=self.refill_min)  # fmt: skip
        return {**result.to_json(), "batch_size": self.batch_size, "max_new_tokens": self.max_new_tokens,
                "resume_failures": self.resume_failures, "keep_kv": self.keep_kv, "cost_model": cost.source}  # fmt: skip
