"""The self-predicting LoRA (SmolLM2 tuned to state its own answer's length) chosen on a validation split
and scored on the mixed workload's unseen test prompts, with both readouts of `SelfLoRAConfig.readout`:
"greedy" (the number it generates, the paper's) and "expected" (bucket numbers weighed by its probabilities).

Labels are the committed ones (`bench/serve_workload.py` made them): the longest of `--samples` answers per
train prompt, the test prompts' greedy lengths as the truth. Selection: the last `--val` train prompts are
held out, an adapter is tuned on the rest for `--epochs` epochs at each `--lrs` value and scored on them
after every epoch (Spearman, each readout). The best (lr, epochs, readout) by validation Spearman is then
tuned on every train prompt and scored once on the test prompts, both readouts, prediction time measured.
Results are written after each step (atomically) and a rerun with the same `--json` skips the lrs done.

    OMP_NUM_THREADS=2 python bench/serve_self_predict.py --json bench/results/serve_self_predict_max4.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from ecru.serve import length_metrics
from ecru.serve.labels import read_labels
from ecru.serve.models import load_model
from ecru.serve.predictors import spearman
from ecru.serve.self_predict import READOUTS, SelfLoRAConfig, SelfLoRAPredictor
from ecru.serve.workload import HELD_OUT_FORMS, WorkloadConfig, build_mixed_workload

RESULTS = Path(__file__).parent / "results"


def write(path: Path, out: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    os.replace(tmp, path)


def scores(predictor, prompts, lengths, forms) -> dict:
    """Per readout: Spearman (all, held-out forms), Acc-50, Acc-100, MAE, predict seconds."""
    out = {}
    for readout in READOUTS:
        predictor.config = dataclasses.replace(predictor.config, readout=readout)
        t0 = time.perf_counter()
        pred = predictor.predict(prompts)
        held = [i for i, f in enumerate(forms) if f in HELD_OUT_FORMS]
        out[readout] = {
            "spearman": spearman(pred, lengths),
            "spearman_held_out_forms": spearman([pred[i] for i in held], [lengths[i] for i in held])
            if held
            else None,
            **length_metrics(pred, lengths),
            "predict_s": time.perf_counter() - t0,
        }
    return out


def untuned(*, lr: float, epochs: int, cap: int) -> SelfLoRAPredictor:
    """A fresh SmolLM2 with a new length adapter (the adapter wraps the model it is given)."""
    model, tok = load_model("smollm2")
    return SelfLoRAPredictor(model, tok, config=SelfLoRAConfig(lr=lr, epochs=epochs, cap=cap))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-labels", default=str(RESULTS / "serve_workload_labels_train_max4.jsonl"))
    ap.add_argument("--test-labels", default=str(RESULTS / "serve_workload_labels_test.jsonl"))
    ap.add_argument("--train", type=int, default=None, help="use the first N train prompts (default: all)")
    ap.add_argument("--test", type=int, default=None, help="use the first N test prompts (default: all)")
    ap.add_argument("--samples", type=int, default=4, help="train label: the longest of the first N answers")
    ap.add_argument("--val", type=int, default=200, help="train prompts held out for the selection")
    ap.add_argument("--lrs", default="5e-4,2e-4,1e-4", help="learning rates tried (comma-separated)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per lr (each scored on validation)")
    ap.add_argument("--cap", type=int, default=256)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    w = build_mixed_workload(WorkloadConfig())
    form = {p.prompt: p.form for p in w["train"] + w["test"]}
    train = [(r.prompt, max(r.lengths[: args.samples])) for r in read_labels(args.train_labels)][: args.train]
    test = [(r.prompt, r.greedy) for r in read_labels(args.test_labels)][: args.test]
    fit, val = train[: -args.val], train[-args.val :]
    path = Path(args.json)
    out = json.loads(path.read_text()) if path.is_file() else {}
    out.update(command="python bench/serve_self_predict.py " + " ".join(sys.argv[1:] if argv is None else argv),
               train_prompts=len(train), val_prompts=len(val), test_prompts=len(test), labels=(
               f"train: the longest of {args.samples} sampled answers; test: the greedy answer's length"))  # fmt: skip
    out.setdefault("validation", {})
    for lr in [float(x) for x in args.lrs.split(",")]:
        if str(lr) in out["validation"]:
            continue
        curve, predictor = {}, untuned(lr=lr, epochs=args.epochs, cap=args.cap)

        def evaluate(epoch, curve=curve, predictor=predictor, lr=lr):
            curve[str(epoch)] = scores(
                predictor, [p for p, _ in val], [y for _, y in val], [form[p] for p, _ in val]
            )
            print(
                f"lr {lr} epoch {epoch}: "
                + ", ".join(f"{r} {v['spearman']:.3f}" for r, v in curve[str(epoch)].items())
            )

        predictor.fit([p for p, _ in fit], [y for _, y in fit], after_epoch=evaluate)
        out["validation"][str(lr)] = curve
        write(path, out)
    best = max(((lr, e, r, v[r]["spearman"]) for lr, c in out["validation"].items() for e, v in c.items()
                for r in READOUTS), key=lambda t: t[3])  # fmt: skip
    lr, epochs, readout, _ = best
    out["chosen"] = {"lr": float(lr), "epochs": int(epochs), "readout": readout}
    print(f"chosen on validation: lr {lr}, {epochs} epochs, readout {readout}")
    final = untuned(lr=float(lr), epochs=int(epochs), cap=args.cap)
    final.fit([p for p, _ in train], [y for _, y in train])
    out["test"] = scores(final, [p for p, _ in test], [y for _, y in test], [form[p] for p, _ in test])
    for r, v in out["test"].items():
        print(f"test, {r}: " + ", ".join(f"{k} {x:.3f}" for k, x in v.items() if x is not None))
    write(path, out)


if __name__ == "__main__":
    main()
