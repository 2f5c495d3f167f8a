"""Online serving with length perception: Poisson arrivals, continuous batching, re-prediction while generating.

Replayed through the simulator (`ecru.serve.sim.simulator`) with lengths and predictions measured here: the true
lengths are SmolLM2-135M-Instruct's greedy answers on the mixed workload's unseen test prompts (committed
labels, cap 256); the per-step cost model is measured on this machine in this run; every predictor is
fitted on train prompts only and its measured prediction time is charged on the serving clock.

- Prompt-only predictors (cb-sjf; cb-srpt before its first re-prediction): the constant median, a ridge
  probe on SmolLM2's mean-pooled prompt states (`ProbePredictor`), MiniLM ridge (`MiniLMPredictor`), ridge
  on the mean of SmolLM2's own input-embedding rows over the prompt (`EmbeddingPredictor`, its penalty
  chosen by 5-fold cross-validation on the train prompts; timed one request's token ids per call, as the
  engine's `add_request` calls it), and PiA, SmolLM2 untuned asked for its answer's length
  (`PiAPredictor`; the train median where it gives no number).
- Re-prediction (cb-srpt): `RemainingProbe`, ridge on the running row's own last hidden state, trained
  teacher-forced on the train prompts' answers (cached in --answers-dir; generated if missing), scored on
  the test answers every --repredict-every tokens.
- Online: the labelled test prompts resampled to --requests requests, Poisson arrivals at each load
  (load = arrival rate / cb's saturated throughput on the same trace), policies fcfs (static), cb, cb-sjf,
  cb-srpt, oracle-srpt (true remaining lengths), each the engine's own scheduler on a simulated runner. A
  plain name is the configuration the product ships: the `embed` predictor; cb-srpt with the FCFS deadline
  `names.FCFS_SLACK` (aging 0) and preemption that keeps the preempted row's KV. Study variants say what
  they change: `[minilm]`/`[probe]` (another prompt-only predictor), `[no-deadline]` (aged instead),
  `[recompute]` (the KV dropped, prefilled again with its tokens), `[no-preempt]`; aging and margin sweeps.
- FCFS deadline (`fcfs_slack`, aging 0): a request that has waited (1 + slack) x the wait FCFS would now
  impose is admitted first. The slack is chosen on a validation trace of train prompts (out-of-fold MiniLM
  predictions, load 1.2): the lowest mean latency whose p99 stays within 1.2x cb's; then applied to the
  test traces as `[fcfs-slack]` policies (cb-srpt's plain name keeps the shipped slack), with a sweep over
  slacks on the test trace for the picture.
- Static (the paper's offline recipe): groups of 256 requests, fcfs vs sorted, FCR+VBS and FCR+VBS with
  50-token bins, on each predictor.

    OMP_NUM_THREADS=1 python bench/serve_online.py --quick --json bench/results/serve_online_quick.json
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from ecru.cliargs import ArgumentParser, positive_int, prepare_out_dir, prepare_out_file, run_main
from ecru.errors import EcruError
from ecru.io import atomic_write_json
from ecru.serve import EmbeddingPredictor, MiniLMPredictor, PlanConfig, TraceRequest, length_metrics, simulate
from ecru.serve.predict.labels import generate_responses
from ecru.serve.predict.predictors import (
    ConstantPredictor,
    ProbePredictor,
    ridge_fit,
    spearman,
    timed_predict,
)
from ecru.serve.predict.remaining import RemainingProbe, answer_states
from ecru.serve.predict.self_predict import PiAPredictor
from ecru.serve.prompts import encode_chat
from ecru.serve.sched.scheduler import EngineConfig
from ecru.serve.sim.cost import measure_cost_model
from ecru.serve.sim.simulator import OnlineRequest, poisson_arrivals, simulate_online, simulate_policy

RESULTS = Path(__file__).parent / "results"
NOTE = "replayed through simulator with measured lengths/predictions"
SLACKS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.4)
"""fcfs_slack values tried on the validation trace (and swept on the test trace)."""
SHIPPED = "embed"
"""The prompt-only predictor of the plain names cb-sjf and cb-srpt (`ecru serve probe` fits it)."""
NO_PREEMPT = {"preempt_margin": math.inf}
STUDY = {
    "[no-deadline]": {"fcfs_slack": math.inf},
    "[recompute]": {"preempt_mode": "recompute"},
    "[no-preempt]": NO_PREEMPT,
    "[no-preempt][no-deadline]": {**NO_PREEMPT, "fcfs_slack": math.inf},
}
"""cb-srpt's study variants: what each changes in the shipped configuration (FCFS deadline `FCFS_SLACK`, aging
0, preemption keeping the KV); without the deadline, requests are aged (`DEFAULT_AGING`)."""
SLACK_P99_BOUND = 1.2
"""The chosen slack keeps the validation trace's p99 latency within this many times cb's."""


def read_split(path: Path, n: int, cap: int, samples: int = 1) -> tuple[list[str], list[int], list[int]]:
    """Prompts, greedy answer lengths (the first sample, T = 0) and labels (the longest of `samples`)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    if any(len(r["lengths"]) < samples for r in rows):
        raise EcruError(f"{path}: fewer than {samples} answer lengths on a line")
    greedy = [min(cap, r["lengths"][0]) for r in rows]
    return [r["prompt"] for r in rows], greedy, [min(cap, max(r["lengths"][:samples])) for r in rows]


