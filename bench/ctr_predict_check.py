"""Acceptance check of the practitioner's path: `ecru ctr train --out` on a Criteo-format file with malformed
lines, then `ecru ctr predict` on held-out rows, and the AUC computed from the written predictions alone.

1. `ecru ctr synth` writes N synthetic Criteo-format rows (a teacher FM gives the true click probability);
2. the first 90% of the lines become train.tsv, with malformed lines added (a bad label, a short line, a
   non-integer count, a non-hexadecimal token, a line with commas); the last 10% become held.tsv, written
   without the label column (held_labels.txt keeps the labels aside);
3. `ecru ctr train --data criteo:train.tsv --skip-malformed --out DIR ...`; `ecru ctr predict --model DIR
   --data criteo:held.tsv --out scores.txt`;
4. AUC = sklearn's roc_auc_score(held labels, scores.txt); the oracle AUC (the teacher's probabilities) of
   the same rows is the ceiling.

    python bench/ctr_predict_check.py --rows 400000 --json bench/results/ctr_predict_check.json   # ~3 min
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

from ecru.cli import build_parser
from ecru.cli import main as ecru
from ecru.cliargs import ArgumentParser, positive_int, prepare_out_file, run_main
from ecru.ctr import SyntheticConfig, generate
from ecru.io import atomic_write_text

BAD = [
    "2\t" + "\t".join(["1"] * 13 + ["0aaf7e0c"] * 26) + "\n",
    "1\t2\t3\n",
    "0\t" + "\t".join(["x"] + ["1"] * 12 + ["0aaf7e0c"] * 26) + "\n",
    "1\t" + "\t".join(["1"] * 13 + ["zzzz"] + ["0aaf7e0c"] * 25) + "\n",
    ",".join(["1"] + ["1"] * 13 + ["0aaf7e0c"] * 26) + "\n",
]
TARGET = 0.75


def make_files(root: Path, rows: int, seed: int) -> tuple[Path, Path, np.ndarray, float]:
    all_tsv = root / "all.tsv"
    assert ecru(["ctr", "synth", "--rows", str(rows), "--seed", str(seed), "--out", str(all_tsv)]) == 0
    lines = all_tsv.read_text().splitlines(keepends=True)
    cut = int(len(lines) * 0.9)
    train = lines[:cut]
    for i, bad in enumerate(BAD):  # spread through the file
        train.insert((i + 1) * len(train) // (len(BAD) + 1), bad)
    (root / "train.tsv").write_text("".join(train))
    held = lines[cut:]
    (root / "held.tsv").write_text("".join(line.split("\t", 1)[1] for line in held))
    labels = np.array([int(line[0]) for line in held])
    prob = generate(SyntheticConfig(n_rows=rows, seed=seed)).info["prob"][cut:].numpy()
    return root / "train.tsv", root / "held.tsv", labels, float(roc_auc_score(labels, prob))


def train_argv(train: str | Path, model: str | Path, flags: str) -> list[str]:
    """`ecru ctr train` on the file `train` into the folder `model`, with the extra `flags`."""
    data = ["--data", f"criteo:{train}", "--skip-malformed"]
    return ["ctr", "train", *data, "--out", str(model), *flags.split()]


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=positive_int, default=400_000, help="synthetic rows (train + held out)")
    p.add_argument("--seed", type=int, default=1, help="seed of the synthetic data")
    p.add_argument(
        "--train-flags",
        default="--recipe tempered --base-batch 128 --min-count 2 --mlp 256,256",
        help="extra flags of `ecru ctr train`",
    )
    p.add_argument("--json", default="bench/results/ctr_predict_check.json", help="result file")
    args = p.parse_args(argv)
    prepare_out_file(args.json, flag="--json")
    # bad --train-flags: refused in one line (as `ecru ctr train` refuses them) before any data is made
    build_parser().parse_args(train_argv("TRAIN", "MODEL", args.train_flags))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train, held, labels, oracle = make_files(root, args.rows, args.seed)
        model, scores = root / "model", root / "scores.txt"
        start = time.perf_counter()
        assert ecru(train_argv(train, model, args.train_flags)) == 0
        train_s = time.perf_counter() - start
        start = time.perf_counter()
        assert (
            ecru(["ctr", "predict", "--model", str(model), "--data", f"criteo:{held}", "--out", str(scores)])
            == 0
        )
        predict_s = time.perf_counter() - start
        probs = np.array([float(x) for x in scores.read_text().split()])
        metrics = json.loads((model / "metrics.json").read_text())
        files = sorted(p.name for p in model.iterdir())
    assert len(probs) == len(labels), (len(probs), len(labels))
    result = {
        "command": " ".join(
            ["python", "bench/ctr_predict_check.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "rows": args.rows,
        "train_flags": args.train_flags,
        "malformed_lines_added": len(BAD),
        "skipped_lines_reported": metrics["skipped_lines"],
        "held_out_rows": len(labels),
        "held_out_auc_from_predictions": float(roc_auc_score(labels, probs)),
        "held_out_oracle_auc": oracle,
        "internal_test_auc": metrics["auc"],
        "target_auc": TARGET,
        "target_met": float(roc_auc_score(labels, probs)) >= TARGET,
        "train_s": train_s,
        "predict_s": predict_s,
        "model_folder": files,
    }
    atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    print(
        f"held-out AUC from predictions {result['held_out_auc_from_predictions']:.4f} "
        f"(oracle {oracle:.4f}, target {TARGET}); skipped {metrics['skipped_lines']} of {len(BAD)} bad lines -> {args.json}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
