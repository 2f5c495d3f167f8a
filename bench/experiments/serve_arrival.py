"""Prefill on arrival on the real engine: the self-probe's length prediction for a dot product.

SmolLM2-135M-Instruct on the mixed workload (`ecru.serve.workload`): a `ProbePredictor` is fitted on
--train training prompts drawn with --seed (labels: the lengths of the cached greedy answers in
bench/results/serve_online_answers_train.jsonl, `ecru.serve.predict.labels`, capped at --cap; generated greedily
when missing), then --test unseen test prompts (drawn likewise), all arriving at once, are served by the request engine
under each policy, measured in this run:

- `cb`: first come first served, no predictor (the baseline);
- `cb+arrival`: cb with prefill on arrival (FCFS ignores the predictions: what prefilling at arrival costs);
- `cb-sjf+arrival`: shortest predicted first, the probe reading the engine's own prefill states;
- `cb-sjf+probe`: shortest predicted first, the probe predicting in `add_request` (a forward of its own per
  request, as before prefill on arrival).

Reported per policy: mean / p90 / max completion time and mean time to first token (seconds from the
moment every request was handed to the engine), wall time, forwards, peak KV tokens, whether the outputs
equal cb's. --repeats runs every policy again in a rotated order (the CPU is shared).

    OMP_NUM_THREADS=1 python bench/experiments/serve_arrival.py --json bench/results/serve_arrival.json
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from ecru.cliargs import ArgumentParser, positive_int, prepare_out_file
from ecru.io import atomic_write_json
from ecru.serve.engine.models import ServedModel
from ecru.serve.engine.request_engine import EngineConfig, RequestEngine
from ecru.serve.engine.sampling import SamplingParams
from ecru.serve.engine.static import GenerationConfig, generate_static
from ecru.serve.predict.labels import read_responses
from ecru.serve.predict.predictors import ProbePredictor, length_metrics, spearman
from ecru.serve.prompts import encode_chat

RESULTS = Path(__file__).resolve().parents[1] / "results"
CACHE_CAP = 256  # the cached answers' cap; a greedy answer's first `cap` tokens are its answer under `cap`
POLICIES = ("cb", "cb+arrival", "cb-sjf+arrival", "cb-sjf+probe")


def prompts_of(path: Path, n: int, seed: int) -> list[str]:
    """`n` prompts drawn with `seed` (the cache is sorted by answer length: its head holds the shortest)."""
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    return random.Random(seed).sample(prompts, n)


def true_lengths(served: ServedModel, prompts: list[str], cap: int, cache: Path) -> list[int]:
    """Greedy answer lengths under `cap`: from the cache (SmolLM2's answers), else generated."""
    cached = (
        read_responses(cache, max_new_tokens=CACHE_CAP, model_key="smollm2")
        if served.name == "smollm2"
        else {}
    )
    missing = [p for p in prompts if p not in cached]
    gen = GenerationConfig(eos_token_ids=served.eos_token_ids, pad_token_id=served.pad_token_id)
    for i in range(0, len(missing), 16):
        chunk = missing[i : i + 16]
        out = generate_static(
            served.model, encode_chat(served.tokenizer, chunk), max_new_tokens=cap, config=gen
        )
        cached.update(zip(chunk, out.tokens, strict=True))
    return [min(cap, len(cached[p])) for p in prompts]


def make_engine(served: ServedModel, policy: str, probe: ProbePredictor, texts: dict, config: EngineConfig):
    """The engine for `policy`, and the seconds its add_request predictions took (a list, filled later)."""
    spent: list[float] = []

    def predict(prompt, params) -> float:  # the probe on its own: a prompt forward per request
        start = time.perf_counter()
        length = probe.predict([texts[tuple(prompt)]])[0]
        spent.append(time.perf_counter() - start)
        return length

    base, _, how = policy.partition("+")
    engine = RequestEngine(served.model, eos_token_ids=served.eos_token_ids, pad_token_id=served.pad_token_id,
                           config=EngineConfig(**{**config.__dict__, "policy": base}),
                           tokenizer=served.tokenizer, context_len=served.context_len,
                           predict=predict if how == "probe" else None,
                           state_predictor=probe if how == "arrival" else None)  # fmt: skip
    return engine, spent


def serve(served, policy, probe, texts, ids, config) -> dict:
    """Every request handed to the engine at once, served to the end; times from that moment."""
    engine, spent = make_engine(served, policy, probe, texts, config)
    params = SamplingParams(max_tokens=config.max_new_tokens)
    start = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in ids]
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    done = sorted(r.finish_s - start for r in reqs)
    s = engine.stats
    return {
        "mean_completion_s": statistics.fmean(done),
        "p90_completion_s": done[int(0.9 * (len(done) - 1))],
        "max_completion_s": done[-1],
        "mean_ttft_s": statistics.fmean(r.first_token_s - start for r in reqs),
        "wall_s": wall,
        "add_request_predict_s": sum(spent),
        "arrival_prefill_forwards": s.arrival_prefill_forwards,
        "admission_prefill_forwards": s.prefill_forwards,
        "decode_steps": s.decode_steps,
        "peak_kv_tokens": s.peak_kv_tokens,
        "prefix_hit_tokens": s.prefix_hit_tokens,  # admissions only: arrival prefills compute every position
        "outputs": [r.output for r in reqs],
        "predicted": [r.predicted for r in reqs],
    }