def prompt_predictors(
    model, tok, train, y_train, test, cap, *, quick=False
) -> dict[str, tuple[list[float], float]]:
    """name -> (test predictions, seconds per request), each fitted on the train prompts only (`quick`: no
    PiA, which generates an answer per prompt)."""
    fitted = {
        "constant": ConstantPredictor(statistics.median(y_train)),
        "probe": ProbePredictor(model, tok, cap=cap).fit(train, y_train),
        "minilm": MiniLMPredictor(cap=cap).fit(train, y_train),
    }
    if not quick:
        fitted["pia"] = PiAPredictor(model, tok, cap=cap, default=statistics.median(y_train))
    out = {}
    for name, p in fitted.items():
        pred, s = timed_predict(p, test)
        out[name] = (pred, s / len(test))
    if not quick:
        print(f"pia: {fitted['pia'].parsed} of {len(test)} answers held a number", file=sys.stderr)
    embed = EmbeddingPredictor(model, tok, cap=cap).fit(train, y_train)
    print(f"embed: lam {embed.lam} (out-of-fold Spearman {embed.cv})", file=sys.stderr)
    out["embed"] = predict_one_by_one(embed.engine_predict, encode_chat(tok, test))
    return out


def predict_one_by_one(predict_one, ids: list[list[int]]) -> tuple[list[float], float]:
    """The predictions and their seconds per request, one request's token ids per call, as the engine's
    `add_request` pays them."""
    start = time.perf_counter()
    predicted = [predict_one(i) for i in ids]
    return predicted, (time.perf_counter() - start) / len(ids)


def fit_remaining(model, tok, prompts, answers, lengths, *, cap) -> tuple[RemainingProbe, float]:
    """The probe and the seconds its state extraction took per answer token (reported, not charged:
    serving already computes these states)."""
    start = time.perf_counter()
    states = answer_states(model, encode_chat(tok, prompts), answers)
    per_token = (time.perf_counter() - start) / sum(len(a) for a in answers)
    return RemainingProbe(cap=cap).fit(states, lengths), per_token


def remaining_trajectories(model, tok, probe, prompts, answers, *, every) -> tuple[list[list[float]], float]:
    """Predicted remaining length after 0, k, 2k, ... tokens of each test answer; seconds per row-prediction."""
    states = answer_states(model, encode_chat(tok, prompts), answers)
    start = time.perf_counter()
    traj = [probe.trajectory(s, every=every) for s in states]
    per_row = (time.perf_counter() - start) / sum(len(t) for t in traj)
    return traj, per_row


