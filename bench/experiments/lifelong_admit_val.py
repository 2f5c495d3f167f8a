"""How far a store's held-out texts should lower each task's router threshold (`RoutedConfig.admit`), chosen on
VALIDATION texts only, across task shapes.

    OMP_NUM_THREADS=1 python bench/experiments/lifelong_admit_val.py --json bench/results/lifelong_admit_val.json

A `KnowledgeStore` (the product path, seed 0) learns two CLINC domains from CLINC's train texts, the first I
intents of each with T texts per intent, for (I, T) in `SHAPES` and the domain pairs in `PAIRS`. Its learned
intents' validation texts (20 per intent) are predicted among every learned label; every validation text of the
never-taught domains in `UNTAUGHT` (15 intents x 20) is scored by the router. The label and probability of a text
do not depend on the thresholds (with `reject_penalty` the best task scores every text), so each admit rule is
applied afterwards to the same store: per task, the threshold is min(the prototype test's threshold on the kept
training texts, the rule's value on the held-out texts' prototype scores), and a text abstains when its claim
lies more than the rule's slack below it (`SLACKS`; the store's slack was 0.04), as `predict(..., abstain=True)`
does. Per rule and run:
learned texts answered right (abstentions counted wrong), the share of each never-taught domain abstained, and
|mean score - accuracy| on the answered texts. About 7 min on one thread; no test text is read (`--split test`
reads CLINC's test texts instead, to report how a rule chosen on validation carries over, never to choose).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from ecru.datasets import load_clinc
from ecru.io import atomic_write_json
from ecru.lifelong.calibration import holdout_split
from ecru.lifelong.router import loo_prototype_scores, routing_threshold
from ecru.lifelong.store import CALIBRATION, KnowledgeStore
from ecru.lifelong.userdata import label_name

SHAPES = ((4, 10), (6, 16), (8, 20), (10, 30))
PAIRS = (("travel", "kitchen_and_dining"), ("work", "utility"), ("small_talk", "meta"))
UNTAUGHT = ("auto_and_commute", "home", "banking")
QUANTILES = (0.0, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1)
CLAIM_SLACK = 0.04
"""The store's claim slack when this study ran (before `store.CLAIM_Z`, `lifelong_claim_val.py`)."""
SLACKS = (0.0, 0.02, 0.03, CLAIM_SLACK, 0.05)
Z = (1.5, 2.0, 2.5)


def rules() -> dict:
    """Candidate rules: (held-out prototype scores [n] -> a threshold, the task's own is min'd with it; slack)."""
    lowers = {f"quantile {q:g}": (lambda s, q=q: torch.quantile(s, q).item()) for q in QUANTILES}
    lowers |= {f"mean - {z:g} sd": (lambda s, z=z: (s.mean() - z * s.std()).item()) for z in Z}
    lowers |= {"quantile 1/n": lambda s: torch.quantile(s, 1 / len(s)).item(),
               "quantile 2/n": lambda s: torch.quantile(s, 2 / len(s)).item()}  # fmt: skip
    lowers["none (training texts' threshold)"] = lambda s: float("inf")
    return {f"{name}, slack {s:g}": (rule, s) for name, rule in lowers.items() for s in SLACKS}


def rows(
    clinc, domain: str, split: str, intents: int | None, per_intent: int | None
) -> list[tuple[str, str]]:
    out = []
    for intent in clinc.domains[domain][:intents]:
        out += [(e.text, e.label) for e in clinc[split] if e.label == intent][:per_intent]
    return out


def teach(
    clinc, pair: tuple[str, str], intents: int, texts: int, folder: Path
) -> tuple[KnowledgeStore, dict]:
    """A store in `folder` taught the pair's domains (`intents` x `texts` training texts each, 3 epochs), and
    the examples taught per domain."""
    store = KnowledgeStore(folder)
    taught = {d: rows(clinc, d, "train", intents, texts) for d in pair}
    for d, examples in taught.items():
        store.learn(d, examples, epochs=3)
    return store, taught


