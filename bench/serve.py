"""Sequence-scheduling benchmark: every policy for real on held-out prompts, plus the simulator's view.

    OMP_NUM_THREADS=1 python bench/serve.py --model smollm2 --n 64 --max-new-tokens 128 --repeats 3 \
        --predictor probe --labels bench/results/serve_labels_smollm2.jsonl --json bench/results/serve_bench.json

Every policy runs `--repeats` times in a rotated order (machine load drifts between runs); the table shows
per-policy medians and the median of the per-repetition ratios to fcfs. Prints the policy table, replays the measured lengths through the simulator (same lengths, cost model of
this machine if given) to compare effective token ratios and throughput ratios, writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def simulate_measured(result: dict, *, cost_path: str | None) -> dict:
    """The simulator on the bench's own lengths: effective ratio and samples/s ratio per policy run."""
    from ecru.serve import (
        SMOLLM2_CPU,
        CostModel,
        PlanConfig,
        TraceRequest,
        make_queue,
        simulate,
        simulate_continuous,
    )
    from ecru.serve.runner import continuous_config, reservations

    setup = result["setup"]
    cost = CostModel.load(cost_path) if cost_path else SMOLLM2_CPU
    trace = [
        TraceRequest(p, int(t), q)
        for p, t, q in zip(
            setup["prompt_lens"], setup["true_lengths"], setup["predicted_lengths"], strict=True
        )
    ]
    config = PlanConfig(
        batch_size=setup["batch_size"],
        max_new_tokens=setup["max_new_tokens"],
        resume=setup.get("resume_failures", False),  # older results: reruns from scratch
        keep_kv=setup.get("keep_kv", False),
    )
    predict_s = result["predictor"]["predict_s"]
    # one scalar calibration: the cost model's shape, scaled so that fcfs takes its measured wall time
    fcfs_s = simulate(trace, policy="fcfs", config=config, cost=cost).time_s
    cost = cost.scaled(result["policies"]["fcfs"]["wall_s"] / fcfs_s)
    out = {}
    for policy in ("fcfs", "sorted", "fcr", "fcr+vbs", "oracle", "cb", "cb-sjf", "cb-ljf", "cb-kv"):
        if policy not in result["policies"]:
            continue
        charged = predict_s if policy not in ("fcfs", "oracle", "cb") else 0.0
        if policy.startswith("cb"):
            predicted = setup["predicted_lengths"]
            queue = make_queue(policy, predicted, aging=setup.get("aging", 0.5))
            continuous = continuous_config(policy, config, setup["prompt_lens"])
            sim, _ = simulate_continuous(
                trace,
                queue=queue,
                config=continuous,
                cost=cost,
                predict_s=charged,
                reserve=reservations(policy, predicted),
            )
        else:
            sim = simulate(trace, policy=policy, config=config, cost=cost, predict_s=charged)
        out[policy] = {
            "effective_token_ratio": sim.effective_token_ratio,
            "samples_per_s": sim.samples_per_s,
            "failure_ratio": sim.failure_ratio,
        }
    base_sim, base_real = out["fcfs"]["samples_per_s"], result["policies"]["fcfs"]["samples_per_s"]
    for policy, sim in out.items():
        real = result["policies"][policy]
        sim["speedup"] = sim["samples_per_s"] / base_sim
        sim["measured_speedup"] = real.get("speedup_vs_fcfs", real["samples_per_s"] / base_real)
        sim["measured_effective_token_ratio"] = real["effective_token_ratio"]
    return {"cost_model": cost.source, "policies": out}


def plot(result: dict, path: Path) -> None:
    from ecru.demo.plots import new_figure, save

    pol = result["policies"]
    names = list(pol)
    fig, (ax1, ax2) = new_figure(width=10, height=3.5, ncols=2)
    mid = [pol[n]["speedup_vs_fcfs"] for n in names]
    spread = [  # the range of the paired per-repetition ratios around their median
        [m - min(pol[n]["speedup_vs_fcfs_runs"]) for n, m in zip(names, mid, strict=True)],
        [max(pol[n]["speedup_vs_fcfs_runs"]) - m for n, m in zip(names, mid, strict=True)],
    ]
    ax1.bar(names, mid, yerr=spread, capsize=3, color="tab:blue")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set(ylabel="samples/s relative to fcfs", title="throughput (prediction time included)")
    ax2.bar(names, [result["policies"][n]["mean_latency_s"] for n in names], color="tab:orange")
    ax2.set(ylabel="mean latency (s)", title="latency")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    save(fig, path)


def main() -> None:
    from ecru.serve.bench import PREDICTORS, BenchConfig, format_bench, run_bench
    from ecru.serve.runner import POLICIES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    p.add_argument("--prompts", default="mixed")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--predictor", default="probe", choices=PREDICTORS)
    p.add_argument("--labels", default=None)
    p.add_argument("--train-n", type=int, default=256)
    p.add_argument("--lora-epochs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="repetitions per policy, in rotated order")
    p.add_argument("--cost-model", default=None, help="cost model JSON for the simulator comparison")
    p.add_argument("--json", default="bench/results/serve_bench.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    config = BenchConfig(
        model=args.model,
        prompts=args.prompts,
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        policies=tuple(args.policies.split(",")),
        predictor=args.predictor,
        labels=args.labels,
        train_n=args.train_n,
        lora_epochs=args.lora_epochs,
        repeats=args.repeats,
    )
    start = time.perf_counter()
    result = run_bench(config)
    result["simulator"] = simulate_measured(result, cost_path=args.cost_model)
    result["setup"]["bench_wall_s"] = time.perf_counter() - start
    result["setup"]["host_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("\n" + format_bench(result))
    print(f"\nsimulator ({result['simulator']['cost_model']}) on the same lengths:")
    for name, s in result["simulator"]["policies"].items():
        print(
            f"{name:>8} eff {s['effective_token_ratio']:.3f} (measured {s['measured_effective_token_ratio']:.3f})  "
            f"x fcfs {s['speedup']:.2f} (measured {s['measured_speedup']:.2f})"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
