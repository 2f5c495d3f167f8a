"""The decisive CowClip experiment: which part of CowClip carries large-batch CTR training, and is the large
batch lossless? Faithful full-table mode everywhere (every row gets its L2 decay through Adam every step).

On synthetic Criteo-shaped data with a known optimum, DeepFM trains at the base batch with the CowClip
settings (the reference), and at s x the base batch with, one knob at a time:

    cowclip          the paper's rules: embedding LR fixed, dense LR x sqrt(s), L2 x s, the per-id clip
    no-clip          the same rules without the clip
    init-1e-4        the rules with embeddings initialised at std 1e-4 instead of 1e-2
    l2-unscaled      the rules with L2 left at the base value instead of x s
    embed-lr-sqrt    the rules with the embedding LR x sqrt(s) instead of fixed
    summed-loss      the rules on the batch's summed loss (L2 x batch: the same objective), where the clip,
                     whose threshold does not scale with the loss, fires

each over the same seeds (data, teacher, init, batch order). The verdict: each variant's mean gap to the
reference (and its spread over seeds), the large-batch step count, and the fraction of rows clipped.

    python bench/experiments/ctr_decisive.py --quick --json bench/results/ctr_decisive_quick.json    # ~5-8 min, 2 CPU cores
    nohup nice python bench/experiments/ctr_decisive.py --setting cpu --resume --json bench/results/ctr_decisive.json &
        # the run made: 3,000 steps at 32K (98M samples per run, the 1K reference 96,090 steps) on a reduced
        # table and model, ~8 min of one core per 1K reference and ~2-3 min per 32K run; the JSON is rewritten
        # after every run and --resume continues from it
    python bench/experiments/ctr_decisive.py --setting full --device cuda --json ...   # Criteo-sized: meant for a GPU
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ecru.cowclip import Recipe, cowclip_recipe
from ecru.ctr import SyntheticConfig, TrainConfig, generate, train
from ecru.ctr.synthetic import realised_oracle
from ecru.io import atomic_write_json


@dataclass(frozen=True)
class Setting:
    """One size of the experiment."""

    rows: int
    """Synthetic rows (train + test)."""
    test_fraction: float
    """Held-out share (random split)."""
    scale: float
    """Cardinalities are Criteo's x this (a reduced table keeps the faithful full-table update affordable)."""
    mlp: tuple[int, ...]
    """DeepFM's hidden widths."""
    epochs: int
    """Epochs of every run (the reference sees the same samples)."""
    base: int
    """The base batch (the reference)."""
    large: int
    """The large batch."""
    seeds: tuple[int, ...]
    """Seeds of data, teacher, init and batch order (the reference, CowClip and no-clip run on each)."""
    fields: int = 26
    """Categorical fields (the first `fields` of Criteo's 26)."""
    embed_dim: int = 10
    """Embedding dimension."""


QUICK = Setting(
    rows=150_000, test_fraction=0.1, scale=1e-3, mlp=(64, 64), epochs=2, base=128, large=4096, seeds=(0, 1, 2)
)
# The run made on CPU (~55 min of one core in all): 10 of Criteo's fields at 5e-3 x its cardinalities (62,217
# ids, a 2^16-row table), embedding dim 4, DeepFM 32-32; 9.84M training rows x 10 epochs = 3,000 steps at
# 32K (98M samples) against 96,090 at 1K.
CPU = Setting(
    rows=10_250_000,
    test_fraction=0.04,
    scale=5e-3,
    mlp=(32, 32),
    epochs=10,
    base=1024,
    large=32768,
    seeds=(0, 1, 2),
    fields=10,
    embed_dim=4,
)
# 32K x 3,000 steps = 98M samples: 11M training rows x 9 epochs = 3,021 steps at 32K
FULL = Setting(
    rows=12_000_000,
    test_fraction=1 / 12,
    scale=2e-2,
    mlp=(400, 400, 400),
    epochs=9,
    base=1024,
    large=32768,
    seeds=(0, 1, 2),
)


