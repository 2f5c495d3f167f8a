"""The self-predicting LoRA (SmolLM2 tuned to state its own answer's length) chosen on a validation split
and scored on the mixed workload's unseen test prompts, with both readouts of `SelfLoRAConfig.readout`:
"greedy" (the number it generates, the paper's) and "expected" (bucket numbers weighed by its probabilities).

Labels are the committed ones (`bench/experiments/serve_workload.py` made them): the longest of `--samples` answers per
train prompt; the test prompts' greedy lengths are the truth. Selection: the last `--val` train prompts are
held out, an adapter is tuned on the rest for `--epochs` epochs at each `--lrs` value and scored after every
epoch, both readouts, against those prompts' labels (the max of `--samples`, what the adapter learns). Each
readout's best (lr, epochs) by validation Spearman is then tuned on every train prompt and scored once on
the test prompts (both readouts of that adapter are recorded). The JSON is rewritten after each learning
rate and each test fit; a rerun with the same `--json` and the same settings skips what is done (other
settings are refused).

    OMP_NUM_THREADS=2 python bench/experiments/serve_self_predict.py --lrs 5e-4,2e-4 --epochs 2 \
        --json bench/results/serve_self_predict_max4.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from ecru.io import atomic_write_json
from ecru.serve import length_metrics
from ecru.serve.engine.models import load_model
from ecru.serve.predict.labels import read_labels
from ecru.serve.predict.predictors import spearman, timed_predict
from ecru.serve.predict.self_predict import READOUTS, SelfLoRAConfig, SelfLoRAPredictor
from ecru.serve.workload import HELD_OUT_FORMS, WorkloadConfig, build_mixed_workload

RESULTS = Path(__file__).resolve().parents[1] / "results"


def scores(predictor, prompts, lengths, forms) -> dict:
    """Per readout: Spearman (all, held-out forms), Acc-50, Acc-100, MAE, predict seconds."""
    out, held = {}, [i for i, f in enumerate(forms) if f in HELD_OUT_FORMS]
    for readout in READOUTS:
        predictor.config = dataclasses.replace(predictor.config, readout=readout)
        pred, predict_s = timed_predict(predictor, prompts)
        out[readout] = {
            "spearman": spearman(pred, lengths),
            "spearman_held_out_forms": spearman([pred[i] for i in held], [lengths[i] for i in held])
            if held
            else None,
            **length_metrics(pred, lengths),
            "predict_s": predict_s,
            "distinct_predictions": len({round(x, 3) for x in pred}),
        }
    return out


def untuned(*, lr: float, epochs: int, cap: int) -> SelfLoRAPredictor:
    """A fresh SmolLM2 with a new length adapter (the adapter wraps the model it is given)."""
    model, tok = load_model("smollm2")
    return SelfLoRAPredictor(model, tok, config=SelfLoRAConfig(lr=lr, epochs=epochs, cap=cap))


def best_per_readout(validation: dict, lrs: list[float]) -> dict[str, dict]:
    """Each readout's (lr, epochs) with the highest validation Spearman among `lrs` (None counts lowest)."""
    points = [(lr, e, v) for lr, curve in validation.items() if float(lr) in lrs for e, v in curve.items()]
    rank = lambda x: -math.inf if x is None else x  # noqa: E731
    out = {}
    for r in READOUTS:
        lr, e, v = max(points, key=lambda t: rank(t[2][r]["spearman"]))
        out[r] = {"lr": float(lr), "epochs": int(e), "validation_spearman": v[r]["spearman"]}
    return out


def show(values: dict) -> str:
    return ", ".join(f"{k} {'-' if x is None else f'{x:.3f}'}" for k, x in values.items())


