"""Lifelong benchmark: every method on the CLINC domain stream, in two protocols, with costs.

    python bench/lifelong.py --quick --json bench/results/lifelong_agnostic_quick.json   # minutes on 2 cores
    python bench/lifelong.py --full --json bench/results/lifelong_agnostic_full.json     # 10 domains x 3 (seed,
                                                                                        # order) pairs: CPU-hours
    python bench/lifelong.py --split val --methods routed-lora --variant percentile=2 --json sweep.json
                                   # tuning: CLINC's validation split; each --variant adds a routed-lora variant

The headline protocol is task-agnostic (X-TAIL-like): each test text is classified among the labels of every
task learned so far (plus its own task's labels when it is not learned yet: transfer; Banking77's texts among
the learned labels plus Banking77's 77), with no hint of its task. The label-gated protocol (each task among
its own labels, the task given to every method; unseen tasks and Banking77 through the frozen model) is
reported apart: its transfer retention and Banking77 change are 0 by construction and never count as met.

Writes {"config", "targets", "methods": {name: {"agnostic": {last, avg, transfer_retention, heldout_change,
...}, "agnostic_std", "gated": {...}, "gated_std", R_agnostic, R, heldout, cost, runs}}} (means over runs,
std over runs) and two PNGs next to the JSON. The zero-shot row and the teacher's reference embeddings are
computed once per run and shared by the methods.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ecru.cliargs import run_main
from ecru.demo.plots import new_figure, save
from ecru.errors import EcruError
from ecru.io import atomic_write_json
from ecru.lifelong.evaluate import OOS_RECALL
from ecru.lifelong.experiment import Experiment
from ecru.lifelong.methods import ALIASES, METHODS, ROUTED, RoutedConfig, TrainConfig
from ecru.lifelong.stream import StreamConfig

QUICK = dict(tasks=3, train_per_intent=4, test_per_intent=4, heldout_per_class=3, reference_size=400)
FULL = dict(tasks=10, train_per_intent=100, test_per_intent=30, heldout_per_class=40, reference_size=2000)
METHOD = "routed-lora"
"""The method the targets are about."""
KEYS = ("last", "avg", "transfer_retention", "heldout_change", "bwt")
FULL_RUNS = 3
"""The issue's targets hold for the full configuration over at least this many (seed, order) runs."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="3 domains, 4 examples per intent, one seed")
    size.add_argument("--full", action="store_true", help="10 domains, all examples, 3 (seed, order) pairs")
    p.add_argument("--tasks", type=int, default=None, help="override the number of domains")
    p.add_argument(
        "--train-per-intent", type=int, default=None, help="override training utterances per intent"
    )
    p.add_argument("--test-per-intent", type=int, default=None, help="override test utterances per intent")
    p.add_argument(
        "--heldout-per-class", type=int, default=None, help="override Banking77 utterances per class"
    )
    p.add_argument("--runs", default=None, help="comma-separated seed:order pairs, e.g. 0:0,1:1,2:2")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods to run")
    p.add_argument(
        "--split",
        choices=["test", "val"],
        default="test",
        help="evaluation split: test to report, val (CLINC val, Banking77 train as probe) to tune",
    )
    p.add_argument(
        "--variant",
        "--ecru",
        dest="variant",
        action="append",
        default=[],
        metavar="K=V[;K=V]",
        help=f"also run a variant of the {METHOD} preset (RoutedConfig fields), e.g. 'percentile=2;r=4'",
    )
    defaults = TrainConfig()
    p.add_argument("--epochs", type=int, default=defaults.epochs, help="epochs per task")
    p.add_argument("--batch-size", type=int, default=None, help="utterances per step (quick: 16, else 32)")
    p.add_argument(
        "--lr",
        type=float,
        default=defaults.lr,
        help="full fine-tuning learning rate (adapter methods keep their own)",
    )
    p.add_argument("--label-smoothing", type=float, default=defaults.label_smoothing, help="of the task loss")
    p.add_argument("--scale", type=float, default=defaults.scale, help="logit scale of the cosine classifier")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="per-task checkpoints (resumable)")
    p.add_argument(
        "--plot-only", action="store_true", help="redraw the PNGs and table from an existing --json"
    )
    p.add_argument(
        "--reuse",
        default=None,
        metavar="FILE:M1,M2",
        help="copy these methods' results from an earlier JSON of the same stream and runs instead of running "
        "them (marked reused_from; a target against a reused method never counts as met)",
    )
    p.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        default=None,
        metavar="FILE",
        help="instead of running: join the (seed, order) runs and the methods of several JSONs of this script "
        "(same stream and training, one process each) into --json, with the targets over all of them",
    )
    p.add_argument(
        "--no-open-set",
        dest="open_set",
        action="store_false",
        help="skip CLINC's out-of-scope texts after each task (open_set blocks)",
    )
    p.add_argument("--json", type=Path, required=True, help="output JSON; the PNGs are written beside it")
    return p.parse_args(argv)