def remaining_metrics(traj, lengths, *, every, cap) -> dict:
    """Accuracy of re-predictions against the true remaining length, pooled over re-prediction points
    t >= every, and Spearman at chosen t (over the answers still running at t)."""
    pred, true, by_t = [], [], {}
    for tr, n in zip(traj, lengths, strict=True):
        for j, p in enumerate(tr):
            t = j * every
            if t >= n:
                break
            by_t.setdefault(t, ([], []))
            by_t[t][0].append(p)
            by_t[t][1].append(n - t)
            if t:
                pred.append(p)
                true.append(n - t)
    out = {**length_metrics(pred, true), "spearman": spearman(pred, true), "points": len(pred)}
    out["spearman_at_t"] = {
        str(t): spearman(*by_t[t]) for t in sorted(by_t) if t in (0, every, 2 * every, 4 * every, 8 * every)
    }
    hits = by_t.get(every)
    if hits:
        from sklearn.metrics import roc_auc_score

        capped = [int(r + every >= cap) for r in hits[1]]
        out[f"cap_hit_auc_at_{every}"] = (
            float(roc_auc_score(capped, hits[0])) if 0 < sum(capped) < len(capped) else None
        )
    return out


def resample(n_prompts: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(n_prompts) for _ in range(n)]


def build_trace(idx, arrivals, prompt_lens, lengths, predicted, traj) -> list[OnlineRequest]:
    return [
        OnlineRequest(a, prompt_lens[i], lengths[i], predicted[i], tuple(traj[i]) if traj else ())
        for i, a in zip(idx, arrivals, strict=True)
    ]


def static_table(idx, prompt_lens, lengths, preds, cost, cap, group=256) -> dict:
    """Offline groups of `group` requests: each policy's throughput over fcfs (prediction time charged)."""
    out = {}
    for name, (pred, per_req) in list(preds.items()) + [
        (f"{n}[free-predict]", (p, 0.0)) for n, (p, _) in preds.items()
    ]:
        times: dict[str, float] = {}
        for g in range(0, len(idx), group):
            rows = idx[g : g + group]
            trace = [TraceRequest(prompt_lens[i], lengths[i], pred[i]) for i in rows]
            config = PlanConfig(batch_size=16, max_new_tokens=cap)
            for policy in ("fcfs", "sorted", "fcr+vbs", "fcr+vbs+bins", "oracle"):
                charged = per_req * len(rows) if policy not in ("fcfs", "oracle") else 0.0
                r = simulate(trace, policy=policy, config=config, cost=cost, predict_s=charged)
                times[policy] = times.get(policy, 0.0) + r.time_s
        out[name] = {p: times["fcfs"] / t for p, t in times.items() if p != "fcfs"}
        print(f"  static x fcfs [{name}]: " + ", ".join(f"{p} {v:.2f}" for p, v in out[name].items()))
    return out


def oof_predictions(predictor, prompts, labels, *, folds: int = 5) -> list[float]:
    """Out-of-fold predictions on the train prompts: each fold's ridge is fitted on the other folds."""
    x, y = predictor.features(prompts), torch.as_tensor(labels, dtype=torch.float32)
    out = torch.zeros(len(prompts))
    for k in range(folds):
        held = torch.arange(k, len(prompts), folds)
        kept = torch.tensor([i for i in range(len(prompts)) if i % folds != k])
        w, b = ridge_fit(x[kept], y[kept], lam=predictor.lam)
        out[held] = (x[held] @ w + b).clamp(1, predictor.cap)
    return out.tolist()


def saturated_capacity(idx, prompt_lens, lengths, base, cost) -> float:
    """cb's throughput in requests/s with every request waiting at t=0 (what a load is relative to)."""
    trace = build_trace(idx, [0.0] * len(idx), prompt_lens, lengths, lengths, None)
    return len(idx) / simulate_online(trace, policy="cb", config=base, cost=cost).time_s


def slack_curve(trace, base, cost, predict_s: float, policy: str = "cb-sjf", extra=None) -> dict:
    """`policy` without aging at each of SLACKS: mean and p99 latency over cb's on `trace`."""
    cb = simulate_online(trace, policy="cb", config=base, cost=cost)
    out = {}
    for slack in SLACKS:
        knobs = {"aging": 0.0, "fcfs_slack": slack, "predict_s": predict_s, **(extra or {})}
        r = simulate_policy(trace, policy, base, cost, knobs)
        out[str(slack)] = {"mean_latency_x_cb": r.mean_latency_s / cb.mean_latency_s,
                           "p99_latency_x_cb": r.p99_latency_s / cb.p99_latency_s}  # fmt: skip
    return out