def load_splits(args) -> tuple[list, list, list, dict]:
    """(fit, val, test) as (prompt, length) pairs and each prompt's instruction form; refuses bad sizes."""
    w = build_mixed_workload(WorkloadConfig())
    form = {p.prompt: p.form for p in w["train"] + w["test"]}
    train = [
        (r.prompt, min(args.cap, max(r.lengths[: args.samples]))) for r in read_labels(args.train_labels)
    ]
    test = [(r.prompt, min(args.cap, r.greedy)) for r in read_labels(args.test_labels)][: args.test]
    train = train[: args.train]
    for name, rows in ((args.train_labels, train), (args.test_labels, test)):
        if not rows:
            raise SystemExit(f"{name}: no labels (a missing or empty file): give a labels JSONL")
    if not 0 < args.val < len(train) or not test:
        raise SystemExit(
            f"need 0 < --val < train prompts ({len(train)}) and test prompts ({len(test)} found)"
        )
    return train[: -args.val], train[-args.val :], test, form


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
    fit, val, test, form = load_splits(args)
    lrs = [float(x) for x in args.lrs.split(",")]
    settings = {k: getattr(args, k) for k in ("train_labels", "test_labels", "train", "test", "samples", "val",
                                               "epochs", "cap")}  # fmt: skip
    settings |= {k: str(Path(v).name) for k, v in settings.items() if k.endswith("_labels")}
    path = Path(args.json)
    out = json.loads(path.read_text()) if path.is_file() else {"settings": settings}
    if out.get("settings") != settings:
        raise SystemExit(
            f"{path} holds results for other settings ({out.get('settings')}): give another --json"
        )
    out.update(command="python bench/experiments/serve_self_predict.py " + " ".join(sys.argv[1:] if argv is None else argv),
               train_prompts=len(fit) + len(val), val_prompts=len(val), test_prompts=len(test), labels=(
               f"fit and validation: the longest of {args.samples} sampled answers; test: the greedy answer's "
               "length"))  # fmt: skip
    out.setdefault("validation", {})
    for lr in lrs:
        if str(lr) not in out["validation"]:
            out["validation"][str(lr)] = validation_curve(
                fit, val, form, lr=lr, epochs=args.epochs, cap=args.cap
            )
            atomic_write_json(path, out)
    out["chosen"] = best_per_readout(out["validation"], lrs)
    out.setdefault("test", {})
    for readout, chosen in out["chosen"].items():
        print(f"chosen on validation for the {readout} readout: lr {chosen['lr']}, {chosen['epochs']} epochs")
        done = out["test"].get(readout, {})
        if (done.get("lr"), done.get("epochs")) != (chosen["lr"], chosen["epochs"]):
            out["test"][readout] = scored_on_test(fit + val, test, form, lr=chosen["lr"], epochs=chosen["epochs"],
                                               cap=args.cap)  # fmt: skip
            atomic_write_json(path, out)
        print(f"test, {readout} readout: " + show(out["test"][readout]["metrics"][readout]))


def validation_curve(fit, val, form, *, lr: float, epochs: int, cap: int) -> dict:
    """{epoch: scores on `val`} of one adapter tuned on `fit` at `lr`."""
    curve, predictor = {}, untuned(lr=lr, epochs=epochs, cap=cap)

    def evaluate(epoch):
        curve[str(epoch)] = scores(
            predictor, [p for p, _ in val], [y for _, y in val], [form[p] for p, _ in val]
        )
        print(f"lr {lr} epoch {epoch}: " + show({r: v["spearman"] for r, v in curve[str(epoch)].items()}))

    predictor.fit([p for p, _ in fit], [y for _, y in fit], after_epoch=evaluate)
    return curve


def scored_on_test(train, test, form, *, lr: float, epochs: int, cap: int) -> dict:
    """An adapter tuned on every train prompt, scored on `test` with both readouts; its tuning seconds."""
    start = time.perf_counter()
    final = untuned(lr=lr, epochs=epochs, cap=cap)
    final.fit([p for p, _ in train], [y for _, y in train])
    fit_s = time.perf_counter() - start
    metrics = scores(final, [p for p, _ in test], [y for _, y in test], [form[p] for p, _ in test])
    return {"lr": lr, "epochs": epochs, "fit_s": fit_s, "metrics": metrics}


if __name__ == "__main__":
    main()
