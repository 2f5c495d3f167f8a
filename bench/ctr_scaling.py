"""Large-batch CTR scaling on synthetic Criteo-shaped data with a known optimum (ecru's CowClip pillar).

Every recipe trains DeepFM on the same data and seed at the 1K base batch and at large batches, in the
faithful full-table mode and (for the CowClip and tempered recipes) the row-sparse mode; the teacher FM gives
the oracle AUC/logloss, so each run's gap to the optimum is known. Also times row-sparse vs faithful
updates at 1K (alternating repetitions, median).

    python bench/ctr_scaling.py --quick --json bench/results/ctr_quick.json   # ~10 min on 2 CPU cores
    python bench/ctr_scaling.py --full --sparse-only --recipes linear,cowclip,tempered --json bench/results/ctr_full.json
                                                               # ~1-2 h: >= 1,000 steps at 32K
    python bench/ctr_scaling.py --time-to-auc --json bench/results/ctr_time_to_auc.json  # ~20 min

--time-to-auc: the wall time (training seconds, test evaluations excluded) each batch size (1K, 8K, 32K) and
recipe takes to reach the 1K reference's final test AUC minus 0.001, on 1 process and on 2 (torchrun, gloo,
1 thread each), with the steps it took: the paper's claim in its unit. Every run is its own process (or
torchrun's two) on the same arrays; the test rows are evaluated every 1/8 epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ecru.cliargs import ArgumentParser, existing_file, int_list, positive_int, prepare_out_file, run_main
from ecru.cowclip import RECIPES, scaled_recipe
from ecru.ctr import CTRData, SyntheticConfig, TrainConfig, generate, train
from ecru.ctr.synthetic import realised_oracle
from ecru.errors import EcruError
from ecru.io import atomic_write_json, atomic_write_text, load_tensors, save_tensors

BOTH_MODES = ("cowclip", "tempered")  # the other baselines run in the faithful mode only


@dataclass(frozen=True)
class Setting:
    """One benchmark size."""

    rows: int
    """Synthetic rows (train + test)."""
    test_fraction: float
    """Held-out share (random split)."""
    scale: float
    """Cardinalities are Criteo's x this."""
    zipf: float
    """Zipf exponent of the ids (lower: heavier tail, more rare ids)."""
    mlp: tuple[int, ...]
    """DeepFM's hidden widths."""
    epochs: int
    """Epochs of every run (the 1K reference trains on the same samples)."""
    batches: tuple[int, ...]
    """Batch sizes; the first is the base (1K)."""
    timing_steps: int
    """Steps per repetition of the row-sparse vs faithful timing at the base batch."""


QUICK = Setting(
    rows=1_200_000,
    test_fraction=1 / 6,
    scale=1e-2,
    zipf=1.1,
    mlp=(128, 128, 128),
    epochs=1,
    batches=(1024, 32768),
    timing_steps=100,
)
# >= 1,000 steps at 32K (11M train rows x 3 epochs / 32K = 1,007) and the 1K reference on the same samples.
# 8.4M ids (Criteo's cardinalities x 0.25) under a flat Zipf: 4.4M distinct ids in the 11M training rows (0.40 per
# row, 47.5% of them seen once; measured), a heavy tail of rare ids like Criteo's (33.8M ids in 45.8M rows). Tables that large make the faithful full-table update O(table) per
# step (days at 1K on 2 CPU cores), so the full regime runs every recipe in the row-sparse mode
# (--sparse-only); the faithful-vs-sparse difference itself is measured by --quick.
FULL = Setting(
    rows=12_000_000,
    test_fraction=1 / 12,
    scale=2.5e-1,
    zipf=1.05,
    mlp=(128, 128, 128),
    epochs=3,
    batches=(1024, 32768),
    timing_steps=300,
)


# time to AUC: the quick data (1M training rows), 1K for one epoch as the reference, 8K and 32K for up to
# 3 epochs (3x the samples: large batches may need more passes to reach 1K's AUC)
TIME_TO_AUC = replace(QUICK, batches=(1024, 8192, 32768), epochs=1)
TTA_RECIPES, TTA_MAX_EPOCHS, TTA_MARGIN, TTA_EVALS_PER_EPOCH = ("tempered", "cowclip"), 3, 1e-3, 8