def choose_slack(train, y_train, y_label, train_lens, predict_s, base, cost, args) -> dict:
    """The fcfs_slack of the test traces, chosen on a validation trace of the train prompts (their greedy
    lengths `y_train`; out-of-fold MiniLM predictions fitted on `y_label`, load 1.2): the lowest mean latency
    whose p99 stays within SLACK_P99_BOUND x cb's."""
    pred = oof_predictions(MiniLMPredictor(cap=args.cap), train, y_label)
    idx = resample(len(train), args.requests, args.seed + 100)
    rate = 1.2 * saturated_capacity(idx, train_lens, y_train, base, cost)
    arrivals = poisson_arrivals(len(idx), rate, args.seed + 101)
    curve = slack_curve(build_trace(idx, arrivals, train_lens, y_train, pred, None), base, cost, predict_s)
    ok = [k for k, r in curve.items() if r["p99_latency_x_cb"] <= SLACK_P99_BOUND]
    chosen = float(min(ok, key=lambda k: curve[k]["mean_latency_x_cb"])) if ok else min(SLACKS)
    print(f"fcfs_slack {chosen}, chosen on the validation trace: {curve}", file=sys.stderr)
    return {"chosen": chosen, "rule": f"lowest mean latency with p99 <= {SLACK_P99_BOUND}x cb's, cb-sjf aging 0, "
            "MiniLM out-of-fold predictions (5 folds) on the train prompts, their own greedy lengths, "
            f"{len(idx)} requests at load 1.2, prediction time charged", "oof_spearman": spearman(pred, y_train),
            "validation_load_1.2": curve}  # fmt: skip


def run_policies(trace_for, policies, config, cost) -> dict:
    out = {}
    for name, (policy, predictor, overrides) in policies.items():
        out[name] = simulate_policy(trace_for(predictor), policy, config, cost, overrides).to_json()
    return out


