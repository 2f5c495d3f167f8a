"""How `routed-lora` should grade "no learned task claims this text", chosen on VALIDATION streams only.

    OMP_NUM_THREADS=1 python bench/experiments/lifelong_abstain_val.py --json bench/results/lifelong_abstain_val.json

Quick streams (3 CLINC domains, 4 training texts per intent) on CLINC's validation split, (seed, order) =
(0, 0), (1, 1), (2, 2), (3, 0): routed-lora (the preset) learns the tasks, then its in-scope texts (CLINC val,
20 per intent) and CLINC's `oos_val` are scored. `oos_val` is split in two halves: the threshold is the q
quantile of one half's grades, the recall is measured on the other (no `oos_test` text is read). Per grade
(the routed task's prototype margin `claim`, the best probability `probability`, and the route's binary claim
times the probability, the earlier rule) and q: in-scope accuracy with abstentions counted wrong, against
Last; and the ECE of the answered texts at several probability scales. About 1 min a stream on one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from ecru.datasets import humanize_intent, load_clinc
from ecru.io import atomic_write_json
from ecru.lifelong.calibration import expected_calibration_error
from ecru.lifelong.methods import TrainConfig, make_method
from ecru.lifelong.stream import StreamConfig, build_clinc_stream
from ecru.models import load_minilm

RUNS = ((0, 0), (1, 1), (2, 2), (3, 0))
QUANTILES = (0.7, 0.8, 0.9)
SCALES = (8.0, 10.0, 12.0, 14.0, 16.0, 30.0)


def run(seed: int, order: int) -> dict:
    stream = build_clinc_stream(StreamConfig(tasks=3, train_per_intent=4, test_per_intent=20, heldout_per_class=3,
                                             reference_size=400, split="val", seed=seed, order=order))  # fmt: skip
    train = TrainConfig(
        epochs=2, batch_size=16, lr=2e-5, scale=30.0, label_smoothing=0.2, seed=seed, progress=False
    )
    method = make_method("routed-lora", load_minilm(), train=train)
    for i, task in enumerate(stream.tasks):
        method.learn(task, index=i)
    names = [humanize_intent(i) for t in stream.tasks for i in t.intents]
    texts = [e.text for t in stream.tasks for e in t.test]
    gold = torch.tensor([names.index(humanize_intent(e.label)) for t in stream.tasks for e in t.test])
    oos = [e.text for e in load_clinc()["oos_val"]]
    enc = method.encoder()
    scores, claim = enc.scores(texts + oos, names).double(), enc.claim_scores(texts + oos)
    n, perm = len(texts), torch.randperm(len(oos), generator=torch.Generator().manual_seed(0)) + len(texts)
    fit, held = perm[: len(oos) // 2], perm[len(oos) // 2 :]
    prob = torch.softmax(30.0 * scores, -1).max(-1).values
    right = scores[:n].argmax(-1) == gold
    grades = {"claim": claim, "probability": prob, "binary_claim_x_probability": prob * (claim >= 0)}
    out = {"seed": seed, "order": order, "last": 100 * right.double().mean().item(), "grades": {}}
    for key, grade in grades.items():
        for q in QUANTILES:
            abstained = grade <= torch.quantile(grade[fit], q)
            answered = ~abstained[:n]
            row = {"in_scope_accuracy": 100 * (right & answered).double().mean().item(),
                   "oos_val_recall_other_half": 100 * abstained[held].double().mean().item()}  # fmt: skip
            for s in SCALES:
                conf = torch.softmax(s * scores[:n], -1).max(-1).values
                row[f"ece_scale_{s:g}"] = expected_calibration_error(conf[answered], right[answered])
            out["grades"][f"{key}@{q}"] = row
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    runs = []
    for seed, order in RUNS:
        runs.append(run(seed, order))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "grades"}), file=sys.stderr, flush=True)
    mean = {k: {m: sum(r["grades"][k][m] for r in runs) / len(runs) for m in runs[0]["grades"][k]}
            for k in runs[0]["grades"]}  # fmt: skip
    last = sum(r["last"] for r in runs) / len(runs)
    print(f"mean Last {last:.2f}")
    for k, row in mean.items():
        print(f"{k:34s} in-scope {row['in_scope_accuracy']:6.2f} (cost {last - row['in_scope_accuracy']:4.2f})  "
              f"oos_val recall {row['oos_val_recall_other_half']:5.1f}  "
              + " ".join(f"ece@{s:g} {row[f'ece_scale_{s:g}']:.3f}" for s in SCALES))  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.json, {"command": " ".join(["python", *sys.argv]), "mean_last": last, "mean": mean,
                                  "runs": runs})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