def variants(setting: Setting) -> dict[str, tuple[int, Recipe, dict]]:
    """name -> (batch, recipe, TrainConfig overrides)."""
    base, large = setting.base, setting.large
    s = large / base
    ref, rules = cowclip_recipe(base, base_batch=base), cowclip_recipe(large, base_batch=base)
    return {
        "reference": (base, ref, {}),
        "cowclip": (large, rules, {}),
        "no-clip": (large, replace(rules, clip=False), {}),
        "init-1e-4": (large, rules, {"init_std": 1e-4}),
        "l2-unscaled": (large, replace(rules, l2=ref.l2), {}),
        "embed-lr-sqrt": (large, replace(rules, embed_lr=rules.embed_lr * math.sqrt(s)), {}),
        "summed-loss": (large, rules, {"summed_loss": True}),
    }


CORE = ("reference", "cowclip", "no-clip")


def run(setting: Setting, name: str, spec, data, seed: int, device: str) -> dict:
    batch, recipe, overrides = spec
    cfg = TrainConfig(
        batch_size=batch,
        epochs=setting.epochs,
        recipe="cowclip",
        mode="full",
        mlp=setting.mlp,
        embed_dim=setting.embed_dim,
        base_batch=setting.base,
        seed=seed,
        progress=False,
        device=device,
        **overrides,
    )
    cpu = time.process_time()
    res = train(cfg, *data, recipe=recipe)
    row = {
        "variant": name,
        "seed": seed,
        "batch_size": batch,
        "steps": res.steps,
        "auc": res.auc,
        "logloss": res.logloss,
        "best_epoch_auc": max(h["auc"] for h in res.history),
        "clipped_fraction": res.clip.clipped_fraction,
        "clip_ratio_max": res.clip.ratio_quantiles["max"],
        "wall_s": res.wall_s,
        "cpu_s": time.process_time() - cpu,
        "history": res.history,
        "settings": asdict(recipe),
        "overrides": overrides,
    }
    print(
        f"{time.strftime('%H:%M:%S')} seed {seed} {name:>14} b={batch:>6}: AUC {res.auc:.5f} (best epoch "
        f"{row['best_epoch_auc']:.5f}) logloss {res.logloss:.5f} {res.steps} steps clipped "
        f"{res.clip.clipped_fraction:.3%} ({res.wall_s:.0f}s wall, {row['cpu_s']:.0f}s CPU)",
        file=sys.stderr,
        flush=True,
    )
    return row


def schedule(setting: Setting, names: list[str]) -> list[tuple[int, str]]:
    """(seed, variant) in the order run: the reference, CowClip and no-clip on every seed, then the knobs seed
    by seed (a run cut short still has the core comparison on every seed and the knobs on the first)."""
    order = [(seed, n) for seed in setting.seeds for n in names if n in CORE]
    return order + [(seed, n) for seed in setting.seeds for n in names if n not in CORE]


def same_setting(recorded: dict, setting: Setting) -> bool:
    """Whether a result file's `setting` is `setting`. Files written while `Setting` had `knob_seeds` (the knobs'
    seeds, None: `seeds`) record it; every one ran the knobs on all its seeds, so that field is dropped."""
    legacy = recorded.get("knob_seeds", None)
    if legacy is not None and legacy != recorded["seeds"]:
        return False
    recorded = {k: v for k, v in recorded.items() if k != "knob_seeds"}
    return recorded == json.loads(json.dumps(asdict(setting)))


def identical_to_cowclip(runs: list[dict], seed: int) -> dict | None:
    """The no-clip run, without running it, when the CowClip run of the same seed never clipped: the clip then
    scaled every gradient by exactly 1.0, so the two runs are the same computation (bit-identical)."""
    cow = next((r for r in runs if r["variant"] == "cowclip" and r["seed"] == seed), None)
    if cow is None or cow["clipped_fraction"] != 0.0:
        return None
    return {**cow, "variant": "no-clip", "identical_by_construction": "the CowClip run clipped no row"}


