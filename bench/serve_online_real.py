"""Online serving on the real engine: Poisson arrivals in wall-clock time, and the simulator on the same trace.

SmolLM2-135M-Instruct serves --requests distinct unseen test prompts of the mixed workload (drawn with
--seed from the 240 labelled ones), arriving as a Poisson stream at --load times cb's capacity (cb's
throughput on this trace in the simulator, with a cost model measured in this run; with --rate-from engine,
measured on the engine with every request waiting, prefix cache included). Each policy runs on
the request engine in real time, one after another in --order (one thread; the engine is stepped while
requests wait, idle until the next arrival otherwise); a request's latency runs from its scheduled arrival
to its last token; `busy_s_per_decode_step` shows whether the machine's speed drifted between policies:

- `cb`: first come first served, no predictor;
- `cb-sjf`: shortest MiniLM-predicted answer first (ridge on the 1,000 train labels), aged 0.1 per step;
- `cb-sjf[fcfs-slack]`: the same without aging, the longest-waiting request first once it has waited
  (1 + --slack) x the FCFS wait estimate (`EngineConfig.fcfs_slack`);
- `cb-srpt[fcfs-slack]`: `cb-sjf[fcfs-slack]`, then every 16 tokens each running row's remaining length is
  predicted again from its own last hidden state (`RemainingProbe`, fitted on the 480 cached greedy train
  answers of bench/serve_online.py), and a full batch swaps its just re-predicted rows for waiting requests
  predicted 64 tokens shorter, the swapped rows' KV kept until they rejoin (`preempt_mode` keep).

MiniLM predicts inside `add_request`, on the serving clock. The same trace (arrival times, prompt lengths,
the labels' greedy lengths, the same predictions and their measured time, the probe's re-predictions on
the cached greedy test answers) is then replayed through the online simulator (`ecru.serve.online`), so the
JSON shows the real ratios next to the simulated ones. The engine keeps its default prefix cache (the
simulator does not model it).

    OMP_NUM_THREADS=1 python bench/serve_online_real.py --json bench/results/serve_online_real.json
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ecru.cliargs import (
    ArgumentParser,
    atomic_write_json,
    non_negative_float,
    positive_float,
    positive_int,
    prepare_out_file,
)
from ecru.serve import MiniLMPredictor
from ecru.serve.cost import measure_cost_model
from ecru.serve.models import ServedModel
from ecru.serve.online import OnlineConfig, OnlineRequest, poisson_arrivals, simulate_online
from ecru.serve.packed import packed_layers
from ecru.serve.prompts import encode_chat
from ecru.serve.request_engine import EngineConfig, RequestEngine
from ecru.serve.sampling import SamplingParams
from serve_online import fit_remaining, remaining_trajectories

RESULTS = Path(__file__).parent / "results"
TRAIN_ANSWERS = 480
"""Greedy train answers the remaining-length probe is fitted on (bench/serve_online.py's full run)."""
REPREDICT_EVERY = 16
"""cb-srpt: tokens between re-predictions, on the engine and in the simulator."""


def read_labels(path: Path, cap: int) -> tuple[list[str], list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows], [min(cap, r["lengths"][0]) for r in rows]


def policies(slack: float) -> dict[str, tuple[str, dict, dict]]:
    """name -> (policy, EngineConfig and OnlineConfig overrides, OnlineConfig's alone)."""
    deadline = {"aging": 0.0, "fcfs_slack": slack}
    return {
        "cb": ("cb", {}, {}),
        "cb-sjf": ("cb-sjf", {}, {}),
        "cb-sjf[fcfs-slack]": ("cb-sjf", deadline, {}),
        "cb-srpt[fcfs-slack]": ("cb-srpt", deadline | {"preempt_mode": "keep"}, {"preempt": True}),
    }


def serve_real(served, ids, texts, arrivals, predictor, probe, config: EngineConfig, cap: int) -> dict:
    """Serve the trace on the engine in wall-clock time; latencies from each scheduled arrival."""
    remaining = probe if config.policy == "cb-srpt" else None
    engine = RequestEngine(served.model, eos_token_ids=served.eos_token_ids, pad_token_id=served.pad_token_id,
                           config=config, tokenizer=served.tokenizer, remaining=remaining)  # fmt: skip
    if config.policy != "cb":  # predicted in add_request, on the serving clock
        text_of = {tuple(i): t for i, t in zip(ids, texts, strict=True)}
        engine.predict = lambda prompt, params: predictor.predict([text_of[tuple(prompt)]])[0]
    params, reqs, start, busy = SamplingParams(max_tokens=cap), [], time.perf_counter(), 0.0
    with tqdm(total=len(ids), desc=config.policy, file=sys.stderr) as bar:
        while len(reqs) < len(ids) or engine.has_unfinished():
            now = time.perf_counter() - start
            while len(reqs) < len(ids) and arrivals[len(reqs)] <= now:
                reqs.append(engine.add_request(ids[len(reqs)], params))
            if engine.has_unfinished():
                t = time.perf_counter()
                bar.update(len(engine.step()))
                busy += time.perf_counter() - t
            else:
                time.sleep(max(0.0, arrivals[len(reqs)] - now))
    wall = time.perf_counter() - start
    lat = [r.finish_s - start - a for r, a in zip(reqs, arrivals, strict=True)]
    return {"mean_latency_s": statistics.fmean(lat), "p99_latency_s": float(np.percentile(lat, 99)),
            "max_latency_s": max(lat), "wall_s": wall, "busy_s": busy, "tokens": sum(len(r.output) for r in reqs),
            "decode_steps": engine.stats.decode_steps, "busy_s_per_decode_step": busy / engine.stats.decode_steps,
            "preemptions": engine.stats.preemptions, "peak_kv_tokens": engine.stats.peak_kv_tokens,
            "prefill_forwards": engine.stats.prefill_forwards, "latencies_s": lat,
            "outputs": [r.output for r in reqs]}  # fmt: skip


def cached_answers(path: Path) -> dict[str, list[int]]:
    """bench/serve_online.py's cached greedy answers: prompt -> answer tokens."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["prompt"]: r["tokens"] for r in rows}


def remaining_probe(served, texts: list[str], cap: int):
    """The remaining-length probe fitted on the cached greedy train answers, its re-predictions every 16
    tokens of the served prompts' cached answers (the simulator's trajectories) and seconds per row."""
    train = cached_answers(RESULTS / "serve_online_answers_train.jsonl")
    test = cached_answers(RESULTS / "serve_online_answers_test.jsonl")
    missing = [t for t in texts if t not in test]
    if missing:
        sys.exit(f"no cached answer for {len(missing)} served prompts: run bench/serve_online.py first")
    if len(train) < TRAIN_ANSWERS:
        sys.exit(
            f"{TRAIN_ANSWERS} cached train answers needed, found {len(train)}: run bench/serve_online.py"
        )
    prompts = list(train)[:TRAIN_ANSWERS]
    answers = [train[p] for p in prompts]
    probe, _ = fit_remaining(
        served.model, served.tokenizer, prompts, answers, [len(a) for a in answers], cap=cap
    )
    traj, per_row = remaining_trajectories(served.model, served.tokenizer, probe, texts, [test[t] for t in texts],
                                           every=REPREDICT_EVERY)  # fmt: skip
    return probe, traj, per_row


def merged(runs: list[dict]) -> dict:
    """One policy's runs (two with --mirror): the first run's fields with every number averaged over the
    runs, and the runs themselves (without their outputs, which must agree)."""
    if any(r["outputs"] != runs[0]["outputs"] for r in runs):
        sys.exit("greedy outputs differ between runs of one policy")
    if len(runs) == 1:
        return runs[0]
    numbers = {
        k: statistics.fmean(r[k] for r in runs) for k, v in runs[0].items() if isinstance(v, float | int)
    }
    return {**runs[0], **numbers, "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}


def ratios(results: dict) -> None:
    cb = results["cb"]
    for r in results.values():
        r["mean_latency_x_cb"] = r["mean_latency_s"] / cb["mean_latency_s"]
        r["p99_latency_x_cb"] = r["p99_latency_s"] / cb["p99_latency_s"]


def parse(argv) -> tuple:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--requests", type=positive_int, default=120, help="distinct test prompts served")
    ap.add_argument("--load", type=positive_float, default=1.2, help="arrival rate / cb's capacity")
    ap.add_argument("--slack", type=non_negative_float, default=0.15, help="fcfs_slack of cb-sjf[fcfs-slack]")
    ap.add_argument("--cap", type=positive_int, default=256, help="max new tokens (the labels' cap)")
    ap.add_argument("--seed", type=int, default=0, help="prompt draw and arrival seed")
    ap.add_argument("--rate-from", choices=("simulator", "engine"), default="simulator",
                    help="the capacity --load is relative to: cb's in the simulator, or measured on the engine "
                    "(every request waiting; the prefix cache the simulator lacks included)")  # fmt: skip
    ap.add_argument(
        "--order",
        default=None,
        help="comma-separated policies in the order they run, cb among them (default: all, cb first)",
    )
    ap.add_argument("--mirror", action="store_true",
                    help="run --order, then its reverse: each policy twice, so that a drift in the machine's "
                    "speed linear in time weighs on all alike; every figure is the mean of the two runs")  # fmt: skip
    args = ap.parse_args(argv)
    names = list(policies(args.slack))
    args.order = names if args.order is None else [p.strip() for p in args.order.split(",")]
    if len(set(args.order)) != len(args.order) or not set(args.order) <= set(names) or "cb" not in args.order:
        ap.error(f"--order: cb and any of {', '.join(names[1:])}, each once, got {','.join(args.order)!r}")
    if args.requests > 240:
        ap.error(f"--requests: at most 240 labelled test prompts, got {args.requests}")
    return args, prepare_out_file(args.json, flag="--json")


def timed_trace(ids, lengths, predicted, traj, cost, base, args, served) -> tuple[list[OnlineRequest], float]:
    """The simulator's trace of the served requests, Poisson arrivals at args.load x cb's capacity on it: in
    the simulator, or with `--rate-from engine` the engine's own (`engine_capacity`)."""
    trace = [OnlineRequest(0.0, len(i), n, p, tuple(tr))
             for i, n, p, tr in zip(ids, lengths, predicted, traj, strict=True)]  # fmt: skip
    capacity = len(trace) / simulate_online(trace, policy="cb", config=base, cost=cost).time_s
    if args.rate_from == "engine":
        capacity = engine_capacity(served, ids, args.cap)
    arrivals = poisson_arrivals(len(trace), args.load * capacity, args.seed + 1)
    return [dataclasses.replace(r, arrival_s=a) for r, a in zip(trace, arrivals, strict=True)], capacity