def save_arrays(folder: Path, parts: dict[str, CTRData]) -> None:
    """The splits as one safetensors file (ecru.io) every run reads."""
    tensors = {f"{n}_{k}": getattr(p, k) for n, p in parts.items() for k in ("dense", "cats", "labels")}
    save_tensors(
        folder / "arrays.safetensors", tensors, {"cardinalities": json.dumps(parts["train"].cardinalities)}
    )


def load_arrays(folder: Path) -> tuple[CTRData, CTRData]:
    tensors, meta = load_tensors(folder / "arrays.safetensors")
    cards = tuple(json.loads(meta["cardinalities"]))
    return tuple(
        CTRData(*(tensors[f"{n}_{k}"] for k in ("dense", "cats", "labels")), cards) for n in ("train", "test")
    )


def tta_worker(args: argparse.Namespace) -> int:
    """One time-to-AUC run (rank 0 writes its JSON); under torchrun, data parallel over gloo."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    tr, te = load_arrays(Path(args.arrays))
    cfg = TrainConfig(
        batch_size=args.batch,
        epochs=args.epochs,
        recipe=args.recipe,
        mlp=TIME_TO_AUC.mlp,
        base_batch=args.base_batch,
        eval_every=max(1, len(tr) // args.batch // TTA_EVALS_PER_EPOCH),
        target_auc=args.target,
        seed=args.seed,
        progress=False,
    )
    res = train(cfg, tr, te)
    if not dist.is_initialized() or dist.get_rank() == 0:
        out = {"steps": res.steps, "final_auc": res.auc, "train_s": res.wall_s, "curve": res.curve}
        atomic_write_json(args.out, {**out, "eval_every_steps": cfg.eval_every})
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def tta_launch(
    folder: Path,
    procs: int,
    batches: tuple[int, ...],
    batch: int,
    recipe: str,
    target: float | None,
    seed: int,
) -> dict:
    """Run one (processes, batch, recipe) in its own process(es); its JSON with the wall clock around it."""
    out = folder / f"run_{procs}_{batch}_{recipe}.json"
    head = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run"]
    head += [] if procs == 1 else ["--standalone", f"--nproc-per-node={procs}"]
    cmd = [*head, __file__, "--tta-worker", "--arrays", str(folder), "--out", str(out)]
    epochs = TIME_TO_AUC.epochs if batch == batches[0] else TTA_MAX_EPOCHS
    cmd += ["--batch", str(batch), "--base-batch", str(batches[0]), "--epochs", str(epochs)]
    cmd += ["--recipe", recipe, "--seed", str(seed)]
    cmd += ["--target", str(target)] if target is not None else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    load_before, start = os.getloadavg()[0], time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    run = json.loads(out.read_text())
    return {
        **run,
        "process_wall_s": time.perf_counter() - start,
        "load_avg_1min_before": load_before,
        "load_avg_1min_after": os.getloadavg()[0],
    }


def first_reaching(curve: list[dict], target: float) -> dict | None:
    """The first evaluation at or above `target` (None: never reached)."""
    return next((p for p in curve if p["auc"] >= target), None)


def time_to_auc(args: argparse.Namespace) -> int:
    setting, start = replace(TIME_TO_AUC, rows=args.rows or TIME_TO_AUC.rows), time.perf_counter()
    if args.batches:
        setting = replace(setting, batches=args.batches)
    data = generate(
        SyntheticConfig(n_rows=setting.rows, scale=setting.scale, zipf=setting.zipf, seed=args.seed)
    )
    parts = dict(
        zip(("train", "test"), data.split_random(setting.test_fraction, seed=args.seed), strict=True)
    )
    base, rows = setting.batches[0], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_arrays(folder, parts)
        ref = tta_launch(folder, 1, setting.batches, base, TTA_RECIPES[0], None, args.seed)  # no target
        target = ref["final_auc"] - TTA_MARGIN
        for procs in (1, 2):
            for batch in setting.batches:
                for recipe in TTA_RECIPES:
                    same = (procs, batch, recipe) == (1, base, TTA_RECIPES[0])
                    run = (
                        ref
                        if same
                        else tta_launch(folder, procs, setting.batches, batch, recipe, target, args.seed)
                    )
                    rows.append(tta_row(procs, batch, recipe, run, target))
                    print(tta_line(rows[-1]), file=sys.stderr, flush=True)
    out = tta_summary(args, setting, parts, ref, target, rows, time.perf_counter() - start)
    atomic_write_text(args.json, json.dumps(out, indent=2))
    print_tta_table(rows, target)
    return 0


def tta_row(procs: int, batch: int, recipe: str, run: dict, target: float) -> dict:
    hit = first_reaching(run["curve"], target)
    return {
        "processes": procs,
        "batch_size": batch,
        "recipe": recipe,
        "reached_target": hit is not None,
        "seconds_to_target": hit["train_s"] if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "samples_to_target": hit["step"] * batch if hit else None,
        "best_auc": max(p["auc"] for p in run["curve"]),
        "steps_run": run["steps"],
        "train_s": run["train_s"],
        "eval_every_steps": run["eval_every_steps"],
        "process_wall_s": run["process_wall_s"],
        "load_avg_1min_before": run["load_avg_1min_before"],
        "load_avg_1min_after": run["load_avg_1min_after"],
        "curve": run["curve"],
    }


def tta_line(r: dict) -> str:
    reached = (
        f"{r['seconds_to_target']:7.1f} s, {r['steps_to_target']:5d} steps"
        if r["reached_target"]
        else f"not reached in {r['steps_run']} steps (best AUC {r['best_auc']:.5f})"
    )
    return f"{r['processes']} proc b={r['batch_size']:>6} {r['recipe']:>9}: {reached}"


def tta_summary(args, setting, parts, ref, target, rows, wall) -> dict:
    base = next(r for r in rows if (r["processes"], r["batch_size"]) == (1, setting.batches[0]))
    speedups = {
        f"{r['processes']}proc_{r['batch_size']}_{r['recipe']}": base["seconds_to_target"]
        / r["seconds_to_target"]
        for r in rows
        if r["reached_target"]
    }
    return {
        "command": " ".join(["python", "bench/ctr_scaling.py", *sys.argv[1:]]),
        "setting": {
            **asdict(setting),
            "recipes": TTA_RECIPES,
            "large_batch_max_epochs": TTA_MAX_EPOCHS,
            "evaluations_per_epoch": TTA_EVALS_PER_EPOCH,
            "threads_per_process": 1,
            "distributed": "torchrun --standalone, gloo, the global batch split evenly over the ranks",
        },
        "data": {"train_rows": len(parts["train"]), "test_rows": len(parts["test"])},
        "reference_1k_final_auc": ref["final_auc"],
        "target_auc": target,
        "target_rule": "the 1K reference's (1 process, tempered = the base settings at 1K) final AUC - 0.001",
        "host": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "runs": rows,
        "speedup_to_target_vs_1k_1proc": speedups,
        "total_wall_s": wall,
    }


def print_tta_table(rows: list[dict], target: float) -> None:
    print(
        f"\ntarget AUC {target:.5f}\n{'procs':>5} {'batch':>6} {'recipe':>9} {'seconds':>8} {'steps':>6}  best AUC"
    )
    for r in rows:
        sec = f"{r['seconds_to_target']:8.1f}" if r["reached_target"] else f"{'-':>8}"
        steps = f"{r['steps_to_target']:6d}" if r["reached_target"] else f"{'-':>6}"
        print(f"{r['processes']:>5} {r['batch_size']:>6} {r['recipe']:>9} {sec} {steps}  {r['best_auc']:.5f}")


def run_one(
    setting: Setting,
    data,
    recipe_name: str,
    mode: str,
    batch: int,
    oracle: tuple[float, float],
    *,
    seed: int = 0,
) -> dict:
    train_data, test_data = data
    recipe = scaled_recipe(recipe_name, batch, base_batch=setting.batches[0])
    cfg = TrainConfig(
        batch_size=batch,
        epochs=setting.epochs,
        recipe=recipe_name,
        mode=mode,
        mlp=setting.mlp,
        base_batch=setting.batches[0],
        seed=seed,
        progress=True,
    )
    res = train(cfg, train_data, test_data, recipe=recipe)
    row = {
        "recipe": recipe_name,
        "mode": mode,
        "batch_size": batch,
        "epochs": setting.epochs,
        "steps": res.steps,
        "auc": res.auc,
        "logloss": res.logloss,
        "oracle_auc": oracle[0],
        "oracle_logloss": oracle[1],
        "samples_per_s": res.samples_per_s,
        "wall_s": res.wall_s,
        "clipped_fraction": res.clip.clipped_fraction,
        "threads": torch.get_num_threads(),
        "clipped_rows": res.clip.clipped,
        "seen_rows": res.clip.rows,
        "clip_ratio_quantiles": res.clip.ratio_quantiles,
        "clip_active": recipe.clip,
        "settings": asdict(recipe),
        "first_losses": res.losses[:5],
        "history": res.history,
    }
    print(
        f"{recipe_name:>9} {mode:>6} b={batch:>6}: AUC {res.auc:.5f} (oracle {oracle[0]:.5f}) logloss {res.logloss:.5f} "
        f"{res.steps} steps {res.samples_per_s:>9,.0f}/s clipped {res.clip.clipped_fraction:.3%} "
        f"max ||g||/thr {res.clip.ratio_quantiles['max']:.3g}",
        file=sys.stderr,
        flush=True,
    )
    return row


def plan(
    setting: Setting, recipes: tuple[str, ...] = RECIPES, *, sparse: bool = True, sparse_only: bool = False
) -> list[tuple[str, str, int]]:
    """(recipe, mode, batch) runs; at the base batch the scaling rules coincide, so identical settings run once."""
    if sparse_only:  # every run row-sparse: the 1K reference, then the recipes at the large batches
        base, *large = setting.batches
        return [("adam", "sparse", base), *((n, "sparse", b) for b in large for n in recipes)]
    runs = []
    for batch in setting.batches:
        for name in recipes:
            for mode in ("full", "sparse") if name in BOTH_MODES and sparse else ("full",):
                runs.append((name, mode, batch))
    if "adam" not in recipes:  # the 1K reference every gap is measured against
        runs.insert(0, ("adam", "full", setting.batches[0]))
    # the row-sparse 1K reference first
    return [("adam", "sparse", setting.batches[0]), *runs] if sparse else runs


def time_modes(setting: Setting, data, reps: int = 5) -> dict:
    """Samples/s of faithful vs row-sparse CowClip at the base batch: alternating repetitions, medians."""
    batch = setting.batches[0]
    subset = data[0].subset(slice(0, batch * setting.timing_steps))
    speed = {"full": [], "sparse": []}
    for _ in range(reps):
        for mode in ("full", "sparse"):
            cfg = TrainConfig(
                batch_size=batch,
                recipe="cowclip",
                mode=mode,
                mlp=setting.mlp,
                progress=False,
                base_batch=batch,
                eval_batch=65536,
            )
            speed[mode].append(train(cfg, subset, data[1].subset(slice(0, 20000))).samples_per_s)
    med = {m: statistics.median(v) for m, v in speed.items()}
    return {
        "batch_size": batch,
        "steps_per_rep": setting.timing_steps,
        "reps": reps,
        "samples_per_s": speed,
        "median_full": med["full"],
        "median_sparse": med["sparse"],
        "speedup": med["sparse"] / med["full"],
    }


def targets(runs: list[dict], timing: dict | None, base: int, big: int) -> dict:
    if timing is None:  # a partial plan (--recipes / --no-sparse / --sparse-only)
        return partial_targets(runs, base)

    def find(recipe, mode, batch):
        return next(r for r in runs if (r["recipe"], r["mode"], r["batch_size"]) == (recipe, mode, batch))

    ref = find("adam", "full", base)["auc"]
    best_tempered = max(find("tempered", m, big)["auc"] for m in ("full", "sparse"))
    best_cowclip = max(find("cowclip", m, big)["auc"] for m in ("full", "sparse"))
    cc_full, cc_sparse = find("cowclip", "full", base), find("cowclip", "sparse", base)
    return {
        "reference_1k_auc": ref,
        "large_batch": big,
        "tempered_gap_to_1k": ref - best_tempered,
        "tempered_within_0.005": ref - best_tempered <= 0.005,
        "cowclip_gap_to_1k": ref - best_cowclip,
        "tempered_beats_cowclip": best_tempered > best_cowclip,
        "sparse_vs_full_speedup_1k": timing["speedup"],
        "sparse_speedup_ge_1.2": timing["speedup"] >= 1.2,
        "sparse_vs_full_auc_diff_1k": cc_sparse["auc"] - cc_full["auc"],
        "sparse_auc_within_0.001": abs(cc_sparse["auc"] - cc_full["auc"]) <= 0.001,
        "clip_fired_at_large_batch": any(
            r["clipped_rows"] for r in runs if r["batch_size"] == big and r["clip_active"]
        ),
    }


def partial_targets(runs: list[dict], base: int) -> dict:
    """Gaps to the 1K reference after the last epoch and at each run's best epoch (several epochs can
    overfit: the best epoch shows what early stopping would keep), and whether the clip fired."""
    ref_run = next(r for r in runs if r["batch_size"] == base and r["recipe"] == "adam")
    ref, ref_best = ref_run["auc"], max(h["auc"] for h in ref_run["history"])
    out = {"reference_1k_auc": ref, "reference_1k_best_epoch_auc": ref_best}
    for r in runs:
        name = f"{r['recipe']}_{r['mode']}_{r['batch_size']}"
        out[f"{name}_gap_to_1k"] = ref - r["auc"]
        out[f"{name}_best_epoch_gap_to_1k_best"] = ref_best - max(h["auc"] for h in r["history"])
    large_clip = [r for r in runs if r["batch_size"] > base and r["clip_active"]]
    if large_clip:
        clipped, seen = sum(r["clipped_rows"] for r in large_clip), sum(r["seen_rows"] for r in large_clip)
        out["clip_fired_at_large_batch"] = clipped > 0
        out["clipped_fraction_at_large_batch"] = clipped / max(seen, 1)
    for r in runs:
        if r["recipe"] == "cowclip" and r["batch_size"] >= 32 * base:
            out[f"cowclip_{r['mode']}_{r['batch_size']}_within_0.001"] = ref - r["auc"] <= 0.001
    return out


def print_table(runs: list[dict], summary: dict) -> None:
    print(
        f"\n{'recipe':>9} {'mode':>6} {'batch':>6} {'steps':>6} {'AUC':>8} {'gap1K':>8} {'gapOr':>8} "
        f"{'samples/s':>10} {'clipped':>8}  AUC per epoch"
    )
    ref = summary["reference_1k_auc"]
    for r in runs:
        epochs = " ".join(f"{h['auc']:.5f}" for h in r["history"])
        print(
            f"{r['recipe']:>9} {r['mode']:>6} {r['batch_size']:>6} {r['steps']:>6} {r['auc']:>8.5f} "
            f"{ref - r['auc']:>8.5f} {r['oracle_auc'] - r['auc']:>8.5f} {r['samples_per_s']:>10,.0f} "
            f"{r['clipped_fraction']:>8.3%}  {epochs}"
        )
    print(json.dumps(summary, indent=2))


def summarize(path: Path, plot_path: Path | None, note: str | None) -> int:
    """Recompute the targets, table and plot of a finished run's JSON from its recorded runs (no training);
    `note` (the diagnosis, in words) is stored beside them."""
    try:
        out = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EcruError(
            f"--summarize {path}: not a JSON file ({exc}); give the JSON a run of this script wrote"
        ) from None
    for run in out["runs"]:  # results recorded before the tempered recipe was renamed from "ecru"
        run["recipe"] = {"ecru": "tempered"}.get(run["recipe"], run["recipe"])
    base, *large = out["setting"]["batches"]
    out["targets"] = targets(out["runs"], out["timing_1k"], base, large[0])
    if note:
        out["note"] = note
    atomic_write_json(path, out)
    full = out["command"].split().count("--full") > 0
    plot(
        out["runs"],
        plot_path or path.with_suffix(".png"),
        f"DeepFM, {'full' if full else 'quick'}: gap to the oracle",
    )
    print_table(out["runs"], out["targets"])
    return 0


def plot(runs: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for recipe, mode in dict.fromkeys((r["recipe"], r["mode"]) for r in runs):
        pts = sorted(
            (r["batch_size"], r["oracle_auc"] - r["auc"])
            for r in runs
            if (r["recipe"], r["mode"]) == (recipe, mode)
        )
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            label=f"{recipe} ({mode})",
            linestyle="-" if mode == "full" else "--",
        )
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="oracle AUC - test AUC", title=title)
    ax.set_xticks(
        sorted({r["batch_size"] for r in runs}),
        [f"{b // 1024}K" for b in sorted({r["batch_size"] for r in runs})],
    )
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="1K vs 32K, one epoch, 1M train rows (default)")
    size.add_argument(
        "--full", action="store_true", help=">= 1,000 steps at 32K, 1K on the same samples (hours)"
    )
    p.add_argument(
        "--json",
        default=None,
        help="default: bench/results/ctr_quick.json (ctr_time_to_auc.json with --time-to-auc)",
    )
    p.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (recorded in every run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=positive_int, default=None, help="override the setting's epochs")
    p.add_argument(
        "--recipes", default=",".join(RECIPES), help="comma-separated subset (adam always included)"
    )
    modes = p.add_mutually_exclusive_group()
    modes.add_argument(
        "--no-sparse", action="store_true", help="faithful mode only, no row-sparse runs or timing"
    )
    modes.add_argument(
        "--sparse-only", action="store_true", help="row-sparse mode only (the 1K reference too), no timing"
    )
    p.add_argument(
        "--summarize",
        metavar="JSON",
        type=existing_file,
        help="recompute the targets, table and plot of a finished run's JSON (no training); see --note",
    )
    p.add_argument("--note", help="with --summarize: the diagnosis, in words, stored as the JSON's 'note'")
    p.add_argument(
        "--time-to-auc",
        action="store_true",
        help="seconds and steps to 1K's final AUC - 0.001 per batch (1K, 8K, 32K) and recipe, on 1 and 2 processes",
    )
    p.add_argument(
        "--rows", type=positive_int, default=None, help="--time-to-auc: synthetic rows (default 1.2M)"
    )
    p.add_argument(
        "--batches",
        type=int_list,
        default=None,
        help="--time-to-auc: batch sizes, the base first (1024,8192,32768)",
    )
    p.add_argument("--tta-worker", action="store_true", help=argparse.SUPPRESS)
    for flag, kind in (("--arrays", str), ("--out", str), ("--recipe", str), ("--target", float)):
        p.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    for flag in ("--batch", "--base-batch"):
        p.add_argument(flag, type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tta_worker:
        return tta_worker(args)
    if args.time_to_auc:
        args.json = prepare_out_file(args.json or "bench/results/ctr_time_to_auc.json", flag="--json")
        return time_to_auc(args)
    if args.summarize:
        return summarize(args.summarize, Path(args.plot) if args.plot else None, args.note)
    args.json = prepare_out_file(args.json or "bench/results/ctr_quick.json", flag="--json")
    if args.plot:
        prepare_out_file(args.plot, flag="--plot")
    torch.set_num_threads(args.threads)
    setting = FULL if args.full else QUICK
    if args.epochs:
        setting = replace(setting, epochs=args.epochs)
    recipes = tuple(dict.fromkeys(args.recipes.split(",")))
    if set(recipes) - set(RECIPES):
        p.error(f"--recipes: choose from {','.join(RECIPES)}")
    complete = set(recipes) == set(RECIPES) and not (args.no_sparse or args.sparse_only)
    start = time.perf_counter()
    data = generate(
        SyntheticConfig(n_rows=setting.rows, scale=setting.scale, zipf=setting.zipf, seed=args.seed)
    )
    train_data, test_data = data.split_random(setting.test_fraction, seed=args.seed)
    oracle = realised_oracle(test_data)
    print(
        f"data: {len(train_data):,} train / {len(test_data):,} test rows, {sum(data.cardinalities):,} ids, "
        f"oracle AUC {oracle[0]:.5f} logloss {oracle[1]:.5f}",
        file=sys.stderr,
        flush=True,
    )
    runs, done = [], {}
    for name, mode, batch in plan(setting, recipes, sparse=not args.no_sparse, sparse_only=args.sparse_only):
        key = (
            mode,
            *(
                v
                for k, v in asdict(scaled_recipe(name, batch, base_batch=setting.batches[0])).items()
                if k != "name"
            ),
        )
        if key in done:  # e.g. every rule is the plain 1K recipe at s = 1: identical run, not repeated
            runs.append({**done[key], "recipe": name, "same_run_as": done[key]["recipe"]})
            continue
        runs.append(run_one(setting, (train_data, test_data), name, mode, batch, oracle, seed=args.seed))
        done[key] = runs[-1]
    timing = time_modes(setting, (train_data, test_data)) if complete else None
    summary = targets(runs, timing, setting.batches[0], setting.batches[1])
    out = {
        "command": " ".join(
            ["python", "bench/ctr_scaling.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "setting": asdict(setting),
        "data": {
            "train_rows": len(train_data),
            "test_rows": len(test_data),
            "ids": sum(data.cardinalities),
            "oracle_auc": oracle[0],
            "oracle_logloss": oracle[1],
        },
        "host": {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads},
        "runs": runs,
        "timing_1k": timing,
        "targets": summary,
        "total_wall_s": time.perf_counter() - start,
    }
    atomic_write_text(args.json, json.dumps(out, indent=2))
    plot(
        runs,
        Path(args.plot or Path(args.json).with_suffix(".png")),
        f"DeepFM, {'full' if args.full else 'quick'}: gap to the oracle",
    )
    print_table(runs, summary)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
