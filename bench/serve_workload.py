"""Does a response's length depend on the request? SmolLM2's greedy answer lengths on the mixed workload
(`ecru.serve.workload`: 14 instruction forms over wiki sentences and CLINC/Banking queries), and how well
prompt-only predictors trained on the train split rank the unseen test prompts.

Predictors, each fitted on train labels only and scored on test prompts: the constant median; MiniLM
ridge (`MiniLMPredictor`); SmolLM2's own hidden-state probe (`ProbePredictor`). Reported: Acc-50, Acc-100,
MAE, Spearman, overall and on the test-only (held-out) instruction forms. Labels are generated once and
cached in --labels-dir (resumable); `--labels-only` just generates them.

    OMP_NUM_THREADS=1 python bench/serve_workload.py --train 480 --test 240 --json bench/results/serve_workload.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

from ecru.serve import MiniLMPredictor, length_metrics, read_labels
from ecru.serve.labels import label_prompts
from ecru.serve.models import load_model
from ecru.serve.predictors import ConstantPredictor, ProbePredictor
from ecru.serve.workload import HELD_OUT_FORMS, WorkloadConfig, build_mixed_workload


def spearman(a, b) -> float | None:
    """Rank correlation with ties averaged; None where one side is constant (a constant predictor)."""
    if len(set(a)) < 2 or len(set(b)) < 2:
        return None
    return float(spearmanr(a, b).statistic)


def label(model, tok, prompts, path: Path, cap: int) -> dict[str, int]:
    label_prompts(model, tok, [p.prompt for p in prompts], out=path, samples=1, max_new_tokens=cap)
    return {r.prompt: r.greedy for r in read_labels(path) if r.max_new_tokens == cap}


def score(name, predictor, test, lengths, held_out) -> dict:
    t0 = time.perf_counter()
    pred = predictor.predict([p.prompt for p in test])
    out = {**length_metrics(pred, lengths), "spearman": spearman(pred, lengths)}
    idx = [i for i, p in enumerate(test) if p.form in held_out]
    out["spearman_held_out_forms"] = spearman([pred[i] for i in idx], [lengths[i] for i in idx])
    out["predict_s"] = time.perf_counter() - t0
    print(f"{name:>10}: " + ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in out.items()))
    return out


def per_form(prompts, lengths) -> dict[str, dict]:
    forms: dict[str, list[int]] = {}
    for p, n in zip(prompts, lengths, strict=True):
        forms.setdefault(p.form, []).append(n)
    return {
        f: {"n": len(v), "median": statistics.median(v), "mean": statistics.fmean(v)}
        for f, v in forms.items()
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=480, help="training prompts labelled")
    ap.add_argument("--test", type=int, default=240, help="test prompts labelled")
    ap.add_argument("--cap", type=int, default=256, help="max new tokens per answer")
    ap.add_argument("--labels-dir", default="runs/serve_workload", help="label cache (resumable)")
    ap.add_argument("--labels-only", action="store_true", help="generate the labels and stop")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    w = build_mixed_workload(WorkloadConfig())
    train, test = w["train"][: args.train], w["test"][: args.test]
    model, tok = load_model("smollm2")
    labels_dir = Path(args.labels_dir)
    tr = label(model, tok, test, labels_dir / "test.jsonl", args.cap)  # test first: the smaller file
    tr.update(label(model, tok, train, labels_dir / "train.jsonl", args.cap))
    if args.labels_only:
        return
    y_train, y_test = [tr[p.prompt] for p in train], [tr[p.prompt] for p in test]
    predictors = {
        "constant": ConstantPredictor(statistics.median(y_train)),
        "minilm": MiniLMPredictor(cap=args.cap).fit([p.prompt for p in train], y_train),
        "probe": ProbePredictor(model, tok, cap=args.cap).fit([p.prompt for p in train], y_train),
    }
    results = {n: score(n, p, test, y_test, HELD_OUT_FORMS) for n, p in predictors.items()}
    out = {
        "command": "python bench/serve_workload.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "workload": "mixed (ecru.serve.workload)",
        "cap": args.cap,
        "train_prompts": len(train),
        "test_prompts": len(test),
        "cap_hit_share_test": sum(n >= args.cap for n in y_test) / len(y_test),
        "lengths_by_form_test": per_form(test, y_test),
        "predictors": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