def engine_capacity(served, ids, cap: int) -> float:
    """cb's throughput on the engine in requests/s, every request waiting from the start."""
    engine = RequestEngine(served.model, eos_token_ids=served.eos_token_ids, pad_token_id=served.pad_token_id,
                           config=EngineConfig(max_new_tokens=cap))  # fmt: skip
    start = time.perf_counter()
    engine.generate(ids, SamplingParams(max_tokens=cap))
    return len(ids) / (time.perf_counter() - start)


def run_both(served, ids, texts, trace, predictors, cost, base, args) -> tuple[dict, dict]:
    """Each policy on the real engine (args.order), then on the simulator; latency ratios to cb's.
    `predictors`: (MiniLM, its seconds per request, the remaining probe, its seconds per row)."""
    runs, simulated, table, arrivals = {}, {}, policies(args.slack), [r.arrival_s for r in trace]
    predictor, predict_s, probe, repredict_s = predictors
    for name in args.order + (args.order[::-1] if args.mirror else []):
        policy, overrides, _ = table[name]
        config = EngineConfig(
            policy=policy, max_new_tokens=args.cap, repredict_every=REPREDICT_EVERY, **overrides
        )
        run = serve_real(served, ids, texts, arrivals, predictor, probe, config, args.cap)
        runs.setdefault(name, []).append(run)
        print(
            f"{name}: real mean {run['mean_latency_s']:.1f} s p99 {run['p99_latency_s']:.1f} s",
            file=sys.stderr,
        )
    real = {name: merged(rs) for name, rs in runs.items()}
    for name in args.order:
        policy, overrides, sim_only = table[name]
        charged = {"predict_s": predict_s} if policy != "cb" else {}
        charged |= {"repredict_s": repredict_s} if policy == "cb-srpt" else {}
        sim = simulate_online(trace, policy=policy, cost=cost,
                              config=dataclasses.replace(base, **overrides, **sim_only, **charged))  # fmt: skip
        simulated[name] = sim.to_json()
        print(f"{name}: simulated {sim.mean_latency_s:.1f} / {sim.p99_latency_s:.1f}", file=sys.stderr)
    ratios(real)
    ratios(simulated)
    return real, simulated


