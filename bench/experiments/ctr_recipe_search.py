"""Large-batch recipe selection on held-out seeds: candidate rules at 32x against the 1K reference.

Each seed draws its own synthetic data, teacher, model init and batch order (the quick setting of
bench/ctr_scaling.py); every candidate and the 1K reference run in the faithful mode. Select on seeds
that the benchmark does not report (the default 10,11,12), then check the winner with
`bench/ctr_scaling.py --quick --seed 0/1`.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/experiments/ctr_recipe_search.py \
        --json bench/results/ctr_recipe_search.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ecru.cowclip import Recipe, scaled_recipe
from ecru.ctr import SyntheticConfig, TrainConfig, generate, train
from ecru.io import atomic_write_json

BENCH = Path(__file__).resolve().parents[1]  # bench/: the product benchmark this study builds on
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))
from ctr_scaling import QUICK  # noqa: E402


def candidates(batch: int, base: int) -> dict[str, Recipe]:
    """Rules written as (embedding LR x s^a, dense LR x s^b, L2 x s^c, dense warm-up in epochs)."""
    s = batch / base
    ref = scaled_recipe("adam", batch, base_batch=base)

    def rule(a, b, c, warm):
        return replace(
            ref,
            name="tempered",
            embed_lr=ref.embed_lr * s**a,
            dense_lr=ref.dense_lr * s**b,
            l2=ref.l2 * s**c,
            warmup_epochs=warm,
        )

    return {
        "e1-d.75-l.5-w1/s": rule(1, 0.75, 0.5, 1 / s),  # the tempered rule
        "e1-d.5-l.5-w1/s": rule(1, 0.5, 0.5, 1 / s),
        "e1-d.75-l.5-w.25": rule(1, 0.75, 0.5, 0.25),
        "e1-d1-l1-w1": rule(1, 1.0, 1.0, 1.0),  # = linear
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="10,11,12", help="comma-separated seeds (data, teacher, init, order)")
    p.add_argument("--batch", type=int, default=32768)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    setting, base = QUICK, QUICK.batches[0]
    seeds = [int(x) for x in args.seeds.split(",")]
    rows, start = [], time.perf_counter()
    for seed in seeds:
        data = generate(
            SyntheticConfig(n_rows=setting.rows, scale=setting.scale, zipf=setting.zipf, seed=seed)
        )
        tr, te = data.split_random(setting.test_fraction, seed=seed)
        runs = {"1k": scaled_recipe("adam", base, base_batch=base), **candidates(args.batch, base)}
        for label, recipe in runs.items():
            cfg = TrainConfig(
                batch_size=recipe.batch_size, mlp=setting.mlp, base_batch=base, seed=seed, progress=False
            )
            res = train(cfg, tr, te, recipe=recipe)
            rows.append({"seed": seed, "label": label, "auc": res.auc, "settings": asdict(recipe)})
            print(f"seed {seed} {label:>20}: AUC {res.auc:.5f}", file=sys.stderr, flush=True)
    table = {}
    for label in dict.fromkeys(r["label"] for r in rows if r["label"] != "1k"):
        gaps = [
            next(r["auc"] for r in rows if r["seed"] == s and r["label"] == "1k")
            - next(r["auc"] for r in rows if r["seed"] == s and r["label"] == label)
            for s in seeds
        ]
        table[label] = {"gaps": gaps, "mean_gap": statistics.mean(gaps), "max_gap": max(gaps)}
    print(f"\n{'rule':>20} {'mean gap':>9} {'max gap':>9}  per seed")
    for label, t in sorted(table.items(), key=lambda kv: kv[1]["max_gap"]):
        print(
            f"{label:>20} {t['mean_gap']:9.5f} {t['max_gap']:9.5f}  {' '.join(f'{g:.5f}' for g in t['gaps'])}"
        )
    out = {
        "command": " ".join(["python", "bench/experiments/ctr_recipe_search.py", *(argv or sys.argv[1:])]),
        "setting": asdict(setting),
        "batch": args.batch,
        "seeds": seeds,
        "threads": 1,
        "runs": rows,
        "gaps_to_1k": table,
        "best_by_max_gap": min(table, key=lambda k: table[k]["max_gap"]),
        "wall_s": time.perf_counter() - start,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