def run(clinc, pair: tuple[str, str], intents: int, texts: int, folder: Path, split: str = "val") -> dict:
    store, taught = teach(clinc, pair, intents, texts, folder)
    method = store.method()
    enc = method.encoder()
    base, held = [], []
    for task, examples in enumerate(taught.values()):
        labels = [label_name(label) for _, label in examples]
        # the store's seed 0, each task learned as index 0
        kept, out = holdout_split(labels, CALIBRATION, seed=0)
        idx = torch.tensor([method.names[task].index(labels[k]) for k in kept])
        own = loo_prototype_scores(enc.frozen([examples[k][0] for k in kept]), idx, len(method.names[task]))
        base.append(routing_threshold(own, None, percentile=method.cfg.percentile, negative_quantile=None))
        held.append(method.router.scores(enc.frozen([examples[k][0] for k in out]), [task])[:, 0].double())
    val = [r for d in pair for r in rows(clinc, d, split, intents, None)]
    preds = store.predict([t for t, _ in val])
    router = method.router

    def claims(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        picked, margin = router._picked(enc.frozen(texts), list(range(len(router))))
        return picked, margin.double() + torch.tensor(router.thresholds, dtype=torch.float64)[picked]

    learned = claims([t for t, _ in val])
    other = {d: claims([t for t, _ in rows(clinc, d, split, None, None)]) for d in UNTAUGHT}
    right = torch.tensor([p.label == label for p, (_, label) in zip(preds, val, strict=True)])
    score = torch.tensor([p.score for p in preds], dtype=torch.float64)
    out = {"pair": list(pair), "intents": intents, "texts": texts, "held_out": [len(h) for h in held],
           "accuracy_all": right.double().mean().item(), "rules": {}}  # fmt: skip
    for name, (rule, slack) in rules().items():
        thr = torch.tensor([min(b, rule(h)) for b, h in zip(base, held, strict=True)], dtype=torch.float64)
        answered = learned[1] - thr[learned[0]] >= -slack
        row = {"answered_right": (right & answered).double().mean().item(),
               "score_gap": abs(score[answered].mean() - right[answered].double().mean()).item()}  # fmt: skip
        for d, (picked, s) in other.items():
            row[f"abstained_{d}"] = (s - thr[picked] < -slack).double().mean().item()
        out["rules"][name] = row
    return out


def summary(runs: list[dict]) -> dict:
    """Per rule: the runs meeting both targets (answered right >= 0.90, each never-taught domain abstained >=
    0.80), the worst run's answered right, share abstained and score gap, and the worst slack to the targets."""
    out = {}
    for name in runs[0]["rules"]:
        rs = [r["rules"][name] for r in runs]
        right = min(r["answered_right"] for r in rs)
        abst = min(r[f"abstained_{d}"] for r in rs for d in UNTAUGHT)
        gap = max(r["score_gap"] for r in rs)
        passed = sum(
            r["answered_right"] >= 0.90 and min(r[f"abstained_{d}"] for d in UNTAUGHT) >= 0.80 for r in rs
        )
        out[name] = {"runs_passed": passed, "min_answered_right": right, "min_abstained": abst, "max_score_gap": gap,
                     "mean_answered_right": sum(r["answered_right"] for r in rs) / len(rs),
                     "mean_abstained": sum(r[f"abstained_{d}"] for r in rs for d in UNTAUGHT) / (3 * len(rs)),
                     "worst_slack": min(right - 0.90, abst - 0.80)}  # fmt: skip
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--shapes", default=",".join(f"{i}x{t}" for i, t in SHAPES), help="e.g. 6x16,8x20")
    p.add_argument("--split", default="val", choices=("val", "test"),
                   help="test: to report how the chosen rule carries over, never to choose it")  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    clinc, runs = load_clinc(), []
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    for intents, texts in shapes:
        for pair in PAIRS:
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(run(clinc, pair, intents, texts, Path(tmp) / "store", args.split))
            best = runs[-1]["rules"][f"quantile 0, slack {CLAIM_SLACK:g}"]
            print(f"{intents}x{texts} {'+'.join(pair)}: admit 0 {best}", file=sys.stderr, flush=True)
    table = summary(runs)
    ranked = sorted(table.items(), key=lambda kv: (-kv[1]["runs_passed"], -kv[1]["worst_slack"]))
    for name, row in ranked[:25]:
        print(f"{name:34s} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
    atomic_write_json(args.json, {"command": " ".join(["python", *sys.argv]), "summary": table, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