def summarize(runs: list[dict], oracle: dict[int, float]) -> dict:
    """Per variant: mean and spread of the AUC and of the paired gap to the reference (same seed)."""
    ref = {r["seed"]: r for r in runs if r["variant"] == "reference"}
    out = {}
    for name in dict.fromkeys(r["variant"] for r in runs):
        rows = [r for r in runs if r["variant"] == name and r["seed"] in ref]
        if not rows:
            continue
        gaps = [ref[r["seed"]]["auc"] - r["auc"] for r in rows]
        best_gaps = [ref[r["seed"]]["best_epoch_auc"] - r["best_epoch_auc"] for r in rows]
        out[name] = {
            "auc_mean": statistics.mean(r["auc"] for r in rows),
            "auc_std": statistics.stdev(r["auc"] for r in rows) if len(rows) > 1 else 0.0,
            "gap_to_reference_mean": statistics.mean(gaps),
            "gap_to_reference_std": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
            "gaps": gaps,
            "best_epoch_gap_mean": statistics.mean(best_gaps),
            "gap_to_oracle_mean": statistics.mean(oracle[r["seed"]] - r["auc"] for r in rows),
            "steps": rows[0]["steps"],
            "clipped_fraction_mean": statistics.mean(r["clipped_fraction"] for r in rows),
            "seeds": [r["seed"] for r in rows],
        }
    return out


def verdict(summary: dict, setting: Setting) -> str:
    large = {k: v for k, v in summary.items() if k != "reference"}
    best = min(large, key=lambda k: large[k]["gap_to_reference_mean"])
    cc, nc = summary["cowclip"], summary["no-clip"]
    lossless = [k for k, v in large.items() if v["gap_to_reference_mean"] <= v["gap_to_reference_std"] + 1e-3]
    return (
        f"{len(summary['reference']['seeds'])} seeds, {cc['steps']} large-batch steps at {setting.large} "
        f"(s = {setting.large // setting.base}) vs {summary['reference']['steps']} at {setting.base}. "
        f"CowClip rules ({len(cc['seeds'])} seeds): gap {cc['gap_to_reference_mean']:+.4f} +- "
        f"{cc['gap_to_reference_std']:.4f} (clip fired on {cc['clipped_fraction_mean']:.2%} of rows); without "
        f"the clip ({len(nc['seeds'])} seeds) {nc['gap_to_reference_mean']:+.4f} +- {nc['gap_to_reference_std']:.4f}. "
        f"Smallest gap: {best} ({large[best]['gap_to_reference_mean']:+.4f}, {len(large[best]['seeds'])} seeds). "
        f"Within one seed-spread (+1e-3) of the reference: {', '.join(lossless) or 'none'}."
    )