SAME_RUN_CONFIG = ("stream", "epochs", "batch_size", "lr", "label_smoothing", "scale", "full")
"""What the JSONs joined by `--combine` must share."""


def _results_file(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EcruError(
            f"--combine: cannot read {path} ({exc}); give JSON files this script wrote with --json"
        ) from None
    if not isinstance(out, dict) or not {"config", "methods"} <= set(out):
        raise EcruError(f"--combine: {path} is not a result of this script (no config and methods)")
    return out


def combine(paths: list[Path]) -> dict:
    """One result from several JSONs (`--combine`), one process each: each method's runs joined (a method may
    come from some of the files only: methods of one run measured in separate processes), then aggregated."""
    files = [_results_file(p) for p in paths]
    first = files[0]["config"]
    for p, f in zip(paths[1:], files[1:], strict=True):
        differs = [k for k in SAME_RUN_CONFIG if f["config"].get(k) != first.get(k)]
        if differs:
            raise EcruError(
                f"--combine: {p} differs from {paths[0]} in {differs}; join runs of one configuration only"
            )
    # methods run in separate processes too
    names = list(dict.fromkeys(n for f in files for n in f["methods"]))
    per_method = {n: [r for f in files if n in f["methods"] for r in f["methods"][n]["runs"]] for n in names}
    for n, runs in per_method.items():
        pairs = [(r["seed"], r["order"]) for r in runs]
        if len(set(pairs)) != len(pairs):
            raise EcruError(f"--combine: {n}'s (seed, order) runs {pairs} repeat; join different runs")
    pairs = sorted({(r["seed"], r["order"]) for runs in per_method.values() for r in runs})
    methods = {n: aggregate(r) for n, r in per_method.items()}
    config = {**first, "runs": pairs, "combined_from": [str(p) for p in paths],
              "command": " ".join(["python", *sys.argv])}  # fmt: skip
    return {
        "config": config,
        "targets": check_targets(methods, full=bool(first.get("full"))),
        "methods": methods,
    }


def stream_kwargs(args) -> dict:
    kw = dict(FULL if args.full or not args.quick else QUICK)
    for k in ("tasks", "train_per_intent", "test_per_intent", "heldout_per_class"):
        if getattr(args, k) is not None:
            kw[k] = getattr(args, k)
    return kw


def variants(specs: list[str]) -> dict[str, RoutedConfig]:
    """`--variant` specs -> {label: config}: each replaces fields of the routed-lora preset (values parsed as
    literals, strings as written)."""
    out = {}
    for spec in specs:
        fields = {k: _literal(v) for k, v in (kv.split("=", 1) for kv in spec.split(";"))}
        out[f"{METHOD}[{spec}]"] = dataclasses.replace(ROUTED[METHOD], **fields)
    return out


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def reused(spec: str | None, stream: dict, pairs: list[tuple[int, int]]) -> dict[str, dict]:
    """`--reuse FILE:M1,M2`: those methods' blocks from FILE, each marked `reused_from`; exits with one line
    when FILE is missing, another stream or other runs, or lacks a method."""
    if not spec:
        return {}
    path, _, names = spec.rpartition(":")
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise EcruError(
            f"--reuse: cannot read {path!r} ({exc}); give FILE:METHODS, e.g. results.json:zscl,zeroshot"
        ) from None
    config = old.get("config", {})
    if config.get("stream") != stream or [tuple(r) for r in config.get("runs", [])] != pairs:
        raise EcruError(f"--reuse: {path} holds another stream or other (seed, order) runs than this command")
    missing = [n for n in names.split(",") if n not in old.get("methods", {})]
    if missing or not names:
        raise EcruError(f"--reuse: {path} has no results for {missing or 'no method named'}")
    return {n: {**old["methods"][n], "reused_from": path} for n in names.split(",")}


def run_pairs(args) -> list[tuple[int, int]]:
    if args.runs:
        return [tuple(int(x) for x in r.split(":")) for r in args.runs.split(",")]
    return [(0, 0), (1, 1), (2, 2)] if args.full else [(0, 0)]


def _mean_known(values: list[float | None]) -> float | None:
    """The mean, or None when a run did not record the value (checkpoints older than the field)."""
    return None if any(v is None for v in values) else statistics.fmean(values)


def _block(runs: list[dict], key: str) -> tuple[dict, dict]:
    """Mean and population std over runs of the numeric entries of each run's `key` block."""
    names = [k for k, v in runs[0][key].items() if isinstance(v, int | float)]
    mean = {k: statistics.fmean(r[key][k] for r in runs) for k in names}
    std = {k: statistics.pstdev(r[key][k] for r in runs) for k in names}
    return mean, std


def aggregate(runs: list[dict]) -> dict:
    """Mean matrices, heldout and cost over runs; each protocol's metrics as mean and std (0 for one run)."""
    mean = lambda key: np.mean([r[key] for r in runs], axis=0).tolist()  # noqa: E731
    agnostic, agnostic_std = _block(runs, "agnostic")
    gated, gated_std = _block(runs, "gated")
    gated["by_construction"] = list(runs[0]["gated"].get("by_construction", []))
    metrics, metrics_std = _block(runs, "metrics")
    cost = {k: _mean_known([r["cost"].get(k) for r in runs]) for k in runs[0]["cost"]}
    return {"agnostic": agnostic, "agnostic_std": agnostic_std, "gated": gated, "gated_std": gated_std,
            "metrics": metrics, "metrics_std": metrics_std, "R_agnostic": mean("R_agnostic"),
            "R0_agnostic": mean("R0_agnostic"), "R": mean("R"), "R0": mean("R0"), "heldout": mean("heldout"),
            "heldout_agnostic": mean("heldout_agnostic"), "cost": cost, "runs": runs,
            **open_set_block(runs)}  # fmt: skip


def open_set_block(runs: list[dict]) -> dict:
    """{"open_set": the last task's out-of-scope metrics, mean over runs} when the runs measured them."""
    if not all(r.get("open_set") for r in runs):
        return {}
    last = [r["open_set"][-1] for r in runs]
    return {"open_set": {k: statistics.fmean(x[k] for x in last) for k in last[0] if k != "seen"}}


def print_open_set(methods: dict) -> None:
    rows = {n: m["open_set"] for n, m in methods.items() if "open_set" in m}
    if not rows:
        return
    keys = ("oos_recall", "oos_precision", "in_scope_accuracy", "in_scope_accuracy_no_abstention", "ece")
    print(f"\nout-of-scope (CLINC oos_test after the last task; threshold: the {OOS_RECALL:.0%} quantile of "
          "oos_val grades, every method: routed-lora's open-set grade, the others' probability)")  # fmt: skip
    print(f"{'method':<30}" + "".join(f"{k[:14]:>16}" for k in keys))
    for name, o in rows.items():
        print(f"{name:<30}" + "".join(f"{o[k]:>16.3f}" if k == "ece" else f"{o[k]:>16.1f}" for k in keys))


def _paired(methods: dict, a: str, b: str, fn) -> list[float]:
    """fn(run of a, run of b) for every (seed, order) both methods ran."""
    other = {(r["seed"], r["order"]): r for r in methods[b]["runs"]}
    return [
        fn(r, other[(r["seed"], r["order"])]) for r in methods[a]["runs"] if (r["seed"], r["order"]) in other
    ]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _target(values: list[float], threshold: float, ok, *, difference: bool) -> dict:
    """One target: the runs, their mean and std, whether the mean meets it, and whether it is met: the mean
    meets it over >= FULL_RUNS runs and, for a difference between methods, the mean exceeds twice the
    difference's sample std."""
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    out = {"mean": mean, "std": std, "runs": values, "threshold": threshold, "mean_meets": bool(ok(mean))}
    why = []
    if len(values) < FULL_RUNS:
        why.append(f"needs >= {FULL_RUNS} (seed, order) runs of the full configuration, got {len(values)}")
    elif difference and not abs(mean) > 2 * statistics.stdev(values):
        why.append(f"the difference {mean:.2f} is within 2 sample std ({statistics.stdev(values):.2f})")
    out["met"] = out["mean_meets"] and not why
    if why:
        out["why_not"] = "; ".join(why)
    return out


def check_targets(methods: dict, method: str = METHOD, *, full: bool = False) -> dict:
    """Issue 17's targets for `method` in the task-agnostic protocol, those whose methods ran. `full=False`
    (any other configuration than --full) never meets one: the targets are about the full configuration."""
    if method not in methods:
        return {}
    runs = methods[method]["runs"]
    out: dict[str, dict] = {}

    def add(name: str, values: list, threshold: float, ok, *, difference: bool = False) -> None:
        values = [v for v in values if v is not None]
        if values:
            out[name] = _target(values, threshold, ok, difference=difference)
            if not full:
                out[name]["met"] = False
                out[name]["why_not"] = "not the full configuration (--full)"

    for other, margin in (("ncm", 3.0), ("zscl", 2.0)):
        if other in methods:
            diff = _paired(methods, method, other, lambda a, b: a["agnostic"]["last"] - b["agnostic"]["last"])
            add(f"agnostic_last_minus_{other}", diff, margin, lambda m, t=margin: m >= t, difference=True)
            _not_same_run(out, f"agnostic_last_minus_{other}", methods[other])
    add(
        "agnostic_transfer_retention",
        [r["agnostic"]["transfer_retention"] for r in runs],
        -1.0,
        lambda m: m >= -1,
    )
    add("agnostic_heldout_change", [r["agnostic"]["heldout_change"] for r in runs], -1.0, lambda m: m >= -1)
    if "zscl" in methods:
        cpu = _paired(
            methods, method, "zscl", lambda a, b: _ratio(a["cost"].get("cpu_s"), b["cost"].get("cpu_s"))
        )
        add("cpu_over_zscl_cpu", cpu, 1 / 3, lambda m: m <= 1 / 3)
        _not_same_run(out, "cpu_over_zscl_cpu", methods["zscl"])
    adapter = [_ratio(r["cost"]["stored_bytes_per_task"], 4 * r["cost"]["trainable_params"]) for r in runs]
    add("stored_bytes_per_task_over_adapter_bytes", adapter, 2.0, lambda m: m <= 2)
    return out


def _not_same_run(targets: dict, name: str, baseline: dict) -> None:
    """A target against a baseline copied from an earlier file (`--reuse`) is reported, never met."""
    if name in targets and "reused_from" in baseline:
        why = f"baseline reused from {baseline['reused_from']}, not measured in this run"
        targets[name] |= {
            "met": False,
            "why_not": "; ".join(filter(None, [targets[name].get("why_not"), why])),
        }


def print_targets(targets: dict) -> None:
    for name, t in targets.items():
        runs = ", ".join(f"{v:.2f}" for v in t["runs"])
        why = f" ({t['why_not']})" if "why_not" in t else ""
        print(f"{name:<42} {t['mean']:8.3f} ± {t['std']:.3f} (runs {runs}; bound {t['threshold']:.3g}; "
              f"mean {'meets' if t['mean_meets'] else 'misses'} it) {'met' if t['met'] else 'NOT met'}{why}")  # fmt: skip


def plot_heatmaps(methods: dict, path: Path) -> str:
    names = list(methods)
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, _ = new_figure(width=3.2 * cols, height=2.9 * rows, ncols=cols)
    fig.clear()
    grid = fig.subplots(rows, cols, squeeze=False)
    for ax, name in zip(grid.flat, names, strict=False):
        R = np.array(methods[name]["R_agnostic"])
        im = ax.imshow(R, vmin=40, vmax=100, cmap="viridis")
        ticks = range(R.shape[0])
        ax.set(title=f"{name}: last {methods[name]['agnostic']['last']:.1f}", xlabel="task", ylabel="after task",
               xticks=ticks, yticks=ticks, xticklabels=[t + 1 for t in ticks], yticklabels=[t + 1 for t in ticks])  # fmt: skip
        for (i, j), v in np.ndenumerate(R):
            if R.shape[0] <= 5:
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7, color="w")
    for ax in list(grid.flat)[len(names) :]:
        ax.axis("off")
    fig.colorbar(im, ax=grid, shrink=0.6, label="task-agnostic accuracy %")
    return save(fig, path)


