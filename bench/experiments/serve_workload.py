"""Does a response's length depend on the request? SmolLM2's greedy answer lengths on the mixed workload
(`ecru.serve.workload`: 14 instruction forms over wiki sentences and CLINC/Banking queries), and how well
prompt-only predictors trained on the train split rank the unseen test prompts.

Predictors, each fitted on train labels only and scored on test prompts: the constant median; MiniLM
ridge (`MiniLMPredictor`); SmolLM2's own hidden-state probe (`ProbePredictor`). Reported: Acc-50, Acc-100,
MAE, Spearman, overall and on the test-only (held-out) instruction forms. Labels are generated once and
cached in --labels-dir (resumable); `--labels-only` just generates them. With `--samples N` the predictors
learn the longest of N sampled answers per train prompt (the paper's label, T = 0, 0.3, 0.5, 0.7) and are
still scored, and simulated, against the test prompts' greedy answer lengths (what greedy serving makes).

    OMP_NUM_THREADS=2 python bench/experiments/serve_workload.py --train 1000 --test 240 --self-lora-epochs 2 \
        --json bench/results/serve_workload_1000.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

from ecru.io import atomic_write_json
from ecru.serve import MiniLMPredictor, PlanConfig, TraceRequest, length_metrics, simulate
from ecru.serve.engine.models import load_model
from ecru.serve.predict.labels import TEMPERATURES, LengthLabel, label_prompts
from ecru.serve.predict.predictors import ConstantPredictor, ProbePredictor, spearman, timed_predict
from ecru.serve.predict.self_predict import SelfLoRAConfig, SelfLoRAPredictor
from ecru.serve.prompts import encode_chat
from ecru.serve.sim.cost import measure_cost_model
from ecru.serve.workload import HELD_OUT_FORMS, WorkloadConfig, build_mixed_workload


def label(model, tok, prompts, path: Path, cap: int, samples: int) -> dict[str, LengthLabel]:
    labels = label_prompts(
        model,
        tok,
        [p.prompt for p in prompts],
        out=path,
        model_key="smollm2",
        samples=samples,
        max_new_tokens=cap,
    )
    return {r.prompt: r for r in labels}


def score(name, pred, predict_s, test, lengths, held_out) -> dict:
    out = {**length_metrics(pred, lengths), "spearman": spearman(pred, lengths)}
    idx = [i for i, p in enumerate(test) if p.form in held_out]
    out["spearman_held_out_forms"] = spearman([pred[i] for i in idx], [lengths[i] for i in idx])
    out["predict_s"] = predict_s
    print(f"{name:>10}: " + ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in out.items()))
    return out


def simulate_policies(prompt_lens, lengths, pred, predict_s, cap, cost, *, resume=False) -> dict[str, float]:
    """Throughput of each policy over fcfs, the predictor's cost charged to the policies that use it; FCR
    failures rerun from scratch (the paper) or `resume`d from the tokens they had."""
    trace = [TraceRequest(p, n, q) for p, n, q in zip(prompt_lens, lengths, pred, strict=True)]
    config = PlanConfig(batch_size=16, max_new_tokens=cap, resume=resume)
    base = simulate(trace, policy="fcfs", config=config, cost=cost).samples_per_s
    out = {
        policy: simulate(trace, policy=policy, config=config, cost=cost, predict_s=predict_s).samples_per_s
        / base
        for policy in ("sorted", "fcr", "fcr+vbs", "fcr+vbs+bins")
    }
    out["oracle"] = simulate(trace, policy="oracle", config=config, cost=cost).samples_per_s / base
    print(
        f"   simulated x fcfs{' (resumed reruns)' if resume else ''}: "
        + ", ".join(f"{k} {v:.2f}" for k, v in out.items())
    )
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
    ap.add_argument(
        "--samples",
        type=int,
        default=1,
        choices=range(1, len(TEMPERATURES) + 1),
        help="answers per prompt (T = 0, 0.3, 0.5, 0.7); predictors learn the longest, the paper's label",
    )
    ap.add_argument(
        "--self-lora-epochs", type=int, default=0, help="also tune the self-predicting LoRA (0: skip)"
    )
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    w = build_mixed_workload(WorkloadConfig())
    train, test = w["train"][: args.train], w["test"][: args.test]
    model, tok = load_model("smollm2")
    labels_dir = Path(args.labels_dir)
    # test first (the smaller file); only its greedy lengths are used
    tr = label(model, tok, test, labels_dir / "test.jsonl", args.cap, 1)
    tr.update(label(model, tok, train, labels_dir / "train.jsonl", args.cap, args.samples))
    if args.labels_only:
        return
    # predictors learn the longest of the first `samples` answers (the paper's label); the true lengths,
    # scored and simulated, are the greedy answers' (what greedy serving generates)
    y_train = [max(tr[p.prompt].lengths[: args.samples]) for p in train]
    y_test = [tr[p.prompt].greedy for p in test]
    predictors = {
        "constant": ConstantPredictor(statistics.median(y_train)),
        "minilm": MiniLMPredictor(cap=args.cap).fit([p.prompt for p in train], y_train),
        "probe": ProbePredictor(model, tok, cap=args.cap).fit([p.prompt for p in train], y_train),
    }
    if args.self_lora_epochs:  # on its own copy of the model: the adapter wraps the model it is given
        config = SelfLoRAConfig(epochs=args.self_lora_epochs, cap=args.cap)
        own, _ = load_model("smollm2")
        predictors["self-lora"] = SelfLoRAPredictor(own, tok, config=config).fit(
            [p.prompt for p in train], y_train
        )
    preds = {n: timed_predict(p, [q.prompt for q in test]) for n, p in predictors.items()}
    results = {n: score(n, *preds[n], test, y_test, HELD_OUT_FORMS) for n in predictors}
    prompt_lens = [len(i) for i in encode_chat(tok, [p.prompt for p in test])]
    cost = measure_cost_model(model, reps=3, source="SmolLM2-135M fp32, measured in this run")
    simulated = {n: simulate_policies(prompt_lens, y_test, *preds[n], args.cap, cost) for n in predictors}
    resumed = {
        n: simulate_policies(prompt_lens, y_test, *preds[n], args.cap, cost, resume=True) for n in predictors
    }
    out = {
        "command": "python bench/experiments/serve_workload.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "workload": "mixed (ecru.serve.workload)",
        "cap": args.cap,
        "labels": "one greedy sample per prompt"
        if args.samples == 1
        else f"predictors trained on the longest of {args.samples} sampled answers (T = 0, 0.3, 0.5, 0.7); "
        "scored and simulated against the greedy answers' lengths (what greedy serving generates)",
        "train_prompts": len(train),
        "test_prompts": len(test),
        "cap_hit_share_test": sum(n >= args.cap for n in y_test) / len(y_test),
        "lengths_by_form_test": per_form(test, y_test),
        "predictors": results,
        "simulated": {
            "note": "the simulator (exact token accounting, batch 16, the cost model measured in this run) "
            "on the test prompts' true lengths; each predictor's predictions and its prediction time "
            "(measured in this run) charged; throughput ratios to fcfs",
            "cost_model": dataclasses.asdict(cost),
            **simulated,
        },
        "simulated_resumed": {
            "note": "as simulated, but an FCR failure keeps the tokens it generated before its cap and is "
            "resumed (prompt + those tokens prefilled, the rest generated; PlanConfig.resume) instead of "
            "recomputed from scratch",
            **resumed,
        },
    }
    if args.json:
        atomic_write_json(args.json, out)


if __name__ == "__main__":
    main()
