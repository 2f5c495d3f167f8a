"""Static batching benchmark: every scheduling policy for real on one group of held-out prompts, with a
learned length predictor, plus the simulator's view of the same lengths.

    OMP_NUM_THREADS=1 python bench/serve.py --model smollm2 --n 64 --max-new-tokens 128 --repeats 3 \
        --predictor probe --labels bench/results/serve_labels_smollm2.jsonl --json bench/results/serve_bench.json

Order of work: FCFS runs first and records the true (greedy, capped) lengths and the reference outputs;
the predictor (trained on train-split labels, cached) then predicts the held-out prompts, timed once;
each other policy runs with those predictions, its wall time including the prediction time (oracle and
cb need none). Plain cb-srpt is the engine's as it ships (`ShippedSRPT`): `ecru serve probe`'s two predictors,
fitted on the train prompts' greedy answers, predict inside the engine, on its clock. Every run's outputs are
compared with that first FCFS run's, which equal unscheduled greedy generation.

Repetitions (`repeats` R): the machine's load drifts between runs, so one run per policy in a fixed
order turns drift into policy differences. Repetition k runs the policies rotated to start at policy k
(repetition 0 starts with the FCFS reference run), so every policy takes every position in turn. Per
policy the JSON reports the median of each metric over the repetitions, and `speedup_vs_fcfs`, the
median over repetitions of samples/s divided by the same repetition's FCFS samples/s (paired ratios).

Then the simulator replays the measured lengths (the cost model of this machine if given, scaled so that
fcfs takes its measured wall time) to compare effective token ratios and throughput ratios. Prints the
tables; writes the JSON (printed without `--json`) and, next to it, a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import resource
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ecru.cliargs import (
    ArgumentParser,
    add_config_flags,
    config_from_args,
    existing_file,
    note_long_run,
    prepare_out_file,
    run_main,
)
from ecru.errors import EcruError
from ecru.serve.sched.names import ENGINE_POLICIES, POLICIES
from ecru.serve.sched.queues import DEFAULT_AGING

if TYPE_CHECKING:
    from ecru.serve.engine.models import ServedModel
    from ecru.serve.predict.predictors import EmbeddingPredictor
    from ecru.serve.predict.remaining import RemainingProbe

BENCH_POLICIES = (*POLICIES, *(p for p in ENGINE_POLICIES if p not in POLICIES))
"""What the benchmark runs: every policy of the runner, and the engine's own cb-srpt as it ships
(`ShippedSRPT`)."""

PREDICTORS = ("self-lora", "probe", "embed", "minilm", "oracle", "constant")
# SmolLM2's labels committed with the repository (rebuilt by `ecru serve label`, see bench/results/)
REPO_LABELS = Path(__file__).resolve().parent / "results" / "serve_labels_smollm2.jsonl"
REPO_INSTRUCTION_LABELS = REPO_LABELS.with_name("serve_workload_labels_train.jsonl")
"""Greedy SmolLM2 labels (cap 256) of the instruction workload's first 1,000 train prompts."""
NEEDS_PREDICTION = ("sorted", "fcr", "fcr+vbs", "fcr+vbs+bins", "cb-sjf", "cb-ljf", "cb-kv")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run."""

    model: str = "smollm2"
    """smollm2 or tiny."""
    prompts: str = "mixed"
    """clinc, banking, mixed (CLINC and Banking77 queries), instructions (the instruction workload): their test
    split, held out; or a JSONL file of {"prompt": ...}."""
    n: int = 256
    """Number of prompts served."""
    max_new_tokens: int = 256
    """Global cap on generated tokens."""
    batch_size: int = 16
    """Static batch size (and continuous batching's row limit)."""
    policies: tuple[str, ...] = tuple(p for p in BENCH_POLICIES if p != "cb-ljf")
    """Policies to run, comma-separated on the command line (default: all but cb-ljf; fcfs always runs first:
    it records the true lengths); cb-srpt is the engine's as it ships (`ShippedSRPT`: `ecru serve probe`'s predictors fitted on
    the train prompts' greedy answers)."""
    predictor: str = "self-lora"
    """Length predictor for the predicted policies (plain cb-srpt serves with its shipped predictors)."""
    labels: str | None = None
    """Labels JSONL for training the predictor (default: the cache, built on first use)."""
    train_n: int = 192
    """Train-split prompts to label (if missing) and train on."""
    aging: float = DEFAULT_AGING
    """cb-sjf aging, priority tokens per decode step waited."""
    lora_epochs: int = 2
    """Epochs of self-lora tuning (the paper: 3; each SmolLM2 step costs seconds on a CPU)."""
    lora_readout: str = "greedy"
    """How self-lora's prediction is read (`SelfLoRAConfig.readout`): "greedy" (the paper's) or "expected"."""
    repeats: int = 1
    """Repetitions of every policy, in a rotated order (medians and paired ratios to fcfs reported)."""
    resume_failures: bool = False
    """FCR reruns resume from the tokens a failed row had (`PlanConfig.resume`) instead of starting over."""
    keep_kv: bool = False
    """With `resume_failures`: a failed row's KV is kept for its rerun, no prefill (`PlanConfig.keep_kv`)."""

    def __post_init__(self):
        bad = [p for p in self.policies if p not in BENCH_POLICIES]
        if bad:
            raise EcruError(f"unknown policies {bad}; choose from {', '.join(BENCH_POLICIES)}")
        if self.predictor not in PREDICTORS:
            raise EcruError(f"unknown predictor {self.predictor!r}; choose from {', '.join(PREDICTORS)}")
        if self.lora_readout not in ("greedy", "expected"):
            raise EcruError(f"unknown --lora-readout {self.lora_readout!r}; choose greedy or expected")
        if min(self.n, self.max_new_tokens, self.batch_size, self.train_n, self.repeats) < 1:
            raise EcruError("--n, --max-new-tokens, --batch-size, --train-n and --repeats must be >= 1")
        from ecru.serve.prompts import check_source

        check_source(self.prompts)  # before any model loads
        from ecru.serve.entrypoints.setup import check_keep_kv

        check_keep_kv(keep_kv=self.keep_kv, resume_failures=self.resume_failures)
        if self.labels:
            from ecru.serve.predict.labels import read_labels

            read_labels(self.labels)  # malformed: one line now, not a traceback after the run

    def long_run(self) -> str | None:
        """What a run this long costs, said before it starts (None for a short one)."""
        if self.model != "smollm2" or self.n * self.max_new_tokens * self.repeats < 8192:
            return None
        # ~14 ms per row-token at batch 16 on one CPU thread (docs/serve.md), every row to the cap at worst
        hours = self.n * self.max_new_tokens * 0.014 * len(self.policies) * self.repeats / 3600
        return (f"{len(self.policies)} policies x {self.repeats} repeat(s) x {self.n} prompts x cap {self.max_new_tokens} "
                f"on SmolLM2: up to ~{hours:.1f} h on a CPU, plus the predictor's training (less with --n, "
                "--max-new-tokens or --policies)")  # fmt: skip


def labels_path(config: BenchConfig) -> Path:
    from ecru.models import cache_dir

    if config.labels:
        return Path(config.labels)
    instructions = config.prompts == "instructions"
    repo = REPO_INSTRUCTION_LABELS if instructions else REPO_LABELS
    if config.model == "smollm2" and config.max_new_tokens <= 256 and repo.is_file():
        return repo
    tail = "-instructions" if instructions else ""
    return cache_dir() / "serve" / f"labels-{config.model}-cap{config.max_new_tokens}{tail}.jsonl"


def train_labels(model, tokenizer, config: BenchConfig) -> tuple[list[str], list[float]]:
    """Train-split prompts and their labels, generating the missing ones (greedy, one sample)."""
    from ecru.serve.predict.labels import label_prompts, read_labels
    from ecru.serve.predict.predictors import model_key
    from ecru.serve.prompts import load_prompts

    path = labels_path(config)
    key = model_key(config.model)
    have = [r for r in read_labels(path) if r.max_new_tokens >= config.max_new_tokens and r.model == key]
    if len(have) < config.train_n:
        source = "instructions" if config.prompts == "instructions" else "mixed"
        prompts = load_prompts(source, n=config.train_n, split="train")
        print(f"labelling {config.train_n} train prompts into {path} (cached for later runs)")
        have = label_prompts(model, tokenizer, prompts, out=path, model_key=model_key(config.model), samples=1,
                             max_new_tokens=config.max_new_tokens)  # fmt: skip
    have = have[: config.train_n]
    return [r.prompt for r in have], [float(min(r.label, config.max_new_tokens)) for r in have]


def build_predictor(model, tokenizer, config: BenchConfig, true_lengths: dict[str, float]):
    """The named predictor, trained (and for self-lora cached) on the train labels."""
    from ecru.serve.predict.predictors import (
        ConstantPredictor,
        EmbeddingPredictor,
        MiniLMPredictor,
        OraclePredictor,
        ProbePredictor,
    )

    if config.predictor == "oracle":
        return OraclePredictor(true_lengths)
    prompts, labels = train_labels(model, tokenizer, config)
    if config.predictor == "constant":
        return ConstantPredictor(statistics.median_low(labels))
    if config.predictor == "minilm":
        return MiniLMPredictor(cap=config.max_new_tokens).fit(prompts, labels)
    if config.predictor == "probe":
        return ProbePredictor(model, tokenizer, cap=config.max_new_tokens).fit(prompts, labels)
    if config.predictor == "embed":
        return EmbeddingPredictor(model, tokenizer, cap=config.max_new_tokens).fit(prompts, labels)
    return _self_lora(model, tokenizer, config, prompts, labels)


def _self_lora(model, tokenizer, config: BenchConfig, prompts, labels):
    from ecru.models import cache_dir
    from ecru.serve.predict.self_predict import SelfLoRAConfig, SelfLoRAPredictor

    lora = SelfLoRAConfig(cap=config.max_new_tokens, epochs=config.lora_epochs, readout=config.lora_readout)
    tuning = dataclasses.replace(lora, readout="greedy")  # the readout does not change the adapter: one cache
    key = hashlib.sha256(json.dumps([config.model, repr(tuning), prompts, labels]).encode()).hexdigest()[:12]
    path = cache_dir() / "serve" / f"self-lora-{config.model}-{key}"
    if (path / "adapter_config.json").is_file():
        predictor = SelfLoRAPredictor(model, tokenizer, config=lora, adapter_path=path)
        predictor.default = float(statistics.median_low(labels))
        return predictor
    predictor = SelfLoRAPredictor(model, tokenizer, config=lora).fit(prompts, labels)
    predictor.save(path)
    return predictor


def rotated_orders(policies: tuple[str, ...], repeats: int) -> list[list[str]]:
    """Repetition k runs `policies` rotated to start at policy k mod len(policies)."""
    return [list(policies[k % len(policies) :] + policies[: k % len(policies)]) for k in range(repeats)]


def _median(values: list[float | None]) -> float | None:
    """The median, or None for a metric the policy does not measure (static policies' peak_kv_tokens)."""
    return None if None in values else statistics.median(values)


def summarize_runs(runs: list[dict[str, float]], fcfs: list[dict[str, float]]) -> dict:
    """One policy's repetitions: the median of each metric, and the median paired ratio to fcfs."""
    ratios = [r["samples_per_s"] / f["samples_per_s"] for r, f in zip(runs, fcfs, strict=True)]
    return {
        **{key: _median([r[key] for r in runs]) for key in runs[0]},
        "speedup_vs_fcfs": statistics.median(ratios),
        "speedup_vs_fcfs_runs": ratios,
        "samples_per_s_runs": [r["samples_per_s"] for r in runs],
        "wall_s_runs": [r["wall_s"] for r in runs],
    }


def run_bench(config: BenchConfig, *, progress: bool = True) -> dict:
    """Run every policy `config.repeats` times; return the benchmark JSON (policies, predictor, setup)."""
    import contextlib

    import torch

    from ecru.serve.engine.models import ServedModel, load_model
    from ecru.serve.engine.policy_runs import run_policy
    from ecru.serve.predict.predictors import length_metrics, timed_predict
    from ecru.serve.prompts import encode_chat, load_prompts
    from ecru.serve.sched.policies import PlanConfig

    served = ServedModel(config.model, *load_model(config.model))
    texts = load_prompts(config.prompts, n=config.n, split="test")
    ids = encode_chat(served.tokenizer, texts)
    gen = served.generation
    plan = PlanConfig(
        batch_size=config.batch_size,
        max_new_tokens=config.max_new_tokens,
        resume=config.resume_failures,
        keep_kv=config.keep_kv,
    )
    srpt = None

    def run(policy, predicted, predict_s):
        if policy == "cb-srpt":
            return srpt.run(ids)
        return run_policy(served.model, ids, policy=policy, predicted=predicted, gen=gen, plan=plan,
                          aging=config.aging, predict_s=predict_s, progress=progress)  # fmt: skip

    with torch.no_grad():
        reference = run("fcfs", None, 0.0)
    true = [float(len(t)) for t in reference.tokens]
    predictor = build_predictor(served.model, served.tokenizer, config, dict(zip(texts, true, strict=True)))
    predicted, predict_s = timed_predict(predictor, texts)
    # (predictions, seconds charged) per policy; fcfs and cb use neither, cb-srpt predicts as it serves
    inputs = {p: (predicted, predict_s) for p in NEEDS_PREDICTION} | {"oracle": (true, 0.0)}
    names = ("fcfs", *(p for p in config.policies if p != "fcfs"))
    orders = rotated_orders(names, config.repeats)
    samples: dict[str, list[dict]] = {p: [] for p in names}
    same = dict.fromkeys(names, True)
    quiet = getattr(predictor, "adapter_disabled", contextlib.nullcontext)
    with quiet(), torch.no_grad():
        if "cb-srpt" in names:
            srpt = ShippedSRPT.fit(served, config, progress=progress)
        for k, order in enumerate(orders):
            for policy in order:
                r = reference if (k, policy) == (0, "fcfs") else run(policy, *inputs.get(policy, (None, 0.0)))
                samples[policy].append(r.metrics())
                same[policy] &= r.tokens == reference.tokens
                if progress:
                    print(f"[{k + 1}/{config.repeats}] {policy:>8}: {r.wall_s:.1f} s")
    policies = {
        name: {**summarize_runs(samples[name], samples["fcfs"]), "outputs_match_fcfs": same[name]}
        for name in names
        if name in config.policies
    }
    return {
        "policies": policies,
        "predictor": {"name": predictor.name, **length_metrics(predicted, true), "predict_s": predict_s},
        **({"cb_srpt": srpt.report(ids, true)} if srpt is not None else {}),
        "setup": {
            "model": config.model,
            "prompts": config.prompts,
            "n": len(texts),
            "max_new_tokens": config.max_new_tokens,
            "batch_size": config.batch_size,
            "threads": torch.get_num_threads(),
            "repeats": config.repeats,
            "aging": config.aging,
            "resume_failures": config.resume_failures,
            "keep_kv": config.keep_kv,
            "orders": orders,
            "train_labels": str(labels_path(config)),
            "true_lengths": true,
            "predicted_lengths": predicted,
            "prompt_lens": [len(i) for i in ids],
        },
    }


@dataclass
class ShippedSRPT:
    """Plain cb-srpt as `ecru serve api/run` serve it after `ecru serve probe`: the engine's policy with its
    shipped settings (FCFS deadline, kept KV), the probe folder's remaining-length probe and prompt-length
    `EmbeddingPredictor`, fitted (`entrypoints.fit_predictors`) on the train prompts' greedy answers. Its
    predictions run inside the engine, so their time is in its wall time."""

    served: ServedModel
    config: BenchConfig
    probe: RemainingProbe
    length: EmbeddingPredictor
    held_out: dict
    """The probe's and the predictor's held-out reports (`fit_probe`, `fit_length_predictor`)."""
    preemptions: list[int] = dataclasses.field(default_factory=list)
    """Rows swapped out in each run (their KV kept)."""

    @classmethod
    def fit(cls, served, config: BenchConfig, *, progress: bool) -> ShippedSRPT:
        from ecru.serve.entrypoints.setup import fit_predictors
        from ecru.serve.predict.remaining import greedy_answers
        from ecru.serve.prompts import encode_chat

        prompts, _ = train_labels(served.model, served.tokenizer, config)
        ids, cap = encode_chat(served.tokenizer, prompts), config.max_new_tokens
        answers = greedy_answers(served, ids, cap=cap, config=cls._engine(config, "cb"), progress=progress)
        probe, report, length, length_report = fit_predictors(served, ids, answers, cap=cap)
        held_out = {"remaining_probe": report, "length_predictor": length_report}
        return cls(served, config, probe, length, held_out)

    @staticmethod
    def _engine(config: BenchConfig, policy: str):
        from ecru.serve.sched.scheduler import EngineConfig

        # no prefix caching: the other policies run without one
        return EngineConfig(policy=policy, max_batch_size=config.batch_size, max_new_tokens=config.max_new_tokens,
                            prefix_cache=0)  # fmt: skip

    def run(self, ids):
        """Every prompt arriving at once, served to completion (`runner.PolicyRun`; kept-KV preemptions
        recompute nothing, so no failures)."""
        from ecru.serve.engine.policy_runs import PolicyRun
        from ecru.serve.engine.sampling import SamplingParams

        engine = self.served.engine(self._engine(self.config, "cb-srpt"), remaining=self.probe,
                                    predict=self.length.engine_predict)  # fmt: skip
        start = time.perf_counter()
        reqs = engine.generate(ids, SamplingParams(max_tokens=self.config.max_new_tokens))
        finish, s = [r.finish_s - start for r in reqs], engine.stats
        self.preemptions.append(s.preemptions)
        return PolicyRun("cb-srpt", [r.output for r in reqs], finish, time.perf_counter() - start, s.tokens, 0,
                         s.peak_kv_tokens)  # fmt: skip

    def report(self, ids, true: list[float]) -> dict:
        """The predictors' held-out reports on the train prompts, and the length predictor on the test ones."""
        from ecru.serve.predict.predictors import length_metrics

        test = length_metrics(self.length.predict_ids(ids), true)
        return {**self.held_out, "length_predictor_test": test, "preemptions": self.preemptions}


def format_bench(result: dict) -> str:
    """The benchmark's per-policy table (throughput relative to fcfs) and the predictor's accuracy."""
    base = result["policies"]["fcfs"]["samples_per_s"]
    repeats = result.get("setup", {}).get("repeats", 1)
    lines = []
    if repeats > 1:
        lines.append(f"medians of {repeats} repetitions in rotated order; x fcfs: median of paired ratios")
    lines += [
        f"{'policy':>8} {'samples/s':>9} {'x fcfs':>7} {'eff':>6} {'fail':>5} {'mean lat':>8} {'p99 lat':>8} {'same':>5}"
    ]
    for name, m in result["policies"].items():
        lines.append(
            f"{name:>8} {m['samples_per_s']:9.3f} {m.get('speedup_vs_fcfs', m['samples_per_s'] / base):7.2f} {m['effective_token_ratio']:6.3f} "
            f"{m['failure_ratio']:5.2f} {m['mean_latency_s']:8.1f} {m['p99_latency_s']:8.1f} {str(m['outputs_match_fcfs']):>5}"
        )
    p = result["predictor"]
    lines.append(
        f"predictor {p['name']}: MAE {p['mae']:.1f}, Acc-50 {p['acc50']:.2f}, Acc-100 {p['acc100']:.2f}, "
        f"{p['predict_s']:.1f} s"
    )
    return "\n".join(lines)


def simulate_measured(result: dict, *, cost_path: str | Path | None) -> dict:
    """The simulator on the bench's own lengths: effective ratio and samples/s ratio per policy run."""
    from ecru.serve import SMOLLM2_CPU, CostModel, PlanConfig, TraceRequest, simulate

    setup = result["setup"]
    cost = CostModel.load(cost_path) if cost_path else SMOLLM2_CPU
    trace = [
        TraceRequest(p, int(t), q)
        for p, t, q in zip(
            setup["prompt_lens"], setup["true_lengths"], setup["predicted_lengths"], strict=True
        )
    ]
    config = PlanConfig(
        batch_size=setup["batch_size"],
        max_new_tokens=setup["max_new_tokens"],
        resume=setup.get("resume_failures", False),  # older results: reruns from scratch
        keep_kv=setup.get("keep_kv", False),
    )
    predict_s = result["predictor"]["predict_s"]
    # one scalar calibration: the cost model's shape, scaled so that fcfs takes its measured wall time
    fcfs_s = simulate(trace, policy="fcfs", config=config, cost=cost).time_s
    cost = cost.scaled(result["policies"]["fcfs"]["wall_s"] / fcfs_s)
    out = {}
    for policy in ("fcfs", "sorted", "fcr", "fcr+vbs", "oracle", "cb", "cb-sjf", "cb-ljf", "cb-kv"):
        if policy not in result["policies"]:
            continue
        charged = predict_s if policy not in ("fcfs", "oracle", "cb") else 0.0
        sim = simulate(trace, policy=policy, config=config, cost=cost, predict_s=charged,
                       aging=setup.get("aging", 0.5))  # fmt: skip
        out[policy] = {
            "effective_token_ratio": sim.effective_token_ratio,
            "samples_per_s": sim.samples_per_s,
            "failure_ratio": sim.failure_ratio,
        }
    base_sim, base_real = out["fcfs"]["samples_per_s"], result["policies"]["fcfs"]["samples_per_s"]
    for policy, sim in out.items():
        real = result["policies"][policy]
        sim["speedup"] = sim["samples_per_s"] / base_sim
        sim["measured_speedup"] = real.get("speedup_vs_fcfs", real["samples_per_s"] / base_real)
        sim["measured_effective_token_ratio"] = real["effective_token_ratio"]
    return {"cost_model": cost.source, "policies": out}


def plot(result: dict, path: Path) -> None:
    from ecru.demo.plots import new_figure, save

    pol = result["policies"]
    names = list(pol)
    fig, (ax1, ax2) = new_figure(width=10, height=3.5, ncols=2)
    mid = [pol[n]["speedup_vs_fcfs"] for n in names]
    spread = [  # the range of the paired per-repetition ratios around their median
        [m - min(pol[n]["speedup_vs_fcfs_runs"]) for n, m in zip(names, mid, strict=True)],
        [max(pol[n]["speedup_vs_fcfs_runs"]) - m for n, m in zip(names, mid, strict=True)],
    ]
    ax1.bar(names, mid, yerr=spread, capsize=3, color="tab:blue")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set(ylabel="samples/s relative to fcfs", title="throughput (prediction time included)")
    ax2.bar(names, [result["policies"][n]["mean_latency_s"] for n in names], color="tab:orange")
    ax2.set(ylabel="mean latency (s)", title="latency")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    save(fig, path)


def format_simulated(simulator: dict) -> str:
    """The simulator's effective token ratio and throughput ratio per policy, beside the measured ones."""
    lines = [f"simulator ({simulator['cost_model']}) on the same lengths:"]
    for name, s in simulator["policies"].items():
        lines.append(
            f"{name:>8} eff {s['effective_token_ratio']:.3f} (measured {s['measured_effective_token_ratio']:.3f})  "
            f"x fcfs {s['speedup']:.2f} (measured {s['measured_speedup']:.2f})"
        )
    return "\n".join(lines)


def _policies(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def build_parser() -> argparse.ArgumentParser:
    """`BenchConfig`'s fields as flags (`cliargs.add_config_flags`), plus where the results go."""
    parser = ArgumentParser(prog="bench/serve.py", description=__doc__.split("\n\n")[0])
    add_config_flags(parser, BenchConfig, model={"choices": ("smollm2", "tiny")}, policies={"type": _policies},
                     predictor={"choices": PREDICTORS}, labels={"type": existing_file},
                     lora_readout={"choices": ("greedy", "expected")})  # fmt: skip
    parser.add_argument(
        "--cost-model",
        type=existing_file,
        default=None,
        help="cost model JSON for the simulator's view (default: spec SmolLM2 on a CPU)",
    )
    parser.add_argument(
        "--json", default=None, help="write the result here and a PNG beside it (default: print it)"
    )
    return parser


def bench(args: argparse.Namespace, *, command: str) -> None:
    """Run the benchmark `args` describe, print its tables, write (or print) its JSON."""
    from ecru.io import atomic_write_json

    config = config_from_args(BenchConfig, args, labels=str(args.labels) if args.labels else None)
    out = prepare_out_file(args.json, flag="--json") if args.json else None
    if config.long_run():
        note_long_run(config.long_run())
    start = time.perf_counter()
    result = {"command": command, **run_bench(config)}
    result["simulator"] = simulate_measured(result, cost_path=args.cost_model)
    result["setup"]["bench_wall_s"] = time.perf_counter() - start
    result["setup"]["host_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("\n" + format_bench(result) + "\n\n" + format_simulated(result["simulator"]))
    if out is None:
        print(json.dumps(result, indent=2))
        return
    atomic_write_json(out, result)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)  # exits 2 with one line on bad arguments
    return run_main(lambda: bench(args, command="python bench/serve.py " + shlex.join(argv)))


if __name__ == "__main__":
    sys.exit(main())