def main(argv=None) -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="fewer train answers for the remaining probe, no PiA"
    )
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--cap", type=positive_int, default=256, help="max new tokens (the labels' cap)")
    ap.add_argument("--requests", type=positive_int, default=3000, help="requests per online trace")
    ap.add_argument("--repredict-every", type=positive_int, default=16, help="tokens between re-predictions")
    ap.add_argument(
        "--answers-dir", default=str(RESULTS), help="cache of greedy answers (generated if missing)"
    )
    ap.add_argument("--seed", type=int, default=0, help="resampling and arrival seed")
    ap.add_argument(
        "--samples",
        type=int,
        choices=(1, 4),
        default=1,
        help="prompt-only predictors learn the longest of this many sampled answers per train prompt (4: "
        "the paper's label, serve_workload_labels_train_max4.jsonl); the truth stays the greedy length",
    )
    ap.add_argument(
        "--train-labels",
        type=positive_int,
        default=1000,
        help="labelled train prompts for prompt-only predictors",
    )
    args = ap.parse_args(argv)
    out_path = prepare_out_file(args.json, flag="--json")
    answers_dir = prepare_out_dir(args.answers_dir, flag="--answers-dir")
    torch.manual_seed(0)
    started = time.perf_counter()
    labels = (
        "serve_workload_labels_train.jsonl" if args.samples == 1 else "serve_workload_labels_train_max4.jsonl"
    )
    train, y_train, y_label = read_split(RESULTS / labels, args.train_labels, args.cap, args.samples)
    test, y_test, _ = read_split(RESULTS / "serve_workload_labels_test.jsonl", 240, args.cap)
    from ecru.serve.engine.models import load_model

    model, tok = load_model("smollm2")
    print("measuring the cost model ...", file=sys.stderr)
    cost = measure_cost_model(model, reps=3, source="SmolLM2-135M fp32, measured in this run")
    preds = prompt_predictors(model, tok, train, y_label, test, args.cap, quick=args.quick)
    n_answers = 240 if args.quick else 480
    gen_start = time.perf_counter()
    tr_ans = generate_responses(model, tok, train[:n_answers], out=answers_dir / "serve_online_answers_train.jsonl",
                                model_key="smollm2", max_new_tokens=args.cap)  # fmt: skip
    te_ans = generate_responses(model, tok, test, out=answers_dir / "serve_online_answers_test.jsonl",
                                model_key="smollm2", max_new_tokens=args.cap)  # fmt: skip
    gen_s = time.perf_counter() - gen_start
    k = args.repredict_every
    probe, state_s = fit_remaining(model, tok, train[:n_answers], [tr_ans[p] for p in train[:n_answers]],
                                   [len(tr_ans[p]) for p in train[:n_answers]], cap=args.cap)  # fmt: skip
    traj, repredict_s = remaining_trajectories(model, tok, probe, test, [te_ans[p] for p in test], every=k)
    mismatch = sum(len(te_ans[p]) != n for p, n in zip(test, y_test, strict=True))
    predictors = {}
    for name, (pred, per_req) in preds.items():
        predictors[name] = {**length_metrics(pred, y_test), "spearman": spearman(pred, y_test),
                            "predict_s_per_request": per_req}  # fmt: skip
    predictors["remaining-probe"] = {**remaining_metrics(traj, y_test, every=k, cap=args.cap),
                                     "predict_s_per_row": repredict_s}  # fmt: skip
    t0 = [tr[0] for tr in traj]
    predictors["remaining-probe@t0"] = {**length_metrics(t0, y_test), "spearman": spearman(t0, y_test)}
    for name, m in predictors.items():
        print(f"{name:>20}: acc50 {m['acc50']:.3f} mae {m['mae']:.1f} spearman {m['spearman']}")

    prompt_lens = [len(i) for i in encode_chat(tok, test)]
    idx = resample(len(test), args.requests, args.seed)
    static = static_table(idx, prompt_lens, y_test, preds, cost, args.cap)
    base = EngineConfig(max_new_tokens=args.cap, repredict_every=k)
    train_lens = [len(i) for i in encode_chat(tok, train)]
    slack = choose_slack(train, y_train, y_label, train_lens, preds["minilm"][1], base, cost, args)
    online = online_tables(
        idx, prompt_lens, y_test, preds, traj, repredict_s, base, cost, args.seed, slack=slack["chosen"]
    )
    sweeps = sweep(
        idx, prompt_lens, y_test, preds, traj, online["capacity"], base, cost, repredict_s, args.seed
    )
    slack["test_load_1.2"] = slack_sweep(
        idx, prompt_lens, y_test, preds, online["capacity"], base, cost, args.seed
    )
    clinc = clinc_banking(base, cost, args, slack=slack["chosen"])
    out = {
        "workload": "mixed (ecru.serve.workload), unseen test prompts, SmolLM2-135M-Instruct greedy, cap "
        f"{args.cap}",
        "method": NOTE + "; cost model measured in this run on this machine (1 thread); latency in simulated "
        "seconds; load = arrival rate / cb's saturated throughput; prediction time charged on the serving "
        "clock (prompt-only: a separate forward per request, measured; re-prediction: the probe's dot "
        "product per row, measured; [free-predict] variants charge no prompt-only prediction; [at-arrival]: "
        "the engine's prefill on arrival (state_predictor): the probe's prediction read from the "
        "prompt's own prefill, done when it arrives, grouped by refill_min, its KV kept until admission, at "
        "most arrival_kv_requests); [fcfs-slack]: aging 0, the longest-waiting request admitted first once it has "
        "waited (1 + fcfs_slack) x the FCFS wait estimate (predicted backlog / max_batch_size decode steps), "
        "fcfs_slack chosen on a validation trace of train prompts (fcfs_slack.rule)",
        "command": "python bench/serve_online.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "quick": args.quick,
        "requests": len(idx),
        "distinct_prompts": len(test),
        "train_prompts": len(train),
        "train_label": "greedy answer length"
        if args.samples == 1
        else f"longest of {args.samples} sampled "
        "answers (T = 0, 0.3, 0.5, 0.7), the paper's; scored and simulated against greedy lengths",
        "train_answers_for_remaining_probe": n_answers,
        "answers_length_mismatch_vs_labels": mismatch,
        "cost_model": cost.__dict__,
        "capacity_requests_per_s": online["capacity"],
        "config": {
            **base.__dict__,
            "plain names": "the shipped configuration: the prompt-only predictor "
            f"{online['shipped_predictor']!r}; cb-srpt (and oracle-srpt) with the FCFS deadline "
            "names.FCFS_SLACK, aging 0, preemption keeping the KV; [bracketed] study variants say what "
            "they change",
        },
        "loads": online["loads"],
        "predictors": predictors,
        "static_throughput_x_fcfs": static,
        "sweeps_load_1.2": sweeps,
        "fcfs_slack": slack,
        "clinc_banking": clinc,
        "per_prompt": {
            "true_lengths": y_test,
            "prompt_lens": prompt_lens,
            "resampled_index": idx,
            "predicted": {n: p for n, (p, _) in preds.items()},
            "remaining_trajectories": traj,
        },
        "answer_generation_s": gen_s,
        "state_extraction_s_per_token": state_s,
        "wall_s": time.perf_counter() - started,
    }
    atomic_write_json(out_path, out)
    plot_slack(out, out_path.with_name(out_path.stem + "_slack.png"))
    print(f"wrote {out_path} ({out['wall_s']:.0f} s)")


def plot_slack(result: dict, path: Path) -> None:
    """Mean against p99 latency (x cb, load 1.2) along SLACKS: the validation trace, each predictor and
    the true lengths on the test trace, the aging sweep's cb-sjf points (free probe predictions, no
    deadline), and the issue's target box."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slack = result["fcfs_slack"]
    fig, ax = plt.subplots(figsize=(7, 5))
    curves = {"validation (train prompts, MiniLM out of fold)": slack["validation_load_1.2"]}
    curves |= {f"test: {name}": c for name, c in slack["test_load_1.2"].items()}
    for label, curve in curves.items():
        pts = [(c["p99_latency_x_cb"], c["mean_latency_x_cb"]) for c in curve.values()]
        ax.plot(
            *zip(*pts, strict=True), marker="o", ms=3, label=label, ls="--" if "validation" in label else "-"
        )
    aging = [(k, v) for k, v in result["sweeps_load_1.2"].items() if k.startswith("cb-sjf aging=")]
    if aging:
        pts = [(v["p99_latency_x_cb"], v["mean_latency_x_cb"]) for k, v in aging if "free" in k]
        label = "probe[free-predict], aging 0..1, no deadline"
        ax.scatter(*zip(*pts, strict=True), marker="x", c="green", label=label)
    ax.add_patch(
        plt.Rectangle((0, 0), 1.25, 0.75, fc="g", alpha=0.08, label="target: mean <= 0.75, p99 <= 1.25")
    )
    ax.set(xlabel="p99 latency x cb", ylabel="mean latency x cb", xlim=(0.9, 2.4), ylim=(0.3, 1.2),
           title=f"load 1.2, fcfs_slack {min(SLACKS)}..{max(SLACKS)} (chosen {slack['chosen']})")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def shipped(preds) -> str:
    """The prompt-only predictor of the plain names: the shipped one (`embed`, the served model's own
    embeddings, what `ecru serve probe` fits), else the first learned one."""
    learned = [n for n in preds if n != "constant"]
    return SHIPPED if SHIPPED in learned else learned[0]


def online_tables(
    idx, prompt_lens, lengths, preds, traj, repredict_s, base, cost, seed, *, slack=None
) -> dict:
    """Every policy at each load; load = arrival rate / cb's throughput with every request waiting at t=0.
    A plain name is the shipped configuration (`shipped` predictor, cb-srpt with its FCFS deadline and kept
    KV); study variants say what they change in brackets. With `slack`, the `[fcfs-slack]` policies too
    (aging 0, that fcfs_slack)."""
    capacity = saturated_capacity(idx, prompt_lens, lengths, base, cost)
    policies = {"fcfs": ("fcfs", None, {}), "cb": ("cb", None, {})}
    primary = shipped(preds)
    for name in (n for n in preds if n != "constant"):
        tag = "" if name == primary else f"[{name}]"
        policies[f"cb-sjf{tag}"] = ("cb-sjf", name, {"predict_s": preds[name][1]})
        if traj:
            policies[f"cb-srpt{tag}"] = (
                "cb-srpt",
                name,
                {"predict_s": preds[name][1], "repredict_s": repredict_s},
            )
    policies["cb-sjf[free-predict]"] = ("cb-sjf", primary, {})
    if traj:
        srpt = {"predict_s": preds[primary][1], "repredict_s": repredict_s}
        for variant, change in STUDY.items():
            policies[f"cb-srpt{variant}"] = ("cb-srpt", primary, {**srpt, **change})
        policies["cb-srpt[free-predict]"] = ("cb-srpt", primary, {"repredict_s": repredict_s})
    if "probe" in preds:  # the probe reads the prompt prefill's own hidden states: prefill on arrival
        tag = "" if primary == "probe" else "[probe]"
        policies[f"cb-sjf{tag}[at-arrival]"] = ("cb-sjf", "probe", {"prefill_at_arrival": True})
        if traj:
            at_arrival = {"prefill_at_arrival": True, "repredict_s": repredict_s}
            policies[f"cb-srpt{tag}[at-arrival]"] = ("cb-srpt", "probe", at_arrival)
    policies["oracle-srpt"] = ("oracle-srpt", None, {})
    for variant, change in STUDY.items():
        policies[f"oracle-srpt{variant}"] = ("oracle-srpt", None, change)
    if slack is not None:
        policies |= slack_policies(preds, traj, repredict_s, slack)
    loads = {}
    for load in (0.8, 1.2, 2.0):
        arrivals = poisson_arrivals(len(idx), load * capacity, seed + 1)

        def trace_for(name, arrivals=arrivals):
            pred = preds[name][0] if name else preds[primary][0]
            return build_trace(idx, arrivals, prompt_lens, lengths, pred, traj)

        res = run_policies(trace_for, policies, base, cost)
        for r in res.values():
            r["mean_latency_x_cb"] = r["mean_latency_s"] / res["cb"]["mean_latency_s"]
            r["p99_latency_x_cb"] = r["p99_latency_s"] / res["cb"]["p99_latency_s"]
        loads[str(load)] = {"arrival_rate_per_s": load * capacity, "policies": res}
        print(f"load {load}: " + "; ".join(f"{n} {r['mean_latency_x_cb']:.2f}/{r['p99_latency_x_cb']:.2f}"
                                           for n, r in res.items()))  # fmt: skip
    return {"capacity": capacity, "loads": loads, "shipped_predictor": primary}


def slack_policies(preds, traj, repredict_s, slack) -> dict:
    """The `[fcfs-slack]` variants: no aging, the longest-waiting request first once past its FCFS deadline
    of `slack` (chosen on a validation trace) instead of the shipped one."""
    deadline = {"aging": 0.0, "fcfs_slack": slack}
    primary, out = shipped(preds), {}
    for name in (n for n in preds if n != "constant"):
        tag = "" if name == primary else f"[{name}]"
        out[f"cb-sjf{tag}[fcfs-slack]"] = ("cb-sjf", name, {"predict_s": preds[name][1], **deadline})
    if traj:
        srpt = {"predict_s": preds[primary][1], "repredict_s": repredict_s}
        out["cb-srpt[fcfs-slack]"] = ("cb-srpt", primary, {**srpt, **deadline})
    if "probe" in preds:
        tag = "" if primary == "probe" else "[probe]"
        out[f"cb-sjf{tag}[at-arrival][fcfs-slack]"] = (
            "cb-sjf",
            "probe",
            {"prefill_at_arrival": True, **deadline},
        )
    out["oracle-srpt[no-preempt][fcfs-slack]"] = ("oracle-srpt", None, {**deadline, **NO_PREEMPT})
    return out


def slack_sweep(idx, prompt_lens, lengths, preds, capacity, base, cost, seed) -> dict:
    """cb-sjf without aging at each of SLACKS on the test trace at load 1.2, per prompt-only predictor
    (prediction charged; the probe also free) and on the true lengths."""
    arrivals = poisson_arrivals(len(idx), 1.2 * capacity, seed + 1)
    out = {}
    for name, (pred, per_req) in preds.items():
        if name in ("constant", "pia"):
            continue
        trace = build_trace(idx, arrivals, prompt_lens, lengths, pred, None)
        out[name] = slack_curve(trace, base, cost, per_req)
        if per_req:
            out[f"{name}[free-predict]"] = slack_curve(trace, base, cost, 0.0)
    trace = build_trace(idx, arrivals, prompt_lens, lengths, lengths, None)
    out["oracle[no-preempt]"] = slack_curve(trace, base, cost, 0.0, policy="oracle-srpt", extra=NO_PREEMPT)
    return out


def clinc_banking(base, cost, args, *, slack=None) -> dict:
    """The hard second workload (CLINC150/Banking77 queries): the true lengths, prompt lengths and MiniLM
    predictions (fitted on 192 train labels) of bench/results/serve_bench_target.json's 256 held-out
    prompts; no answers were generated for them, so no re-prediction (cb-srpt) here."""
    setup = json.loads((RESULTS / "serve_bench_target.json").read_text())
    s, p = setup["setup"], setup["predictor"]
    lengths = [min(args.cap, int(n)) for n in s["true_lengths"]]
    preds = {"minilm": ([float(x) for x in s["predicted_lengths"]], p["predict_s"] / len(lengths))}
    idx = resample(len(lengths), args.requests, args.seed)
    static = static_table(idx, s["prompt_lens"], lengths, preds, cost, args.cap)
    online = online_tables(
        idx, s["prompt_lens"], lengths, preds, None, 0.0, base, cost, args.seed, slack=slack
    )
    metrics = {
        **length_metrics(preds["minilm"][0], lengths),
        "spearman": spearman(preds["minilm"][0], lengths),
    }
    return {"source": "bench/results/serve_bench_target.json (setup, predictor)", "cap_hit_share":
            sum(n >= args.cap for n in lengths) / len(lengths), "predictors": {"minilm": metrics},
            "static_throughput_x_fcfs": static, "capacity_requests_per_s": online["capacity"],
            "loads": online["loads"]}  # fmt: skip


def sweep(idx, prompt_lens, lengths, preds, traj, capacity, base, cost, repredict_s, seed) -> dict:
    """cb-sjf and cb-srpt without the FCFS deadline at load 1.2 over aging and preemption margins (latency x
    cb), with the shipped predictor."""
    arrivals = poisson_arrivals(len(idx), 1.2 * capacity, seed + 1)
    primary = shipped(preds)
    trace = build_trace(idx, arrivals, prompt_lens, lengths, preds[primary][0], traj)
    cb = simulate_online(trace, policy="cb", config=base, cost=cost)
    out = {}
    for aging, charge in itertools.product((0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), (True, False)):
        for policy, margin in (("cb-sjf", None), ("cb-srpt", 32.0), ("cb-srpt", 64.0), ("cb-srpt", 128.0)):
            extra = (
                {"preempt_margin": margin, "repredict_s": repredict_s, "fcfs_slack": math.inf}
                if margin
                else {}
            )
            predict_s = preds[primary][1] if charge else 0.0
            r = simulate_policy(trace, policy, base, cost, {"aging": aging, "predict_s": predict_s, **extra})
            key = (
                f"{policy} aging={aging}"
                + (f" margin={margin:g}" if margin else "")
                + ("" if charge else " [free-predict]")
            )
            out[key] = {"mean_latency_x_cb": r.mean_latency_s / cb.mean_latency_s,
                        "p99_latency_x_cb": r.p99_latency_s / cb.p99_latency_s, "preemptions": r.preemptions}  # fmt: skip
            print(f"  {key}: {out[key]}")
    return out


if __name__ == "__main__":
    sys.exit(run_main(main))