def plot(summary: dict, runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in summary if k != "reference"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
    ax.bar(
        [f"{k}\n({len(summary[k]['seeds'])} seeds)" for k in names],
        [summary[k]["gap_to_reference_mean"] for k in names],
        yerr=[summary[k]["gap_to_reference_std"] for k in names],
        color="tab:blue",
        capsize=4,
    )
    for i, k in enumerate(names):
        ax.plot([i] * len(summary[k]["gaps"]), summary[k]["gaps"], "k.", ms=4)
    ax.axhline(0, color="black", lw=0.8)
    ax.set(ylabel="AUC gap to the base batch (final epoch)", title=title)
    ax.tick_params(axis="x", labelsize=7)
    colors = dict(zip(["reference", *names], plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for r in runs:
        if r["seed"] == min(x["seed"] for x in runs):
            ax2.plot(
                [h["epoch"] for h in r["history"]],
                [h["auc"] for h in r["history"]],
                color=colors.get(r["variant"]),
                label=r["variant"],
                marker=".",
            )
    ax2.set(xlabel="epoch", ylabel="held-out AUC", title="AUC per epoch, first seed")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out: Path, args_line: str, setting: Setting, runs: list[dict], oracle: dict, wall: float) -> dict:
    """The JSON (rewritten after every run, so a run cut short still leaves its results) and the plot."""
    summary = summarize(runs, oracle)
    text = verdict(summary, setting) if {"cowclip", "no-clip"} <= set(summary) else ""
    result = {
        "command": args_line,
        "setting": asdict(setting),
        "mode": "full (faithful: full-table L2 through Adam every step)",
        "oracle_auc": oracle,
        "summary": summary,
        "verdict": text,
        "runs": runs,
        "wall_s": wall,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    if summary.get("reference") and len(summary) > 1:
        plot(summary, runs, out.with_suffix(".png"), f"DeepFM, faithful, s = {setting.large // setting.base}")
    return result


SETTINGS = {"quick": "QUICK", "cpu": "CPU", "full": "FULL"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small setting (same as --setting quick)")
    p.add_argument("--setting", choices=SETTINGS, default="full", help="which size (see the module doc)")
    p.add_argument(
        "--variants", default=None, help="comma-separated subset of the variants (reference always runs)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--resume", action="store_true", help="keep the runs already in --json, run the rest")
    p.add_argument("--seeds", default=None, help="comma-separated: run only these of the setting's seeds")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="FILE",
        help="add the runs of these result files (same setting; e.g. a second process's) to --json and "
        "rewrite its summary and plot; trains nothing",
    )
    p.add_argument("--json", default="bench/results/ctr_decisive.json", help="result file (+ .png plot)")
    args = p.parse_args(argv)
    setting = globals()[SETTINGS["quick" if args.quick else args.setting]]
    specs = variants(setting)
    if args.variants:
        keep = {"reference", *args.variants.split(",")}
        unknown = keep - set(specs)
        if unknown:
            p.error(f"unknown variants {sorted(unknown)}; choose from {sorted(specs)}")
        specs = {k: v for k, v in specs.items() if k in keep}
    out = Path(args.json)
    args_line = " ".join(
        ["python", "bench/experiments/ctr_decisive.py", *(argv if argv is not None else sys.argv[1:])]
    )
    runs, oracle, wall = [], {}, 0.0
    sources = ([out] if args.resume or args.merge else []) + [Path(f) for f in args.merge or []]
    for path in sources:
        if not path.is_file():
            continue
        old = json.loads(path.read_text())
        if not same_setting(old["setting"], setting):
            p.error(f"{path} holds another setting; give a new --json")
        seen = {(r["seed"], r["variant"]) for r in runs}
        runs += [r for r in old["runs"] if (r["seed"], r["variant"]) not in seen]
        wall = max(wall, old["wall_s"])
        oracle.update({int(k): v for k, v in old["oracle_auc"].items()})
    if args.merge:
        result = write(out, args_line, setting, runs, oracle, wall)
        print(f"{result['verdict']}\n-> {out}")
        return 0
    only = None if args.seeds is None else {int(x) for x in args.seeds.split(",")}
    done = {(r["seed"], r["variant"]) for r in runs}
    start, cached = time.perf_counter() - wall, (None, None)
    for seed, name in schedule(setting, list(specs)):
        if (seed, name) in done or (only is not None and seed not in only):
            continue
        same = identical_to_cowclip(runs, seed) if name == "no-clip" else None
        if same is not None:
            runs.append(same)
            continue
        if cached[0] != seed:
            cached = (seed, None)  # free the last seed's rows before generating the next
            gen = SyntheticConfig(n_rows=setting.rows, scale=setting.scale, seed=seed, fields=setting.fields)
            cached = (seed, generate(gen).split_random(setting.test_fraction, seed=seed))
            oracle[seed] = realised_oracle(cached[1][1])[0]
        runs.append(run(setting, name, specs[name], cached[1], seed, args.device))
        write(out, args_line, setting, runs, oracle, time.perf_counter() - start)
    result = write(out, args_line, setting, runs, oracle, time.perf_counter() - start)
    print(f"{result['verdict']}\n-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