def summarize(runs: dict[str, list[dict]], lengths: list[int]) -> dict:
    """Per policy: the mean of each figure over the repeats, and ratios to cb's."""
    out = {}
    for policy, rs in runs.items():
        figures = {
            k: statistics.fmean(r[k] for r in rs) for k, v in rs[0].items() if isinstance(v, float | int)
        }
        figures["per_repeat"] = [
            {k: v for k, v in r.items() if k not in ("outputs", "predicted")} for r in rs
        ]
        figures["outputs_equal_cb"] = sum(
            a == b for a, b in zip(rs[0]["outputs"], runs["cb"][0]["outputs"], strict=True)
        )
        figures["answer_lengths_equal_labels"] = sum(
            len(o) == n for o, n in zip(rs[0]["outputs"], lengths, strict=True)
        )
        out[policy] = figures
    for f in out.values():
        f["x_cb"] = {k: f[k] / out["cb"][k] for k in ("mean_completion_s", "p90_completion_s", "wall_s")}
    return out


def main(argv=None) -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--model", default="smollm2", help="smollm2, tiny (a smoke test) or a model folder")
    ap.add_argument("--train", type=positive_int, default=64, help="training prompts for the probe")
    ap.add_argument("--test", type=positive_int, default=48, help="test prompts, all arriving at once")
    ap.add_argument(
        "--cap", type=positive_int, default=128, help="max new tokens per request (and label cap)"
    )
    ap.add_argument("--max-batch-size", type=positive_int, default=16, help="rows decoded together")
    ap.add_argument("--refill-min", type=positive_int, default=4, help="the engine's refill_min")
    ap.add_argument("--seed", type=int, default=0, help="which train and test prompts are drawn")
    ap.add_argument("--repeats", type=positive_int, default=1, help="runs of every policy (rotated order)")
    args = ap.parse_args(argv)
    out_path = prepare_out_file(args.json, flag="--json")
    started = time.perf_counter()
    torch.manual_seed(0)
    served = ServedModel.load(args.model, packed=False)  # as in its committed results (before packing)
    train = prompts_of(RESULTS / "serve_online_answers_train.jsonl", args.train, args.seed)
    test = prompts_of(RESULTS / "serve_online_answers_test.jsonl", args.test, args.seed)
    y_train = true_lengths(served, train, args.cap, RESULTS / "serve_online_answers_train.jsonl")
    y_test = true_lengths(served, test, args.cap, RESULTS / "serve_online_answers_test.jsonl")
    probe = ProbePredictor(served.model, served.tokenizer, cap=args.cap).fit(train, y_train)
    ids = encode_chat(served.tokenizer, test)
    texts = {tuple(i): t for i, t in zip(ids, test, strict=True)}
    config = EngineConfig(
        max_batch_size=args.max_batch_size, max_new_tokens=args.cap, refill_min=args.refill_min
    )
    warm = EngineConfig(max_batch_size=args.max_batch_size, max_new_tokens=8, refill_min=args.refill_min)
    for policy in POLICIES:  # warm-up: every path's first forwards
        serve(served, policy, probe, texts, ids[: args.max_batch_size], warm)
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for rep in range(args.repeats):
        for policy in POLICIES[rep % len(POLICIES) :] + POLICIES[: rep % len(POLICIES)]:
            runs[policy].append(serve(served, policy, probe, texts, ids, config))
            r = runs[policy][-1]
            print(f"{policy:>15}: mean completion {r['mean_completion_s']:.2f} s, wall {r['wall_s']:.2f} s",
                  file=sys.stderr)  # fmt: skip
    standalone = runs["cb-sjf+probe"][0]["predicted"]
    on_arrival = runs["cb-sjf+arrival"][0]["predicted"]
    out = {
        "model": args.model,
        "workload": "mixed (ecru.serve.workload): --test unseen test prompts drawn with --seed, all arriving at once",
        "command": "python bench/experiments/serve_arrival.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {**config.__dict__, "train_prompts": len(train), "test_prompts": len(test)},
        "policies": summarize(runs, y_test),
        "probe_on_test": {**length_metrics(standalone, y_test), "spearman": spearman(standalone, y_test),
                          "arrival_vs_standalone_max_abs_diff": max(abs(a - b) for a, b in zip(on_arrival, standalone, strict=True))},
        "test_lengths": y_test,
        "wall_s": time.perf_counter() - started,
    }  # fmt: skip
    atomic_write_json(out_path, out)
    for policy, f in out["policies"].items():
        print(f"{policy:>15}: mean completion x cb {f['x_cb']['mean_completion_s']:.2f}, wall x cb "
              f"{f['x_cb']['wall_s']:.2f}, outputs equal cb {f['outputs_equal_cb']}/{len(test)}")  # fmt: skip


if __name__ == "__main__":
    main()