def plot_cost(methods: dict, path: Path) -> str:
    fig, (ax1, ax2) = new_figure(width=10, height=4, ncols=2)
    for ax, key in ((ax1, "transfer_retention"), (ax2, "last")):
        styles = iter([("grey", "--"), ("black", ":"), ("brown", "-.")] * 4)
        for name, m in methods.items():
            if m["cost"]["trainable_params"] == 0:  # training-free: a reference line
                color, ls = next(styles)
                ax.axhline(m["agnostic"][key], color=color, ls=ls, lw=1.0, label=name)
                continue
            x, y = m["cost"]["wall_s"], m["agnostic"][key]
            ax.scatter(x, y, s=15 + 10 * np.log10(m["cost"]["trainable_params"]))
            ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xscale="log", xlabel="training wall s per task (log; marker size ~ log trainable params)")
        if ax.get_legend_handles_labels()[0]:  # reference lines drawn (none when only trained methods ran)
            ax.legend(fontsize=7, loc="lower right")
    ax1.set(ylabel="transfer retention (points)", title="task-agnostic zero-shot transfer kept vs cost")
    ax2.set(ylabel="last (%)", title="task-agnostic final accuracy vs cost")
    return save(fig, path)


def print_table(methods: dict) -> None:
    head = "".join(f"{k[:10]:>12}" for k in KEYS)
    print(f"\n{'':<30}{'task-agnostic (headline)':^60}{'label-gated':^24}")
    print(f"{'method':<30}{head}{'last+B77':>12}{'last':>12}{'bwt':>12}{'params':>11}{'cpu s/task':>11}"
          f"{'B/task':>12}")  # fmt: skip
    for name, m in methods.items():
        a, s_ = m["agnostic"], m["agnostic_std"]
        vals = "".join(f"{a[k]:>7.1f}±{s_[k]:<4.1f}" for k in KEYS)
        dis = a.get("last_with_heldout_labels")
        vals += f"{'-':>12}" if dis is None else f"{dis:>7.1f}±{s_['last_with_heldout_labels']:<4.1f}"
        g, c = m["gated"], m["cost"]
        cpu = "-" if c.get("cpu_s") is None else f"{c['cpu_s']:.1f}"
        print(f"{name:<30}{vals}{g['last']:>12.1f}{g['bwt']:>12.1f}{c['trainable_params']:>11.0f}{cpu:>11}"
              f"{c['stored_bytes_per_task']:>12.3g}")  # fmt: skip
    print(
        "last+B77: task-agnostic Last with Banking77's 77 labels added as candidates (what sending texts to"
    )
    print("  labels no task taught costs the learned tasks)")
    print("label-gated transfer retention and Banking77 change: 0 for every method, by construction")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        out = json.loads(args.json.read_text())
        methods = {ALIASES.get(n, n): m for n, m in out["methods"].items()}  # files from before the renames
        if not all("agnostic" in m for m in methods.values()):
            raise EcruError(
                f"{args.json} predates the task-agnostic protocol (no 'agnostic' blocks); run the benchmark again"
            )
        print_table(methods)
        print_targets(check_targets(methods, full=out["config"].get("full", False)))
        print("wrote", *plot_all(methods, args.json))
        return 0
    if args.combine:
        out = combine(args.combine)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, out)
        print_table(out["methods"])
        print_targets(out["targets"])
        print("wrote", args.json, *plot_all(out["methods"], args.json))
        return 0
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    names = [n.strip() for n in args.methods.split(",")]
    names = [ALIASES.get(n, n) for n in names]
    unknown = set(names) - set(METHODS)
    if unknown:
        raise EcruError(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    kw, start = {**stream_kwargs(args), "split": args.split}, time.perf_counter()
    args.reused = reused(args.reuse, kw, run_pairs(args))
    names = [n for n in names if n not in args.reused]
    batch = args.batch_size or (16 if args.quick else 32)
    runs = {n: (n, None) for n in names} | {
        label: (METHOD, cfg) for label, cfg in variants(args.variant).items()
    }
    per_method: dict[str, list[dict]] = {label: [] for label in runs}
    for seed, order in run_pairs(args):
        exp = Experiment(StreamConfig(**kw, order=order, seed=seed),
                         log=lambda s: print(s, file=sys.stderr, flush=True),
                         open_set_scale=args.scale if args.open_set else None)  # fmt: skip
        train = train_config(args, batch, seed)
        for label, (name, cfg) in runs.items():
            ckpt = None if args.checkpoint_dir is None else args.checkpoint_dir / f"{label}-s{seed}-o{order}"
            res = exp.run(name, train, checkpoint_dir=ckpt, config=cfg).to_json()
            if (
                args.open_set
            ):  # one dict per task learned in this run (not for tasks resumed from a checkpoint)
                res["open_set"] = exp.evaluator.take_open_set()
            per_method[label].append({"seed": seed, "order": order, **res})
            write_json(args, kw, batch, start, {n: r for n, r in per_method.items() if r}, partial=True)
    out = write_json(args, kw, batch, start, per_method, partial=False)
    methods = out["methods"]
    plots = plot_all(methods, args.json)
    print_table(methods)
    print_open_set(methods)
    print(f"\ntargets for {METHOD} (issue 17; task-agnostic):")
    print_targets(out["targets"])
    print(f"\nwrote {args.json} and {', '.join(plots)} in {time.perf_counter() - start:.0f} s")
    return 0


def train_config(args, batch: int, seed: int) -> TrainConfig:
    """The training settings shared by every method of a run (validated by TrainConfig)."""
    return TrainConfig(epochs=args.epochs, batch_size=batch, lr=args.lr, scale=args.scale,
                       label_smoothing=args.label_smoothing, seed=seed)  # fmt: skip


def plot_all(methods: dict, json_path: Path) -> list[str]:
    stem = json_path.with_suffix("")
    return [plot_heatmaps(methods, stem.with_name(stem.name + "_R.png")),
            plot_cost(methods, stem.with_name(stem.name + "_cost.png"))]  # fmt: skip


def write_json(args, kw: dict, batch: int, start: float, per_method: dict, *, partial: bool) -> dict:
    """Write the results so far (after every method: a long run killed mid-way keeps what it measured); returns
    what was written."""
    methods = {n: aggregate(r) for n, r in per_method.items()} | args.reused
    config = {"stream": kw, "runs": run_pairs(args), "epochs": args.epochs, "batch_size": batch,
              "lr": args.lr, "label_smoothing": args.label_smoothing, "scale": args.scale,
              "threads": torch.get_num_threads(), "command": " ".join(["python", *sys.argv]),
              "total_wall_s": time.perf_counter() - start, "units": "percent", "partial": partial,
              "full": bool(args.full), "cpu_s_process": time.process_time()}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    out = {"config": config, "targets": check_targets(methods, full=bool(args.full)), "methods": methods}
    atomic_write_json(args.json, out)
    return out


if __name__ == "__main__":
    sys.exit(run_main(main))
