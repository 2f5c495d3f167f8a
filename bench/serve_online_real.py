"""Online serving on the real engine: Poisson arrivals in wall-clock time, and the simulator on the same trace.

SmolLM2-135M-Instruct serves --requests unseen test prompts of the mixed workload (drawn with --seed from
the 240 labelled ones, distinct up to 240, then drawn again), arriving as a Poisson stream at --load times
cb's capacity (cb's throughput on this trace in the simulator, with a cost model measured in this run; with
--rate-from engine, measured on the engine with every request waiting, prefix cache included, on the
first 240 requests). Each policy runs on the request
engine in real time (one thread; the engine is stepped while requests wait, idle until the next arrival
otherwise), one after another in --order (with --mirror, then in the reverse order), or with --concurrent
all at the same time, one process each, so that a drift in the machine's speed weighs on all alike (the
capacity then measured likewise). --repeats K runs K rounds, each with its own arrival draw. A request's
latency runs from its scheduled arrival to its last token; `busy_s_per_decode_step` shows whether the
machine's speed drifted between policies:

- `cb`: first come first served, no predictor;
- `cb-sjf`: shortest predicted answer first (--predictor: ridge on MiniLM's sentence embeddings, or on the
  mean of SmolLM2's own input-embedding rows over the prompt, `EmbeddingPredictor`; fitted on the 1,000
  train labels), aged 0.1 per step;
- `cb-sjf[fcfs-slack]`: the same without aging, the longest-waiting request first once it has waited
  (1 + --slack) x the FCFS wait estimate (`EngineConfig.fcfs_slack`);
- `cb-srpt[fcfs-slack]`: `cb-sjf[fcfs-slack]`, then every 16 tokens each running row's remaining length is
  predicted again from its own last hidden state (`RemainingProbe`, fitted on the 480 cached greedy train
  answers of bench/serve_online.py), and a full batch swaps its just re-predicted rows for waiting requests
  predicted 64 tokens shorter, the swapped rows' KV kept until they rejoin (`preempt_mode` keep).

The prompt-only predictor predicts inside `add_request`, on the serving clock. Each round's trace (arrival times, prompt
lengths, the labels' greedy lengths, the same predictions and their measured time, the probe's
re-predictions on the cached greedy test answers) is then replayed through the online simulator
(`ecru.serve.sim.simulator`), twice: charged by the cost model measured on random tokens before the runs
(`simulated`), by one fitted on every engine step of the round, each step's forwards
(`record_forwards`) against its seconds, engine overheads included (`simulated_engine_cost`;
`engine_cost` gives its in-sample error), and each policy by the one fitted on its own run's steps
(`simulated_own_cost`: overheads only one policy has, such as cb-srpt's KV copies, stay with it). The
predictor's time is charged as `add_request` pays it, one request per call (MiniLM reads the text, the
embedding predictor the token ids; each run's `predict_s_per_request` is what it paid). `engine_cost_model`, fitted on every round's steps, is what
`bench/experiments/serve_online_seeds.py --cost-from ... --cost-key engine_cost_model` replays on 3,000 requests. The
engine keeps its default prefix cache; the simulator does not model it, the fitted prefill coefficient
prices it in.

    OMP_NUM_THREADS=1 python bench/serve_online_real.py --json bench/results/serve_online_real.json
    OMP_NUM_THREADS=1 python bench/serve_online_real.py --requests 240 --rate-from engine --concurrent \
        --repeats 4 --order "cb,cb-srpt[fcfs-slack]" --json bench/results/serve_online_real_concurrent.json
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ecru.cliargs import (
    ArgumentParser,
    non_negative_float,
    positive_float,
    positive_int,
    prepare_out_file,
    run_main,
)
from ecru.io import atomic_write_json
from ecru.serve import EmbeddingPredictor, MiniLMPredictor
from ecru.serve.engine.models import ServedModel
from ecru.serve.engine.packed import packed_layers
from ecru.serve.engine.request_engine import EngineConfig, RequestEngine
from ecru.serve.engine.sampling import SamplingParams
from ecru.serve.prompts import encode_chat
from ecru.serve.sim.cost import CostModel, StepWork, fit_cost_model, measure_cost_model, record_forwards
from ecru.serve.sim.simulator import OnlineRequest, poisson_arrivals, simulate_online, simulate_policy
from serve_online import fit_remaining, predict_one_by_one, remaining_trajectories

RESULTS = Path(__file__).parent / "results"
TRAIN_ANSWERS = 480
"""Greedy train answers the remaining-length probe is fitted on (bench/serve_online.py's full run)."""
REPREDICT_EVERY = 16
"""cb-srpt: tokens between re-predictions, on the engine and in the simulator."""
CAPACITY_REQUESTS = 240
"""Requests the engine's capacity is measured on (at most; all 240 test prompts when the trace has them)."""
AS_RUN = {False: "", True: ", the policies side by side (one process on one thread each)"}
"""How the policies ran, for the fitted cost model's source (--concurrent shares the machine)."""


def read_labels(path: Path, cap: int) -> tuple[list[str], list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows], [min(cap, r["lengths"][0]) for r in rows]


def policies(slack: float) -> dict[str, tuple[str, dict, dict]]:
    """name -> (policy, EngineConfig overrides, the simulator's alone: `simulator.SIM_KNOBS`)."""
    deadline = {"aging": 0.0, "fcfs_slack": slack}
    return {
        "cb": ("cb", {}, {}),
        "cb-sjf": ("cb-sjf", {}, {}),
        "cb-sjf[fcfs-slack]": ("cb-sjf", deadline, {}),
        "cb-srpt[fcfs-slack]": ("cb-srpt", deadline | {"preempt_mode": "keep"}, {}),
    }


def serve_real(served, ids, arrivals, predict_one, probe, config: EngineConfig, cap: int) -> dict:
    """Serve the trace on the engine in wall-clock time; latencies from each scheduled arrival. `steps`:
    each engine step's work (`StepWork`, from its forwards) and seconds, for `fit_cost_model`."""
    remaining = probe if config.policy == "cb-srpt" else None
    engine = RequestEngine(served.model, eos_token_ids=served.eos_token_ids, pad_token_id=served.pad_token_id,
                           config=config, tokenizer=served.tokenizer, remaining=remaining)  # fmt: skip
    predict_s = []  # each prediction's seconds, in add_request, on the serving clock
    if config.policy != "cb":

        def predict(prompt, params) -> float:
            start = time.perf_counter()
            out = predict_one(prompt)
            predict_s.append(time.perf_counter() - start)
            return out

        engine.predict = predict
    params, reqs, steps, start = SamplingParams(max_tokens=cap), [], [], time.perf_counter()
    with (
        tqdm(total=len(ids), desc=config.policy, file=sys.stderr) as bar,
        record_forwards(served.model) as fwd,
    ):
        while len(reqs) < len(ids) or engine.has_unfinished():
            now = time.perf_counter() - start
            while len(reqs) < len(ids) and arrivals[len(reqs)] <= now:
                reqs.append(engine.add_request(ids[len(reqs)], params))
            engine.upcoming = len(ids) - len(reqs)  # admission waits for refill_min rows, as the simulator's
            if engine.has_unfinished():
                seen, t = len(fwd), time.perf_counter()
                bar.update(len(engine.step()))
                steps.append((sum(fwd[seen:], StepWork()), time.perf_counter() - t))
            else:
                time.sleep(max(0.0, arrivals[len(reqs)] - now))
    wall, busy = time.perf_counter() - start, sum(s for _, s in steps)
    lat = [r.finish_s - start - a for r, a in zip(reqs, arrivals, strict=True)]
    return {"mean_latency_s": statistics.fmean(lat), "p99_latency_s": float(np.percentile(lat, 99)),
            "max_latency_s": max(lat), "wall_s": wall, "busy_s": busy, "tokens": sum(len(r.output) for r in reqs),
            "decode_steps": engine.stats.decode_steps, "busy_s_per_decode_step": busy / engine.stats.decode_steps,
            "preemptions": engine.stats.preemptions, "peak_kv_tokens": engine.stats.peak_kv_tokens,
            "prefill_forwards": engine.stats.prefill_forwards, "latencies_s": lat,
            "predict_s_per_request": statistics.fmean(predict_s) if predict_s else 0.0,
            "engine_cost": engine_cost([steps], f"{config.policy}: this run's engine steps"),
            "outputs": [r.output for r in reqs], "steps": steps}  # fmt: skip


def engine_cost(runs: list[list[tuple[StepWork, float]]], source: str) -> dict:
    """The cost model fitted on engine steps (their work and seconds), its step time at 16 rows and 200
    positions, the median absolute relative error of its prediction per step (in sample: on the steps it
    was fitted on), and the rows the decode steps held (10th, 50th, 90th percentiles: at a steady full
    batch the per-step and per-row coefficients can hardly be told apart)."""
    steps = [s for run in runs for s in run if s[0] != StepWork()]
    cost = fit_cost_model([w for w, _ in steps], [t for _, t in steps], source=source)
    error = [abs(cost.time(w) / t - 1) for w, t in steps]
    rows = [w.decode_rows / w.decode_steps for w, _ in steps if w.decode_steps]
    return {"cost_model": cost.__dict__, "step_s_16x200": cost.step_time(16, 200), "steps": len(steps),
            "in_sample_median_abs_rel_error": statistics.median(error),
            "decode_rows_p10_p50_p90": np.percentile(rows, [10, 50, 90]).tolist()}  # fmt: skip


def explained(cost: CostModel, steps: list[tuple[StepWork, float]]) -> float:
    """The busy time `cost` predicts for these steps over the time they took."""
    return sum(cost.time(w) for w, _ in steps) / sum(t for _, t in steps)


def cached_answers(path: Path) -> dict[str, list[int]]:
    """bench/serve_online.py's cached greedy answers: prompt -> answer tokens."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["prompt"]: r["tokens"] for r in rows}


def prompt_predictor(name: str, served, train, y_train, ids, texts, cap: int) -> Callable[[list[int]], float]:
    """The engine's prediction of one request from its chat-templated ids, fitted on the train labels:
    `EmbeddingPredictor` reads the ids themselves, MiniLM the request's text."""
    if name == "embed":
        return EmbeddingPredictor(served.model, served.tokenizer, cap=cap).fit(train, y_train).engine_predict
    minilm = MiniLMPredictor(cap=cap).fit(train, y_train)
    text_of = {tuple(i): t for i, t in zip(ids, texts, strict=True)}
    return lambda prompt: minilm.predict([text_of[tuple(prompt)]])[0]


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
    distinct = list(dict.fromkeys(texts))  # a prompt asked again has the same answer and trajectory
    traj, per_row = remaining_trajectories(served.model, served.tokenizer, probe, distinct,
                                           [test[t] for t in distinct], every=REPREDICT_EVERY)  # fmt: skip
    of = dict(zip(distinct, traj, strict=True))
    return probe, [of[t] for t in texts], per_row


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
    ap.add_argument("--concurrent", action="store_true",
                    help="run the policies of --order at the same time, one process on one thread each (the "
                    "engine's capacity for --rate-from engine measured likewise): a drift in the machine's "
                    "speed then weighs on all alike; needs one core per policy")  # fmt: skip
    ap.add_argument("--predictor", choices=("minilm", "embed"), default="minilm",
                    help="cb-sjf's and cb-srpt's prompt-only predictor: MiniLM ridge, or ridge on SmolLM2's own "
                    "input embeddings (EmbeddingPredictor)")  # fmt: skip
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="rounds, each with its own Poisson arrival draw (seed + 1 + round)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.concurrent and args.mirror:
        ap.error("--concurrent and --mirror: choose one (concurrent runs share the machine's drift already)")
    if args.concurrent and args.rate_from != "engine":
        ap.error(
            "--concurrent needs --rate-from engine: the load must be relative to the capacity side by side"
        )
    names = list(policies(args.slack))
    args.order = names if args.order is None else [p.strip() for p in args.order.split(",")]
    if len(set(args.order)) != len(args.order) or not set(args.order) <= set(names) or "cb" not in args.order:
        ap.error(f"--order: cb and any of {', '.join(names[1:])}, each once, got {','.join(args.order)!r}")
    if args.concurrent and len(args.order) > len(os.sched_getaffinity(0)):
        ap.error(
            f"--concurrent: {len(args.order)} policies need as many cores, {len(os.sched_getaffinity(0))} here"
        )
    return args, prepare_out_file(args.json, flag="--json")


def timed_trace(ids, lengths, predicted, traj, cost, base, args, served) -> tuple[list[OnlineRequest], float]:
    """The simulator's trace of the served requests (arrivals not drawn yet) and cb's capacity on it in
    requests/s: in the simulator, or with `--rate-from engine` the engine's own (`engine_capacity`)."""
    trace = [OnlineRequest(0.0, len(i), n, p, tuple(tr))
             for i, n, p, tr in zip(ids, lengths, predicted, traj, strict=True)]  # fmt: skip
    capacity = len(trace) / simulate_online(trace, policy="cb", config=base, cost=cost).time_s
    if args.rate_from == "engine" and args.concurrent:  # measured as the policies will run: side by side
        capacity = statistics.fmean(
            concurrently(lambda _: engine_capacity(served, ids, args.cap), args.order)
        )
    elif args.rate_from == "engine":
        capacity = engine_capacity(served, ids, args.cap)
    return trace, capacity


def concurrently(task, items: list) -> list:
    """`task(item)` for every item at the same time, each in a forked child process on one thread, so a
    drift in the machine's speed weighs on all alike; the results in order. The parent must not have
    started an OpenMP pool (`--concurrent` sets one thread first)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_forked, args=(task, i, item, queue)) for i, item in enumerate(items)]
    for proc in procs:
        proc.start()
    results: dict = {}
    try:
        while len(results) < len(procs):  # read as they come: a large result would fill the pipe before exit
            if not queue.empty():
                i, ok, value = queue.get()
                if not ok:
                    sys.exit(f"the concurrent run of {items[i]!r} failed: {value}")
                results[i] = value
            elif any(p.exitcode not in (None, 0) for p in procs):
                sys.exit("a concurrent run's process died")
            else:
                time.sleep(0.05)
    finally:  # on failure or Ctrl-C, the other runs stop too
        for proc in procs:
            if proc.is_alive() and len(results) < len(procs):
                proc.terminate()
            proc.join()
    return [results[i] for i in range(len(items))]


def _forked(task, i: int, item, queue) -> None:
    torch.set_num_threads(1)
    try:
        queue.put((i, True, task(item)))
    except Exception as exc:  # reported to the parent, which exits
        queue.put((i, False, repr(exc)))


def draw_prompts(n_prompts: int, requests: int, seed: int) -> list[int]:
    """Which labelled test prompt each request asks: distinct ones drawn with `seed` while they last (all
    of them when `requests` >= `n_prompts`), then drawn again with replacement."""
    rng = random.Random(seed)
    picks = rng.sample(range(n_prompts), min(requests, n_prompts))
    return picks + [rng.randrange(n_prompts) for _ in range(requests - len(picks))]


def engine_capacity(served, ids, cap: int) -> float:
    """cb's throughput on the engine in requests/s, every request waiting from the start (the first
    CAPACITY_REQUESTS of them: a long trace's capacity is measured on a part as long as the test set)."""
    ids = ids[:CAPACITY_REQUESTS]
    engine = RequestEngine(served.model, eos_token_ids=served.eos_token_ids, pad_token_id=served.pad_token_id,
                           config=EngineConfig(max_new_tokens=cap))  # fmt: skip
    start = time.perf_counter()
    engine.generate(ids, SamplingParams(max_tokens=cap))
    return len(ids) / (time.perf_counter() - start)


def run_round(served, ids, trace, predictors, cost, base, args) -> tuple[dict, list]:
    """Each policy on the real engine (args.order), then on the simulator, charged by the cost model
    measured before the runs and by the one fitted on this round's own engine steps; latency ratios to
    cb's, and the steps themselves. `predictors`: (the prompt-only prediction of one request, its seconds
    per request, the remaining probe, its seconds per row)."""
    runs, steps, table, arrivals = {}, [], policies(args.slack), [r.arrival_s for r in trace]
    predict_one, predict_s, probe, repredict_s = predictors

    def serve(name: str) -> dict:
        policy, overrides, _ = table[name]
        config = EngineConfig(
            policy=policy, max_new_tokens=args.cap, repredict_every=REPREDICT_EVERY, **overrides
        )
        return serve_real(served, ids, arrivals, predict_one, probe, config, args.cap)

    names = args.order + (args.order[::-1] if args.mirror else [])
    done = concurrently(serve, names) if args.concurrent else (serve(name) for name in names)
    done_runs = []
    for name, run in zip(names, done, strict=True):
        steps.append(run.pop("steps"))
        done_runs.append(run)
        runs.setdefault(name, []).append(run)
        print(
            f"{name}: real mean {run['mean_latency_s']:.1f} s p99 {run['p99_latency_s']:.1f} s",
            file=sys.stderr,
        )
    engine = engine_cost(
        steps,
        f"SmolLM2-135M fp32, fitted on every engine step of this round's policies{AS_RUN[args.concurrent]}",
    )
    fitted = CostModel(**engine["cost_model"])
    for run, run_steps in zip(done_runs, steps, strict=True):
        run["predicted_over_busy_in_sample"] = explained(fitted, run_steps)
    real = {name: merged(rs) for name, rs in runs.items()}
    simulated = replay(trace, args, base, dict.fromkeys(args.order, cost), (predict_s, repredict_s))
    # the probe's time is in the engine steps the models were fitted on: not charged again
    on_engine = replay(trace, args, base, dict.fromkeys(args.order, fitted), (predict_s, 0.0))
    own = {name: CostModel(**real[name]["engine_cost"]["cost_model"]) for name in args.order}
    on_own = replay(trace, args, base, own, (predict_s, 0.0))
    for r in (real, simulated, on_engine, on_own):
        ratios(r)
    outputs = {name: r.pop("outputs") for name, r in real.items()}
    return {"real": real, "simulated": simulated, "simulated_engine_cost": on_engine,
            "simulated_own_cost": on_own, "engine_cost": engine,
            "greedy_outputs_equal_across_policies": all(o == outputs["cb"] for o in outputs.values()),
            "answer_tokens_equal_labels": [len(o) for o in outputs["cb"]] == [r.output_len for r in trace],
            }, steps  # fmt: skip


def summary(rounds: list[dict], order: list[str]) -> dict:
    """Per policy: mean and p99 latency over cb's in each round, real and replayed with the engine-fitted
    cost models (pooled, and each policy's own), and their medians."""
    out = {}
    for name in order:
        cols = {f"{src}_{k}_x_cb": [r[src][name][f"{k}_latency_x_cb"] for r in rounds]
                for src in ("real", "simulated_engine_cost", "simulated_own_cost") for k in ("mean", "p99")}  # fmt: skip
        out[name] = cols | {f"{k}_median": statistics.median(v) for k, v in cols.items()}
    return out


def replay(trace, args, base: EngineConfig, costs: dict, charged: tuple[float, float]) -> dict:
    """Each policy of args.order on the simulator, charged `costs[name]` per step; `charged`: the prompt
    predictor's seconds per request, the probe's per row."""
    out, table = {}, policies(args.slack)
    for name in args.order:
        policy, overrides, sim_only = table[name]
        cost = costs[name]
        extra = {"predict_s": charged[0]} if policy != "cb" else {}
        extra |= {"repredict_s": charged[1]} if policy == "cb-srpt" else {}
        sim = simulate_policy(trace, policy, base, cost, overrides | sim_only | extra)
        out[name] = sim.to_json() | {"latencies_s": sim.latencies}  # per request, as the real runs'
        print(f"{name}: simulated {sim.mean_latency_s:.1f} / {sim.p99_latency_s:.1f} ({cost.source})",
              file=sys.stderr)  # fmt: skip
    return out


def main(argv=None) -> None:
    args, out_path = parse(argv)
    if args.concurrent:  # before any parallel op: forked children must not inherit an OpenMP pool
        torch.set_num_threads(1)
    torch.manual_seed(0)
    started = time.perf_counter()
    train, y_train = read_labels(RESULTS / "serve_workload_labels_train.jsonl", args.cap)
    test, y_test = read_labels(RESULTS / "serve_workload_labels_test.jsonl", args.cap)
    picks = draw_prompts(len(test), args.requests, args.seed)
    texts, lengths = [test[i] for i in picks], [y_test[i] for i in picks]
    served = ServedModel.load("smollm2")
    ids = encode_chat(served.tokenizer, texts)
    predict_one = prompt_predictor(args.predictor, served, train, y_train, ids, texts, args.cap)
    predicted, predict_s = predict_one_by_one(predict_one, ids)
    print("fitting the remaining-length probe ...", file=sys.stderr)
    probe, traj, repredict_s = remaining_probe(served, texts, args.cap)
    print("measuring the cost model ...", file=sys.stderr)
    cost = measure_cost_model(served.model, reps=3, source="SmolLM2-135M fp32, measured in this run")
    base = EngineConfig(max_new_tokens=args.cap, repredict_every=REPREDICT_EVERY)
    trace, capacity = timed_trace(ids, lengths, predicted, traj, cost, base, args, served)
    predictors = (predict_one, predict_s, probe, repredict_s)
    rounds, steps = [], []
    for k in range(args.repeats):  # round k: arrivals drawn with seed + 1 + k
        arrivals = poisson_arrivals(len(trace), args.load * capacity, args.seed + 1 + k)
        trace = [dataclasses.replace(r, arrival_s=a) for r, a in zip(trace, arrivals, strict=True)]
        done, round_steps = run_round(served, ids, trace, predictors, cost, base, args)
        rounds.append({"arrival_seed": args.seed + 1 + k} | done)
        steps += round_steps
    engine = engine_cost(
        steps, f"SmolLM2-135M fp32, fitted on every engine step of every round{AS_RUN[args.concurrent]}"
    )
    atomic_write_json(out_path, {
        "command": "python bench/serve_online_real.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "method": "real engine (RequestEngine, SmolLM2-135M-Instruct fp32, greedy, prefix cache on) in wall-clock "
        "time; Poisson arrivals at load x cb's capacity (rate_from: simulator, or engine: measured on the engine, side by side with --concurrent); the "
        "policies one after another, or side by side, one process on one thread each (concurrent); latency "
        "from the scheduled arrival to the last token; each round's trace replayed through the online "
        "simulator with the cost model measured in this run before the policies ran (simulated) and with the "
        "one fitted on the round's own engine steps (simulated_engine_cost) or on each policy's own steps "
        "(simulated_own_cost), the prompt predictor's time per request measured one request per call charged; "
        "engine_cost_model: "
        "fitted on every round's steps",
        "packed_layers": len(packed_layers(served.model)),
        "requests": len(trace), "load": args.load, "rate_from": args.rate_from, "capacity_requests_per_s": capacity,
        "arrival_rate_per_s": args.load * capacity, "repeats": args.repeats,
        "fcfs_slack": args.slack, "order": args.order, "mirror": args.mirror, "concurrent": args.concurrent,
        "predicted": predicted, "true_lengths": lengths,
        "predictor": {"name": args.predictor, "train_labels": len(train), "predict_s_per_request": predict_s,
                      "measured": "one request per call, as add_request pays it"},
        "remaining_probe": {"train_answers": TRAIN_ANSWERS, "repredict_every": REPREDICT_EVERY,
                            "predict_s_per_row": repredict_s},
        "cost_model": cost.__dict__, "engine_cost": engine, "engine_cost_model": engine["cost_model"],
        "summary": summary(rounds, args.order), "rounds": rounds,
        "wall_s": time.perf_counter() - started,
    })  # fmt: skip
    print(f"wrote {out_path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    sys.exit(run_main(main))
