"""How much bench/serve_online.py's load-1.2 results with a prompt-only predictor depend on the arrival draw.

Replays the measurements a serve_online JSON holds (true lengths, prompt lengths, a prompt-only predictor's
predictions, --predictor, MiniLM's by default, and its measured time, the remaining-length probe's
re-predictions and their time, the cost model) through the online simulator for --seeds draws of the
--requests (3,000) resampled requests and their Poisson arrivals at load 1.2: cb, cb-sjf with aging 0.1 and
cb-sjf with the FCFS deadline at each --slacks value, and cb-srpt (re-prediction, preemption with the
default margin) with the deadline at each --slacks value, its preempted rows either prefilled again
(`preempt_mode` recompute) or keeping their KV (keep, the engine's cb-srpt default); latency ratios to cb
per seed, their mean and standard deviation.
--cost-from replays with another JSON's cost model (for instance a run on a faster machine, or with
--cost-key engine_cost_model the one bench/serve_online_real.py fitted on the real engine's steps), all
else unchanged. No model runs: seconds.

    python bench/experiments/serve_online_seeds.py --json bench/results/serve_online_seeds.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from ecru.cliargs import ArgumentParser, existing_file, non_negative_float, positive_int, prepare_out_file
from ecru.io import atomic_write_json
from ecru.serve.sched.names import PREEMPT_MODES
from ecru.serve.sched.scheduler import EngineConfig
from ecru.serve.sim.cost import CostModel
from ecru.serve.sim.simulator import poisson_arrivals, simulate_online, simulate_policy

BENCH = Path(__file__).resolve().parents[1]  # bench/: the product benchmark this study builds on
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))
from serve_online import build_trace, resample, saturated_capacity  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"


def ratios_over_seeds(
    data: dict,
    cost: CostModel,
    predict_s: float,
    configs: dict,
    seeds: int,
    predictor: str = "minilm",
    requests: int = 3000,
) -> dict:
    """name -> per-seed (mean, p99) latency over cb's, and their mean, std, min and max; `configs`: name ->
    (policy, EngineConfig overrides); cap and re-prediction interval as `data` (a serve_online JSON) ran;
    the prompt-only predictions are `predictor`'s; `requests` resampled per trace."""
    pp, run = data["per_prompt"], data["config"]
    lens, plens, pred = pp["true_lengths"], pp["prompt_lens"], pp["predicted"][predictor]
    traj = pp["remaining_trajectories"]
    base = EngineConfig(max_new_tokens=run["max_new_tokens"], repredict_every=run["repredict_every"])
    per = {name: [] for name in configs}
    for seed in range(seeds):
        idx = resample(len(lens), requests, seed)
        rate = 1.2 * saturated_capacity(idx, plens, lens, base, cost)
        trace = build_trace(idx, poisson_arrivals(len(idx), rate, seed + 1), plens, lens, pred, traj)
        cb = simulate_online(trace, policy="cb", config=base, cost=cost)
        for name, (policy, overrides) in configs.items():
            r = simulate_policy(trace, policy, base, cost, {"predict_s": predict_s, **overrides})
            per[name].append((r.mean_latency_s / cb.mean_latency_s, r.p99_latency_s / cb.p99_latency_s,
                              r.peak_kv_tokens, r.preemptions))  # fmt: skip
    return {name: summary(rows) for name, rows in per.items()}


def summary(rows: list[tuple[float, float, int, int]]) -> dict:
    means, p99s, kv, pre = ([r[k] for r in rows] for k in range(4))
    return {"per_seed_mean_x_cb": means, "per_seed_p99_x_cb": p99s, "mean_x_cb": statistics.fmean(means),
            "mean_x_cb_std": statistics.stdev(means), "mean_x_cb_max": max(means),
            "p99_x_cb_mean": statistics.fmean(p99s), "p99_x_cb_max": max(p99s),
            "peak_kv_tokens_max": max(kv), "preemptions_mean": statistics.fmean(pre)}  # fmt: skip


