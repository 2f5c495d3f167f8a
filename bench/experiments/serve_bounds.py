"""What scheduling can gain on a measured length distribution, and how good a length predictor must be.

    OMP_NUM_THREADS=1 python bench/experiments/serve_bounds.py --labels bench/results/serve_labels_smollm2.jsonl \
        --max-new-tokens 256 --cost-model bench/results/serve_cost_cpu.json --json bench/results/serve_bounds.json

Replays the true response lengths through the simulator (static policies and continuous batching, the
same admission rule as the real loop) and asks three questions:
1. Bounds with perfect knowledge: the oracle static schedule and continuous batching against fcfs
   (throughput), and oracle shortest-first admission against FCFS admission (mean latency). With every
   request present at t=0 and each occupying one of B identical slots per step, admitting the shortest
   first into every slot as soon as it frees (SPT list scheduling) minimises the mean completion time,
   preemptive schedules included (a classical result of scheduling theory): with `--cost-model unit`
   (time = decode steps) `spt_latency_x_cb` is a lower bound for every admission policy; with a
   measured cost model (step time grows with rows and context) it is the same schedule, timed.
2. Predictor quality needed: synthetic calibrated predictors whose rank correlation with the true
   lengths is rho (a Gaussian copula mapped onto the measured length distribution), rho from 0 to 1,
   through `sorted`, `fcr`, `cb-sjf` and `cb-ljf` (longest predicted first: for throughput);
   medians over `--seeds` draws and arrival orders.
3. The arrival order: fcfs and cb depend on it, so every number is a median over `--seeds` shuffles.
Prints a table, writes JSON and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

from ecru.io import atomic_write_json


def load_trace(args) -> tuple[list[int], list[int], str]:
    """(prompt_lens, output_lens, source) from a bench run's JSON, a trace JSONL or a labels file (tokenised
    here)."""
    if args.bench:
        setup = json.loads(Path(args.bench).read_text())["setup"]
        return list(setup["prompt_lens"]), list(setup["true_lengths"]), args.bench
    if args.trace:
        from ecru.serve import read_trace

        trace = read_trace(args.trace)
        return [r.prompt_len for r in trace], [r.output_len for r in trace], args.trace
    from ecru.models import load_smollm2
    from ecru.serve import read_labels
    from ecru.serve.prompts import encode_chat

    labels = read_labels(args.labels)
    if not labels:
        raise SystemExit(f"no labels in {args.labels}; make them with `ecru serve label` (see its --help)")
    _, tokenizer = load_smollm2()
    ids = encode_chat(tokenizer, [r.prompt for r in labels])
    return [len(p) for p in ids], [max(r.lengths) for r in labels], args.labels


def calibrated_predictions(lengths: np.ndarray, rho: float, rng: np.random.Generator) -> np.ndarray:
    """Predictions with Spearman-like correlation ~rho to `lengths` and the same marginal distribution.

    z = rho * (normal score of the true rank) + sqrt(1 - rho^2) * noise; the prediction of the request
    ranked k-th by z is the k-th smallest true length. Ties among true lengths are broken at random.
    """
    n = len(lengths)
    order = np.lexsort((rng.random(n), lengths))
    score = np.empty(n)
    score[order] = np.arange(n)
    inv = statistics.NormalDist().inv_cdf
    truth = np.array([inv((k + 0.5) / n) for k in score])
    z = rho * truth + math.sqrt(max(0.0, 1 - rho * rho)) * rng.standard_normal(n)
    pred = np.empty(n)
    pred[np.argsort(z, kind="stable")] = np.sort(lengths)
    return pred


def run_all(
    prompt_lens, lengths, predicted, *, batch_size: int, cap: int, cost, aging: float, refill_min: int
):
    """Samples/s and mean latency of the static and continuous policies for one arrival order."""
    from ecru.serve import (
        EngineConfig,
        FCFSQueue,
        PlanConfig,
        SJFQueue,
        TraceRequest,
        make_queue,
        simulate,
        simulate_continuous,
    )

    trace = [
        TraceRequest(p, int(t), float(q)) for p, t, q in zip(prompt_lens, lengths, predicted, strict=True)
    ]
    plan = PlanConfig(batch_size=batch_size, max_new_tokens=cap)
    out = {}
    for policy in ("fcfs", "sorted", "fcr", "oracle"):
        r = simulate(trace, policy=policy, config=plan, cost=cost)
        out[policy] = (r.samples_per_s, r.mean_latency_s, r.effective_token_ratio)
    cb = EngineConfig(max_batch_size=batch_size, max_new_tokens=cap, refill_min=refill_min)
    spt = EngineConfig(max_batch_size=batch_size, max_new_tokens=cap, refill_min=1)
    runs = {
        "cb": (FCFSQueue(), cb),
        "cb-sjf": (SJFQueue(list(predicted), aging=aging), cb),
        "cb-ljf": (make_queue("cb-ljf", list(predicted), aging=aging), cb),
        # shortest true length first, a free row refilled at once: the optimal schedule for mean latency
        "cb-sjf oracle": (SJFQueue([float(t) for t in lengths], aging=0.0), spt),
    }
    for name, (queue, config) in runs.items():
        r, _ = simulate_continuous(trace, queue=queue, config=config, cost=cost)
        out[name] = (r.samples_per_s, r.mean_latency_s, r.effective_token_ratio)
    return out


def online_study(prompt_lens, lengths, *, loads, rhos, seeds: int, batch_size: int, cap: int, cost,
                 agings) -> dict:  # fmt: skip
    """Requests arriving over time (Poisson, in decode steps) at `load` x what `batch_size` full rows serve
    (batch_size / mean length per step): cb-sjf's mean latency over cb's, median over `seeds` arrival draws,
    per aging, load and predictor rank correlation rho. Every free row is refilled at once (refill_min 1)."""
    from ecru.serve import EngineConfig, FCFSQueue, SJFQueue, TraceRequest, simulate_continuous

    arr = np.asarray(lengths, dtype=float)
    config = EngineConfig(max_batch_size=batch_size, max_new_tokens=cap, refill_min=1)
    out: dict = {}
    for aging in agings:
        for load in loads:
            row = {}
            for rho in rhos:
                ratios = []
                for seed in range(seeds):
                    rng = np.random.default_rng([seed, int(load * 1000), int(rho * 1000)])
                    gaps = rng.exponential(arr.mean() / (load * batch_size), len(arr))
                    arrivals = np.floor(np.cumsum(gaps)).astype(int).tolist()
                    pred = calibrated_predictions(arr, rho, rng)
                    trace = [
                        TraceRequest(p, int(t), float(q))
                        for p, t, q in zip(prompt_lens, arr, pred, strict=True)
                    ]
                    cb, _ = simulate_continuous(
                        trace, queue=FCFSQueue(), config=config, cost=cost, arrivals=arrivals
                    )
                    sjf, _ = simulate_continuous(trace, queue=SJFQueue(list(pred), aging=aging), config=config,
                                                 cost=cost, arrivals=arrivals)  # fmt: skip
                    ratios.append(sjf.mean_latency_s / cb.mean_latency_s)
                row[str(rho)] = statistics.median(ratios)
            out.setdefault(str(aging), {})[str(load)] = row
            print(f"online, aging {aging:g}, load {load:g}: cb-sjf mean latency x cb by rho "
                  + "  ".join(f"{k}: {v:.2f}" for k, v in row.items()), flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--labels", default="bench/results/serve_labels_smollm2.jsonl")
    src.add_argument("--trace", default=None, help="JSONL lines {prompt_len, output_len} instead of labels")
    src.add_argument("--bench", default=None, help="a bench/serve.py JSON: its prompt and true lengths")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument(
        "--cost-model",
        default=None,
        help="cost model JSON, or 'unit' (1 s per decode step, free prefill: step counts); "
        "default: SmolLM2 on 1 quiet CPU thread",
    )
    ap.add_argument("--aging", type=float, default=0.5, help="cb-sjf aging (the bench's default)")
    ap.add_argument("--refill-min", type=int, default=4, help="cb admission threshold (the bench's default)")
    ap.add_argument("--rhos", default="0,0.2,0.4,0.6,0.7,0.8,0.9,0.95,1")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--json", default="bench/results/serve_bounds.json")
    ap.add_argument(
        "--loads",
        default=None,
        help="also requests arriving over time at these loads (x the rows' capacity), e.g. 0.9,1,1.2,1.5,2; "
        "rho 1, 0.7 and 0, at most 5 arrival draws each",
    )
    args = ap.parse_args(argv)

    from ecru.serve import SMOLLM2_CPU, CostModel

    t0 = time.perf_counter()
    if args.cost_model == "unit":
        cost = CostModel(1.0, 0.0, 0.0, 0.0, 0.0, source="unit: 1 s per decode step, free prefill")
    else:
        cost = CostModel.load(args.cost_model) if args.cost_model else SMOLLM2_CPU
    prompt_lens, lengths, source = load_trace(args)
    cap = args.max_new_tokens
    lengths = [min(t, cap) for t in lengths]
    arr = np.asarray(lengths, dtype=float)
    rhos = [float(x) for x in args.rhos.split(",")]
    rows: dict[float, list[dict]] = {rho: [] for rho in rhos}
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        perm = rng.permutation(len(lengths))  # arrival order
        pl, ln = [prompt_lens[i] for i in perm], arr[perm]
        for rho in rhos:
            pred = calibrated_predictions(ln, rho, np.random.default_rng([seed, int(rho * 1000)]))
            r = run_all(
                pl, ln, pred, batch_size=args.batch_size, cap=cap, cost=cost, aging=args.aging,
                refill_min=args.refill_min,
            )  # fmt: skip
            rows[rho].append(
                {
                    "sorted_x_fcfs": r["sorted"][0] / r["fcfs"][0],
                    "fcr_x_fcfs": r["fcr"][0] / r["fcfs"][0],
                    "oracle_x_fcfs": r["oracle"][0] / r["fcfs"][0],
                    "cb_x_fcfs": r["cb"][0] / r["fcfs"][0],
                    "cb_sjf_x_fcfs": r["cb-sjf"][0] / r["fcfs"][0],
                    "cb_ljf_x_fcfs": r["cb-ljf"][0] / r["fcfs"][0],
                    "cb_sjf_latency_x_cb": r["cb-sjf"][1] / r["cb"][1],
                    "spt_latency_x_cb": r["cb-sjf oracle"][1] / r["cb"][1],
                    "fcfs_effective_token_ratio": r["fcfs"][2],
                    "oracle_effective_token_ratio": r["oracle"][2],
                }
            )
    sweep = {
        str(rho): {k: statistics.median(row[k] for row in rows[rho]) for k in rows[rho][0]} for rho in rhos
    }
    any_rho = sweep[str(rhos[0])]
    bounds = {
        "oracle_x_fcfs": any_rho["oracle_x_fcfs"],
        "cb_x_fcfs": any_rho["cb_x_fcfs"],
        "spt_latency_x_cb": any_rho["spt_latency_x_cb"],
        "fcfs_effective_token_ratio": any_rho["fcfs_effective_token_ratio"],
        "oracle_effective_token_ratio": any_rho["oracle_effective_token_ratio"],
        "targets": {"x_fcfs": 1.5, "share_of_oracle_gain": 0.85, "cb_sjf_latency_x_cb": 0.6},
    }
    gain = bounds["oracle_x_fcfs"] - 1

    def needed(key: str, ok) -> float | None:
        """Smallest rho in the sweep whose median meets `ok`."""
        return next((rho for rho in rhos if ok(sweep[str(rho)][key])), None)

    result = {
        "config": {
            "source": source,
            "requests": len(lengths),
            "max_new_tokens": cap,
            "batch_size": args.batch_size,
            "aging": args.aging,
            "refill_min": args.refill_min,
            "seeds": args.seeds,
            "cost_model": cost.source,
            "mean_length": float(arr.mean()),
            "median_length": float(np.median(arr)),
            "cap_share": float((arr >= cap).mean()),
            "command": "python bench/experiments/serve_bounds.py "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
            "wall_s": time.perf_counter() - t0,
        },
        "bounds": bounds,
        "sweep": sweep,
        "rho_needed": {
            "fcr_85pct_of_oracle_gain": needed("fcr_x_fcfs", lambda x: x - 1 >= 0.85 * gain),
            "sorted_85pct_of_oracle_gain": needed("sorted_x_fcfs", lambda x: x - 1 >= 0.85 * gain),
            "fcr_1.5x_fcfs": needed("fcr_x_fcfs", lambda x: x >= 1.5),
            "cb_sjf_latency_0.6x_cb": needed("cb_sjf_latency_x_cb", lambda x: x <= 0.6),
            "cb_ljf_85pct_of_oracle_gain_and_above_cb": needed(
                "cb_ljf_x_fcfs", lambda x: x - 1 >= 0.85 * gain and x > bounds["cb_x_fcfs"]
            ),
        },
    }
    print(
        f"{len(lengths)} requests, cap {cap}, batch {args.batch_size}: mean length {arr.mean():.1f}, "
        f"median {np.median(arr):.0f}, {100 * result['config']['cap_share']:.1f}% at the cap; "
        f"medians over {args.seeds} arrival orders"
    )
    print(
        f"bounds: oracle static {bounds['oracle_x_fcfs']:.2f}x fcfs, cb {bounds['cb_x_fcfs']:.2f}x fcfs, "
        f"shortest-first with perfect lengths: mean latency {bounds['spt_latency_x_cb']:.2f}x cb"
    )
    print("| rho | sorted x fcfs | fcr x fcfs | cb-sjf x fcfs | cb-ljf x fcfs | cb-sjf latency x cb |")
    print("|---|---|---|---|---|---|")
    for rho in rhos:
        s = sweep[str(rho)]
        print(
            f"| {rho:g} | {s['sorted_x_fcfs']:.2f} | {s['fcr_x_fcfs']:.2f} | {s['cb_sjf_x_fcfs']:.2f} | "
            f"{s['cb_ljf_x_fcfs']:.2f} | "
            f"{s['cb_sjf_latency_x_cb']:.2f} |"
        )
    print("rho needed:", json.dumps(result["rho_needed"]))
    if args.loads:
        result["online"] = online_study(
            prompt_lens, lengths, loads=[float(x) for x in args.loads.split(",")], rhos=[1.0, 0.7, 0.0],
            seeds=min(args.seeds, 5), batch_size=args.batch_size, cap=cap, cost=cost, agings=sorted({args.aging, 0.0}),
        )  # fmt: skip
        result["config"]["wall_s"] = time.perf_counter() - t0
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, result)
    plot(result, rhos, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(result: dict, rhos: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep, b = result["sweep"], result["bounds"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    curves = (
        ("sorted_x_fcfs", "sorted"),
        ("fcr_x_fcfs", "fcr"),
        ("cb_sjf_x_fcfs", "cb-sjf"),
        ("cb_ljf_x_fcfs", "cb-ljf"),
    )
    for key, label in curves:
        ax1.plot(rhos, [sweep[str(r)][key] for r in rhos], marker="o", label=label)
    ax1.axhline(b["oracle_x_fcfs"], ls="--", c="k", label="oracle static")
    ax1.axhline(b["cb_x_fcfs"], ls=":", c="g", label="cb (no predictor)")
    ax1.axhline(1.5, ls="-.", c="r", label="target 1.5x")
    ax1.set(xlabel="predictor rank correlation rho", ylabel="samples/s x fcfs (modelled)")
    ax1.legend(fontsize=8)
    ax2.plot(rhos, [sweep[str(r)]["cb_sjf_latency_x_cb"] for r in rhos], marker="o", label="cb-sjf")
    ax2.axhline(b["spt_latency_x_cb"], ls="--", c="k", label="shortest true length first, refill at once")
    ax2.axhline(0.6, ls="-.", c="r", label="target 0.6x")
    ax2.set(xlabel="predictor rank correlation rho", ylabel="mean latency x cb (modelled)")
    ax2.legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(
        f"{cfg['requests']} measured lengths, cap {cfg['max_new_tokens']}, batch {cfg['batch_size']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
