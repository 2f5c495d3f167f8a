"""Length predictors compared on the held-out prompts of a `bench/serve.py` run (its true lengths).

    OMP_NUM_THREADS=1 python bench/serve_predictors.py --bench bench/results/serve_bench.json \
        --labels bench/results/serve_labels_smollm2.jsonl --json bench/results/serve_predictors.json

Every predictor is trained on the same train-split labels (self-lora reuses the adapter the bench cached),
predicts the bench's prompts (timed), and its predictions are replayed through the simulator's static
policies on the measured lengths, next to the constant-median baseline and the oracle.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    from ecru.serve import PlanConfig, TraceRequest, length_metrics, simulate, timed_predict
    from ecru.serve.bench import BenchConfig, build_predictor
    from ecru.serve.models import load_model
    from ecru.serve.prompts import load_prompts

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default="bench/results/serve_bench.json")
    p.add_argument("--labels", default="bench/results/serve_labels_smollm2.jsonl")
    p.add_argument("--predictors", default="constant,minilm,probe,self-lora")
    p.add_argument("--lora-epochs", type=int, default=2)
    p.add_argument("--json", default="bench/results/serve_predictors.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    bench = json.loads(Path(args.bench).read_text())
    setup = bench["setup"]
    texts = load_prompts(setup["prompts"], n=setup["n"], split="test")
    true = setup["true_lengths"]
    model, tok = load_model(setup["model"])
    plan = PlanConfig(batch_size=setup["batch_size"], max_new_tokens=setup["max_new_tokens"])
    results = {}
    for name in args.predictors.split(","):
        config = BenchConfig(
            model=setup["model"],
            n=setup["n"],
            max_new_tokens=setup["max_new_tokens"],
            predictor=name,
            labels=args.labels,
            lora_epochs=args.lora_epochs,
        )
        predictor = build_predictor(model, tok, config, dict(zip(texts, true, strict=True)))
        predicted, seconds = timed_predict(predictor, texts)
        trace = [
            TraceRequest(pl, int(t), q)
            for pl, t, q in zip(setup["prompt_lens"], true, predicted, strict=True)
        ]
        base = simulate(trace, policy="fcfs", config=plan).samples_per_s
        sim = {
            pol: simulate(trace, policy=pol, config=plan, predict_s=seconds)
            for pol in ("sorted", "fcr", "fcr+vbs")
        }
        cap_hit = [t >= setup["max_new_tokens"] for t in true]
        flagged = [q >= setup["max_new_tokens"] for q in predicted]  # predicted to run to the cap
        results[name] = {
            **length_metrics(predicted, true),
            "predict_s": seconds,
            "cap_hitters_flagged": sum(a and b for a, b in zip(cap_hit, flagged, strict=True))
            / max(1, sum(cap_hit)),
            "sim_x_fcfs": {pol: s.samples_per_s / base for pol, s in sim.items()},
            "sim_failure_ratio": {pol: s.failure_ratio for pol, s in sim.items()},
        }
        r = results[name]
        print(
            f"{name:>10}: MAE {r['mae']:6.1f} Acc-50 {r['acc50']:.2f} Acc-100 {r['acc100']:.2f} "
            f"{seconds:6.1f} s  cap-hitters flagged {r['cap_hitters_flagged']:.2f}  sim x fcfs "
            + " ".join(f"{k} {v:.2f}" for k, v in r["sim_x_fcfs"].items())
        )
    oracle = simulate(
        [TraceRequest(pl, int(t), t) for pl, t in zip(setup["prompt_lens"], true, strict=True)],
        policy="oracle",
        config=plan,
    )
    trace0 = [TraceRequest(pl, int(t)) for pl, t in zip(setup["prompt_lens"], true, strict=True)]
    results["oracle_sim_x_fcfs"] = (
        oracle.samples_per_s / simulate(trace0, policy="fcfs", config=plan).samples_per_s
    )
    print(f"oracle sim x fcfs {results['oracle_sim_x_fcfs']:.2f}")
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
