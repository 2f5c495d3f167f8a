"""Where cb-kv's gain comes from: the length predictor, or reserving anything below the cap?

    OMP_NUM_THREADS=1 python bench/experiments/serve_kv.py --bench bench/results/serve_bench_target.json \
        --cost-model bench/results/serve_cost_cpu.json --json bench/results/serve_kv.json

Replays a `bench/serve.py` run's true lengths (and its predictor's lengths) through continuous batching in
the simulator: `cb` (batch_size rows) and `cb-kv` (the KV memory of batch_size rows reserving the cap,
shared by reservations) with reservations from the bench's predictor, from the true lengths, from one
constant for every request (several values), and from the cap (cb's reservation: the same budget then holds
batch_size rows of the longest prompt, a few more of shorter ones). If a constant does
as well as the predictor, the gain is memory admission (more rows in the same memory), not prediction.
No model runs; seconds of CPU. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from ecru.io import atomic_write_json


def replay(setup: dict, reservations: dict[str, list[float]], cost) -> dict[str, dict[str, float]]:
    """x fcfs throughput, x cb mean latency and preemptions of cb-kv per reservation rule (and of cb)."""
    from ecru.serve import PlanConfig, TraceRequest, make_queue, simulate, simulate_continuous
    from ecru.serve.sched.policies import continuous_config

    trace = [
        TraceRequest(p, int(t)) for p, t in zip(setup["prompt_lens"], setup["true_lengths"], strict=True)
    ]
    plan = PlanConfig(batch_size=setup["batch_size"], max_new_tokens=setup["max_new_tokens"])
    fcfs = simulate(trace, policy="fcfs", config=plan, cost=cost)
    cb, _ = simulate_continuous(
        trace, queue=make_queue("cb"), config=continuous_config("cb", plan, setup["prompt_lens"]), cost=cost
    )
    out = {"cb": {"x_fcfs": fcfs.time_s / cb.time_s, "latency_x_cb": 1.0, "preemptions": 0}}
    # the same rows without any reservation: cb with twice the batch size (what unbounded memory allows)
    wide = replace(continuous_config("cb", plan, setup["prompt_lens"]), max_batch_size=2 * plan.batch_size)
    r, _ = simulate_continuous(trace, queue=make_queue("cb"), config=wide, cost=cost)
    out[f"cb, {2 * plan.batch_size} rows"] = {
        "x_fcfs": fcfs.time_s / r.time_s,
        "latency_x_cb": r.mean_latency_s / cb.mean_latency_s,
        "preemptions": 0,
    }
    config = continuous_config("cb-kv", plan, setup["prompt_lens"])
    for name, reserve in reservations.items():
        r, _ = simulate_continuous(
            trace, queue=make_queue("cb-kv"), config=config, cost=cost, reserve=reserve
        )
        out[name] = {
            "x_fcfs": fcfs.time_s / r.time_s,
            "latency_x_cb": r.mean_latency_s / cb.mean_latency_s,
            "preemptions": r.failures,
        }
    return out


def reservation_rules(setup: dict, constants: list[int]) -> dict[str, list[float]]:
    n, cap = len(setup["true_lengths"]), setup["max_new_tokens"]
    rules = {
        "cb-kv predictor": list(setup["predicted_lengths"]),
        "cb-kv true lengths": [float(t) for t in setup["true_lengths"]],
    }
    rules |= {f"cb-kv constant {c}": [float(c)] * n for c in constants}
    rules[f"cb-kv cap {cap}"] = [
        float(cap)
    ] * n  # cb's reservation; prompts shorter than the longest fit a few more rows
    return rules


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="bench/results/serve_bench_target.json")
    ap.add_argument(
        "--cost-model", default=None, help="cost model JSON (default: SmolLM2 on 1 quiet CPU thread)"
    )
    ap.add_argument("--constants", default="32,64,96,128,192")
    ap.add_argument("--json", default="bench/results/serve_kv.json")
    args = ap.parse_args(argv)

    from ecru.serve import SMOLLM2_CPU, CostModel

    setup = json.loads(Path(args.bench).read_text())["setup"]
    cost = CostModel.load(args.cost_model) if args.cost_model else SMOLLM2_CPU
    rules = reservation_rules(setup, [int(c) for c in args.constants.split(",")])
    rows = replay(setup, rules, cost)
    print(
        f"{setup['n']} requests, batch {setup['batch_size']}, cap {setup['max_new_tokens']}, cost: {cost.source}"
    )
    print(f"{'rule':>26} {'x fcfs':>7} {'lat x cb':>8} {'preempted':>9}")
    for name, r in rows.items():
        print(f"{name:>26} {r['x_fcfs']:7.3f} {r['latency_x_cb']:8.3f} {r['preemptions']:9d}")
    out = {
        "bench": args.bench,
        "cost_model": cost.source,
        "rows": rows,
        "command": " ".join(
            ["python", *(sys.argv if argv is None else ["bench/experiments/serve_kv.py", *argv])]
        ),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.json, out)
    print("wrote", args.json)


if __name__ == "__main__":
    main()