def main(argv=None) -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--from", dest="source", type=existing_file, default=RESULTS / "serve_online.json",
                    help="a bench/serve_online.py JSON")  # fmt: skip
    ap.add_argument(
        "--cost-from", type=existing_file, default=None, help="take the cost model from this JSON"
    )
    ap.add_argument("--cost-key", default="cost_model",
                    help="the cost model's key in --cost-from (bench/serve_online_real.py also writes "
                    "engine_cost_model, fitted on the engine's own steps)")  # fmt: skip
    ap.add_argument("--predictor", default="minilm",
                    help="the prompt-only predictor whose predictions are replayed (a name in the --from JSON's "
                    "predictors: minilm, embed, probe, ...)")  # fmt: skip
    ap.add_argument("--predict-s", type=non_negative_float, default=None,
                    help="the predictor's seconds per request to charge (default: the --from JSON's; its MiniLM "
                    "was timed in batches, which the engine pays one text per call: see serve_online_real.py's "
                    "JSON)")  # fmt: skip
    ap.add_argument("--seeds", type=positive_int, default=6, help="arrival draws (seeds 0 .. N-1)")
    ap.add_argument("--requests", type=positive_int, default=3000,
                    help="requests per trace (at load 1.2 the backlog, and what reordering gains, grows with it)")  # fmt: skip
    ap.add_argument("--slacks", default="0.1,0.15,0.2", help="comma-separated fcfs_slack values")
    args = ap.parse_args(argv)
    out_path = prepare_out_file(args.json, flag="--json")
    data = json.loads(Path(args.source).read_text())
    cost_source = json.loads(Path(args.cost_from).read_text()) if args.cost_from else data
    try:
        cost = CostModel(**cost_source[args.cost_key])
    except (KeyError, TypeError, AttributeError):
        ap.error(f"--cost-key: no cost model {args.cost_key!r} in {args.cost_from or args.source}")
    slacks = [float(s) for s in args.slacks.split(",")]
    if args.predictor not in data["per_prompt"]["predicted"]:
        ap.error(f"--predictor: no predictions {args.predictor!r} in {args.source} (it has "
                 f"{', '.join(data['per_prompt']['predicted'])})")  # fmt: skip
    predict_s = (
        data["predictors"][args.predictor]["predict_s_per_request"]
        if args.predict_s is None
        else args.predict_s
    )
    repredict_s = data["predictors"]["remaining-probe"]["predict_s_per_row"]
    configs = {"aging 0.1": ("cb-sjf", {})}
    configs |= {f"fcfs_slack {s:g}": ("cb-sjf", {"aging": 0.0, "fcfs_slack": s}) for s in slacks}
    for mode in PREEMPT_MODES:
        srpt = {"repredict_s": repredict_s, "preempt_mode": mode, "aging": 0.0}
        configs |= {f"cb-srpt {mode} fcfs_slack {s:g}": ("cb-srpt", srpt | {"fcfs_slack": s}) for s in slacks}
    result = ratios_over_seeds(data, cost, predict_s, configs, args.seeds, args.predictor, args.requests)
    for name, r in result.items():
        print(f"{name:>30}: mean x cb {r['mean_x_cb']:.3f} ± {r['mean_x_cb_std']:.3f} (max {r['mean_x_cb_max']:.3f}),"
              f" p99 x cb {r['p99_x_cb_mean']:.3f} (max {r['p99_x_cb_max']:.3f})")  # fmt: skip
    atomic_write_json(out_path, {
        "command": "python bench/experiments/serve_online_seeds.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "source": str(args.source), "cost_model_from": str(args.cost_from or args.source), "cost_key": args.cost_key,
        "cost_model": cost.__dict__, "load": 1.2, "requests": args.requests, "predictor": args.predictor,
        "predict_s_per_request": predict_s, "repredict_s_per_row": repredict_s, "seeds": args.seeds,
        "names": "cb-sjf unless named; cb-srpt: re-prediction, preemption (margin 64), preempt_mode as named",
        "policies": result,
    })  # fmt: skip


if __name__ == "__main__":
    main()
