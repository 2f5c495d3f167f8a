"""Length predictors compared on the held-out prompts of a `bench/serve.py` run (its true lengths).

    OMP_NUM_THREADS=1 python bench/experiments/serve_predictors.py --bench bench/results/serve_bench.json \
        --labels bench/results/serve_labels_smollm2.jsonl --json bench/results/serve_predictors.json

Every predictor is trained on the same train-split labels (self-lora reuses the adapter the bench cached),
predicts the bench's prompts (timed), and its predictions are replayed through the simulator's static
policies on the measured lengths, next to the constant-median baseline and the oracle.

    OMP_NUM_THREADS=1 python bench/experiments/serve_predictors.py --cap-study \
        --labels bench/results/serve_labels_smollm2.jsonl --json bench/results/serve_cap_study.json

`--cap-study` asks whether a cheap feature separates the answers that run to the cap (34% at cap 256,
mostly greedy repetition loops) on the labelled train prompts: prompt length, domain, SmolLM2's
next-token entropy at the answer's start, probes on its prompt hidden states, MiniLM embeddings, and
SmolLM2's hidden state after its first k greedy answer tokens. Each feature set gets a logistic "hits the
cap" classifier (standardised, PCA to 16 dimensions when wider, C picked by inner CV), scored by 5-fold
CV AUC over 5 splits; its length prediction is the median of the predicted mixture (cap with
probability p, else the train non-cap lengths), scored by MAE / Acc-50 / Acc-100 against the train
median. The out-of-fold predictions (split 0) are replayed through the simulator (cost model: SmolLM2 on
one CPU thread, prediction charged as the forward passes it needs).

    OMP_NUM_THREADS=1 python bench/experiments/serve_predictors.py --learning-curve \
        --labels bench/results/serve_labels_smollm2.jsonl --bench bench/results/serve_bench_target.json \
        --json bench/results/serve_learning_curve.json

`--learning-curve` asks whether more labels would help: the train labels plus the bench run's held-out
true lengths (same cap) pooled, then the cap-hit AUC of the main feature sets on random subsets of
growing size (5 draws x 3 CV splits per size; the whole pool 3 splits).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from ecru.io import atomic_write_json

PREFIX_TOKENS = (16, 32)


@torch.no_grad()
def cap_features(model, tokenizer, texts, *, batch_size: int = 16) -> dict[str, np.ndarray]:
    """Per prompt: prompt length, next-token entropy, hidden-state probes, and the hidden state, EOS flag,
    mean entropy and distinct-token share after the first k greedy answer tokens (k in PREFIX_TOKENS)."""
    from ecru.serve.engine.static import left_pad, new_cache, positions
    from ecru.serve.prompts import encode_chat

    ids, eos, k_max = encode_chat(tokenizer, texts), tokenizer.eos_token_id, max(PREFIX_TOKENS)
    cols: dict[str, list] = {}
    add = lambda name, value: cols.setdefault(name, []).append(np.asarray(value))  # noqa: E731
    for i in range(0, len(ids), batch_size):
        x, mask = left_pad(ids[i : i + batch_size], tokenizer.pad_token_id)
        cache = new_cache(model)
        out = model(
            x,
            attention_mask=mask,
            position_ids=positions(mask),
            past_key_values=cache,
            output_hidden_states=True,
        )
        hs, m = out.hidden_states, mask[..., None].float()
        add("h_last", hs[-1][:, -1])
        add("h_mean", (hs[-1] * m).sum(1) / m.sum(1))
        add("h_mid", hs[len(hs) // 2][:, -1])
        logp = torch.log_softmax(out.logits[:, -1].float(), -1)
        add("entropy", -(logp.exp() * logp).sum(-1))
        add("top1", logp.max(-1).values.exp())
        done, length, toks, ents = torch.zeros(len(x), dtype=torch.bool), torch.zeros(len(x)), [], []
        for step in range(1, k_max + 1):
            tok = logp.argmax(-1)
            ents.append(-(logp.exp() * logp).sum(-1))
            toks.append(torch.where(done, -1, tok))
            length[(tok == eos) & ~done] = step
            done |= tok == eos
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(
                tok[:, None],
                attention_mask=mask,
                position_ids=positions(mask)[:, -1:],
                past_key_values=cache,
                output_hidden_states=True,
            )
            logp = torch.log_softmax(out.logits[:, -1].float(), -1)
            if step in PREFIX_TOKENS:
                valid = (torch.stack(toks, 1) >= 0).float()
                add(f"h{step}", out.hidden_states[-1][:, -1])
                add(f"ended{step}", done.float())
                add(f"len{step}", length.clone())
                add(f"ent{step}", (torch.stack(ents, 1) * valid).sum(1) / valid.sum(1))
                add(
                    f"distinct{step}",
                    [
                        len(set(r) - {-1}) / max(1, sum(t >= 0 for t in r))
                        for r in torch.stack(toks, 1).tolist()
                    ],
                )
    feats = {name: np.concatenate(v) for name, v in cols.items()}
    feats["prompt_len"] = np.array([len(p) for p in ids], dtype=float)
    feats["words"] = np.array([len(t.split()) for t in texts], dtype=float)
    return feats


def feature_sets(f: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, str]]:
    """Name -> (matrix, what predicting with it costs: "none", "prefill" or k prefix tokens)."""
    n = len(f["prompt_len"])
    cat = lambda *names: np.column_stack([f[k].reshape(n, -1) for k in names]).astype(float)  # noqa: E731
    sets = {
        "prompt length": (cat("prompt_len", "words"), "none"),
        "domain (banking vs clinc)": (cat("banking"), "none"),
        "length + domain": (cat("prompt_len", "words", "banking"), "none"),
        "minilm embedding": (cat("minilm"), "minilm"),
        "first-token entropy": (cat("entropy", "top1"), "prefill"),
        "probe: last-token hidden": (cat("h_last"), "prefill"),
        "probe: mean hidden": (cat("h_mean"), "prefill"),
        "probe: mid-layer hidden": (cat("h_mid"), "prefill"),
    }
    for k in PREFIX_TOKENS:
        sets[f"prefix {k}: entropy, distinct, EOS"] = (
            cat(f"ended{k}", f"ent{k}", f"distinct{k}", "prompt_len"),
            str(k),
        )
        sets[f"prefix {k}: hidden state"] = (cat(f"h{k}", f"ended{k}"), str(k))
    return sets


def _classifier(dim: int):
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    reduce = [PCA(n_components=16, random_state=0)] if dim > 20 else []
    return make_pipeline(
        StandardScaler(),
        *reduce,
        LogisticRegressionCV(
            Cs=8, cv=4, scoring="neg_log_loss", max_iter=5000, l1_ratios=(0,), use_legacy_attributes=False
        ),
    )


def mixture_median(p: np.ndarray, noncap: np.ndarray, cap: int) -> np.ndarray:
    """Median of "cap with probability p, else a draw from `noncap`": the MAE-optimal prediction."""
    return np.array([cap if q >= 0.5 else np.quantile(noncap, 0.5 / (1 - q)) for q in p])


def cross_validate(x, lengths, *, cap: int, seed: int, known=None):
    """Out-of-fold P(cap), mixture-median lengths and the train-fold median (the constant baseline)."""
    from sklearn.model_selection import StratifiedKFold

    hit = (lengths >= cap).astype(int)
    p, pred, const = (np.zeros(len(lengths)) for _ in range(3))
    for tr, te in StratifiedKFold(5, shuffle=True, random_state=seed).split(x, hit):
        p[te] = _classifier(x.shape[1]).fit(x[tr], hit[tr]).predict_proba(x[te])[:, 1]
        pred[te] = mixture_median(p[te], lengths[tr][hit[tr] == 0], cap)
        const[te] = np.median(lengths[tr])
    if known is not None:  # answers that ended inside the prefix have known lengths
        pred = np.where(known > 0, known, pred)
    return p, pred, const


def study_features(
    labels_path: str, *, cache: str | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
    """Features of the labelled prompts (SmolLM2 passes, domain, MiniLM), their greedy lengths, the cap."""
    from ecru.datasets import load_clinc
    from ecru.models import load_minilm
    from ecru.serve.engine.models import load_model
    from ecru.serve.predict.labels import read_labels

    labels = read_labels(labels_path)
    cap = min(r.max_new_tokens for r in labels)
    texts = [r.prompt for r in labels]
    lengths = np.array([min(r.greedy, cap) for r in labels], dtype=float)
    if cache and Path(cache).is_file():
        return dict(np.load(cache)), lengths, cap
    model, tok = load_model("smollm2")
    f = cap_features(model, tok, texts)
    clinc = {e.text for e in load_clinc()["train"]}
    f["banking"] = np.array([t not in clinc for t in texts], dtype=float)
    f["minilm"] = load_minilm().encode(texts).numpy()
    if cache:
        np.savez(cache, **f)
    return f, lengths, cap


class StudySimulator:
    """Replays predictions of the labelled prompts through the static policies; x fcfs per policy."""

    POLICIES = ("sorted", "fcr", "fcr+vbs")

    def __init__(self, prompt_lens, lengths, *, cap: int, cost, batch_size: int = 16):
        from ecru.serve import PlanConfig, TraceRequest, simulate

        self.rows, self.cost, self.simulate = list(zip(prompt_lens, lengths, strict=True)), cost, simulate
        self.plan, self.trace_request = PlanConfig(batch_size=batch_size, max_new_tokens=cap), TraceRequest
        self.base = self.run(lengths, "fcfs").samples_per_s  # fcfs reads no prediction

    def run(self, predicted, policy: str, predict_s: float = 0.0):
        trace = [
            self.trace_request(int(p), int(t), float(q))
            for (p, t), q in zip(self.rows, predicted, strict=True)
        ]
        return self.simulate(trace, policy=policy, config=self.plan, cost=self.cost, predict_s=predict_s)

    def results(self, predicted, predict_s: float) -> dict:
        return {pol: self.run(predicted, pol, predict_s) for pol in self.POLICIES}

    def speedups(self, predicted, predict_s: float) -> dict[str, float]:
        return {pol: r.samples_per_s / self.base for pol, r in self.results(predicted, predict_s).items()}


def evaluate_features(x, lengths, *, cap: int, known=None, seeds: int = 5) -> tuple[dict, np.ndarray, dict]:
    """CV AUC (mean, sd over splits), mean MAE / Acc-50 / Acc-100, split 0's predictions, and the constant's."""
    from sklearn.metrics import roc_auc_score

    from ecru.serve import length_metrics

    runs = [cross_validate(x, lengths, cap=cap, seed=seed, known=known) for seed in range(seeds)]
    mean = lambda ms: {k: float(np.mean([m[k] for m in ms])) for k in ms[0]}  # noqa: E731
    aucs = [roc_auc_score(lengths >= cap, p) for p, _, _ in runs]
    row = {"auc": float(np.mean(aucs)), "auc_sd": float(np.std(aucs))}
    row |= mean([length_metrics(pred, lengths) for _, pred, _ in runs])
    return row, runs[0][1], {"auc": 0.5, **mean([length_metrics(c, lengths) for _, _, c in runs])}


def _line(name: str, row: dict) -> str:
    sim = " ".join(f"{k} {v:.2f}" for k, v in row["sim_x_fcfs"].items())
    return (
        f"{name:>34}: AUC {row['auc']:.3f} +- {row.get('auc_sd', 0):.3f}  MAE {row['mae']:5.1f}  "
        f"Acc-50 {row['acc50']:.3f}  Acc-100 {row['acc100']:.3f}  predict {row['predict_s_modelled']:5.1f} s  sim x fcfs {sim}"
    )


def cap_study(args) -> None:
    from ecru.serve import SMOLLM2_CPU, CostModel

    f, lengths, cap = study_features(args.labels, cache=args.features_cache)
    cost = CostModel.load(args.cost_model) if args.cost_model else SMOLLM2_CPU
    sim = StudySimulator(f["prompt_len"], lengths, cap=cap, cost=cost)
    # prediction time: the forward passes each feature needs over all prompts, batches of 16 (MiniLM ~free)
    batches, longest = -(-len(lengths) // 16), int(f["prompt_len"].max())
    charge = {"none": 0.0, "minilm": 0.0, "prefill": batches * cost.prefill_time(16, longest)}
    charge |= {str(k): batches * cost.batch_time(16, longest, k) for k in PREFIX_TOKENS}
    setup = {"labels": args.labels, "n": len(lengths), "cap": cap, "cap_hitters": int((lengths >= cap).sum())}
    out = {
        "setup": setup
        | {
            "cost_model": cost.source,
            "oracle_sim_x_fcfs": sim.run(lengths, "oracle").samples_per_s / sim.base,
        }
    }
    for name, (x, kind) in feature_sets(f).items():
        known = np.where(f[f"ended{kind}"] > 0, f[f"len{kind}"], 0) if kind.isdigit() else None
        row, predicted, constant = evaluate_features(x, lengths, cap=cap, known=known)
        out[name] = row | {
            "predict_s_modelled": charge[kind],
            "sim_x_fcfs": sim.speedups(predicted, charge[kind]),
        }
        print(_line(name, out[name]))
    median = float(np.median(lengths))
    out["constant median"] = constant | {
        "predict_s_modelled": 0.0,
        "sim_x_fcfs": sim.speedups([median] * len(lengths), 0.0),
    }
    print(
        _line("constant median", out["constant median"]) + f"; oracle {out['setup']['oracle_sim_x_fcfs']:.2f}"
    )
    # FCR with one constant prediction c: a first pass capped at c, the longer answers rerun together
    out["constant_cap_sweep"] = {
        c: sim.speedups([c] * len(lengths), 0.0) for c in (48, 64, 87, 100, 128, 160, 192)
    }
    for c, x in out["constant_cap_sweep"].items():
        print(f"{'constant ' + str(c):>34}: sim x fcfs " + " ".join(f"{k} {v:.2f}" for k, v in x.items()))
    if Path(args.bench).is_file():  # the same sweep on a bench run's held-out lengths (its own cap)
        setup = json.loads(Path(args.bench).read_text())["setup"]
        held = StudySimulator(
            setup["prompt_lens"], setup["true_lengths"], cap=setup["max_new_tokens"], cost=cost
        )
        sweep = {c: held.speedups([c] * setup["n"], 0.0) for c in (16, 32, 48, 64, 87, 100)}
        out["held_out_constant_cap_sweep"] = {
            "bench": args.bench,
            "cap": setup["max_new_tokens"],
            "x_fcfs": sweep,
        }
        for c, x in sweep.items():
            print(
                f"{'held-out, constant ' + str(c):>34}: sim x fcfs "
                + " ".join(f"{k} {v:.2f}" for k, v in x.items())
            )
    atomic_write_json(args.json, out)
    print(f"wrote {args.json}")


CURVE_FEATURES = (
    "minilm embedding",
    "probe: last-token hidden",
    "prefix 16: hidden state",
    "prefix 32: hidden state",
    "prefix 32: entropy, distinct, EOS",
)


def learning_curve(args) -> None:
    import tempfile

    from sklearn.metrics import roc_auc_score

    from ecru.serve.prompts import load_prompts

    setup = json.loads(Path(args.bench).read_text())["setup"]
    texts = load_prompts(setup["prompts"], n=setup["n"], split="test")
    with tempfile.TemporaryDirectory() as tmp:  # the pooled labels, in the labels file's format
        pooled = Path(tmp) / "pooled.jsonl"
        held = [{"prompt": t, "lengths": [int(n)], "max_new_tokens": setup["max_new_tokens"]}
                for t, n in zip(texts, setup["true_lengths"], strict=True)]  # fmt: skip
        pooled.write_text(Path(args.labels).read_text() + "".join(json.dumps(r) + "\n" for r in held))
        f, lengths, cap = study_features(str(pooled), cache=args.features_cache)
    sets, rng, total = feature_sets(f), np.random.default_rng(0), len(lengths)
    sizes = sorted({n for n in (96, 192, 320, total) if n <= total})
    out = {"setup": {"labels": args.labels, "bench": args.bench, "n": total, "cap": cap,
                     "cap_hitters": int((lengths >= cap).sum())}}  # fmt: skip
    for name in CURVE_FEATURES:
        x, _ = sets[name]
        out[name] = {}
        for n in sizes:
            aucs = []
            for _ in range(5 if n < total else 1):
                idx = rng.permutation(total)[:n]
                for seed in range(3):
                    p, _, _ = cross_validate(x[idx], lengths[idx], cap=cap, seed=seed)
                    aucs.append(roc_auc_score(lengths[idx] >= cap, p))
            out[name][n] = {"auc": float(np.mean(aucs)), "auc_sd": float(np.std(aucs))}
            print(f"{name:>34} n={n:>4}: cap-hit AUC {np.mean(aucs):.3f} +- {np.std(aucs):.3f}", flush=True)
    atomic_write_json(args.json, out)
    print(f"wrote {args.json}")


BENCH = Path(__file__).resolve().parents[1]  # bench/: the product benchmark this study builds on
CLINC_LABELS = "bench/results/serve_labels_smollm2.jsonl"
"""Greedy SmolLM2 labels of CLINC/Banking train queries (the default workload of the earlier studies)."""


def main() -> None:
    from ecru.serve import SMOLLM2_CPU, length_metrics, timed_predict
    from ecru.serve.engine.models import load_model
    from ecru.serve.prompts import load_prompts

    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    from serve import BenchConfig, build_predictor

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default="bench/results/serve_bench.json")
    p.add_argument("--labels", default=None, help="train labels (default: the bench JSON's own train labels)")
    p.add_argument("--predictors", default="constant,minilm,probe,self-lora")
    p.add_argument("--lora-epochs", type=int, default=2)
    p.add_argument("--json", default="bench/results/serve_predictors.json")
    p.add_argument("--cap-study", action="store_true", help="which cheap features separate cap-hitters")
    p.add_argument("--learning-curve", action="store_true", help="cap-hit AUC against the labels' number")
    p.add_argument("--cost-model", default=None, help="--cap-study: cost model JSON (default: spec SmolLM2)")
    p.add_argument(
        "--features-cache", default=None, help="--cap-study, --learning-curve: .npz of the features (reused)"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.cap_study or args.learning_curve:  # studies of the CLINC/Banking labels unless told otherwise
        args.labels = args.labels or CLINC_LABELS
    if args.cap_study:
        return cap_study(args)
    if args.learning_curve:
        return learning_curve(args)
    bench = json.loads(Path(args.bench).read_text())
    setup = bench["setup"]
    texts = load_prompts(setup["prompts"], n=setup["n"], split="test")
    true = setup["true_lengths"]
    model, tok = load_model(setup["model"])
    sim = StudySimulator(
        setup["prompt_lens"],
        true,
        cap=setup["max_new_tokens"],
        cost=SMOLLM2_CPU,
        batch_size=setup["batch_size"],
    )
    results = {}
    for name in args.predictors.split(","):
        config = BenchConfig(
            model=setup["model"],
            prompts=setup["prompts"],
            n=setup["n"],
            max_new_tokens=setup["max_new_tokens"],
            predictor=name,
            labels=args.labels or setup.get("train_labels", CLINC_LABELS),
            lora_epochs=args.lora_epochs,
        )
        predictor = build_predictor(model, tok, config, dict(zip(texts, true, strict=True)))
        predicted, seconds = timed_predict(predictor, texts)
        runs = sim.results(predicted, seconds)
        cap_hit = [t >= setup["max_new_tokens"] for t in true]
        flagged = [q >= setup["max_new_tokens"] for q in predicted]  # predicted to run to the cap
        results[name] = {
            **length_metrics(predicted, true),
            "predict_s": seconds,
            "cap_hitters_flagged": sum(a and b for a, b in zip(cap_hit, flagged, strict=True))
            / max(1, sum(cap_hit)),
            "sim_x_fcfs": {pol: r.samples_per_s / sim.base for pol, r in runs.items()},
            "sim_failure_ratio": {pol: r.failure_ratio for pol, r in runs.items()},
        }
        r = results[name]
        print(
            f"{name:>10}: MAE {r['mae']:6.1f} Acc-50 {r['acc50']:.2f} Acc-100 {r['acc100']:.2f} "
            f"{seconds:6.1f} s  cap-hitters flagged {r['cap_hitters_flagged']:.2f}  sim x fcfs "
            + " ".join(f"{k} {v:.2f}" for k, v in r["sim_x_fcfs"].items())
        )
    results["oracle_sim_x_fcfs"] = sim.run(true, "oracle").samples_per_s / sim.base
    print(f"oracle sim x fcfs {results['oracle_sim_x_fcfs']:.2f}")
    atomic_write_json(args.json, results)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