def main(argv=None) -> None:
    args, out_path = parse(argv)
    torch.manual_seed(0)
    started = time.perf_counter()
    train, y_train = read_labels(RESULTS / "serve_workload_labels_train.jsonl", args.cap)
    test, y_test = read_labels(RESULTS / "serve_workload_labels_test.jsonl", args.cap)
    picks = random.Random(args.seed).sample(range(len(test)), args.requests)
    texts, lengths = [test[i] for i in picks], [y_test[i] for i in picks]
    served = ServedModel.load("smollm2")
    ids = encode_chat(served.tokenizer, texts)
    predictor = MiniLMPredictor(cap=args.cap).fit(train, y_train)
    t0 = time.perf_counter()
    predicted = predictor.predict(texts)
    predict_s = (time.perf_counter() - t0) / len(texts)
    print("fitting the remaining-length probe ...", file=sys.stderr)
    probe, traj, repredict_s = remaining_probe(served, texts, args.cap)
    print("measuring the cost model ...", file=sys.stderr)
    cost = measure_cost_model(served.model, reps=3, source="SmolLM2-135M fp32, measured in this run")
    base = OnlineConfig(
        max_new_tokens=args.cap, repredict_every=REPREDICT_EVERY, token_s=cost.step_time(16, 200)
    )
    trace, capacity = timed_trace(ids, lengths, predicted, traj, cost, base, args, served)
    predictors = (predictor, predict_s, probe, repredict_s)
    real, simulated = run_both(served, ids, texts, trace, predictors, cost, base, args)
    outputs = {name: r.pop("outputs") for name, r in real.items()}
    atomic_write_json(out_path, {
        "command": "python bench/serve_online_real.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "method": "real engine (RequestEngine, SmolLM2-135M-Instruct fp32, greedy, prefix cache on) in wall-clock "
        "time; Poisson arrivals at load x cb's simulated capacity; latency from the scheduled arrival to "
        "the last token; the same trace replayed through the online simulator with the cost model measured "
        "in this run and MiniLM's measured time per request charged",
        "packed_layers": len(packed_layers(served.model)),
        "requests": len(trace), "load": args.load, "rate_from": args.rate_from, "capacity_requests_per_s": capacity,
        "arrival_rate_per_s": args.load * capacity,
        "fcfs_slack": args.slack, "order": args.order, "mirror": args.mirror, "predicted": predicted, "true_lengths": lengths,
        "predictor": {"name": "minilm", "train_labels": len(train), "predict_s_per_request": predict_s},
        "remaining_probe": {"train_answers": TRAIN_ANSWERS, "repredict_every": REPREDICT_EVERY,
                            "predict_s_per_row": repredict_s},
        "cost_model": cost.__dict__, "real": real, "simulated": simulated,
        "greedy_outputs_equal_across_policies": all(o == outputs["cb"] for o in outputs.values()),
        "answer_tokens_equal_labels": [len(o) for o in outputs["cb"]] == lengths,
        "wall_s": time.perf_counter() - started,
    })  # fmt: skip
    print(f"wrote {out_path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
