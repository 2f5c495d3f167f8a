"""`routed-lora`'s open-set test, measured on the full configuration from the frozen embeddings alone.

    python bench/experiments/lifelong_open_set.py --split val --json bench/results/lifelong_open_set_full.json   # choice
    python bench/experiments/lifelong_open_set.py --split test --json bench/results/lifelong_open_set_full.json  # report

Whether a text belongs to a learned task at all (the router's reject test), and how close an unlearned name
must come to overrule the route (`RoutedConfig.margin`), decide two of issue 17's targets, the Banking77
change and transfer retention, and nothing in them depends on the adapters: a text of an unlearned label set
is right only if it is answered with one of the unlearned candidates, and that choice is the frozen model's
(the route is rejected, or the frozen model's best cosine to the routed task's names plus the margin falls
below an unlearned name's: `RoutedEncoder._task_then_class`). So each rule is scored here exactly, for every
(seed, order) run of the full stream, with the router's own code (`LDARouter`) over frozen MiniLM
embeddings, in minutes instead of hours. One approximation: a Banking77 text whose label name is also a
learned one ("exchange rate") and that is accepted into the learning task is answered by the adapter in the
method and by the frozen model here (`shared_label_texts` counts them). What it cannot score: Last (the
adapters decide; the reject test does not change it: with only learned candidates a rejected text keeps its
route) and the within-task part of Last with Banking77's labels as candidates; `kept_with_heldout_labels` is
the share of learned texts that stay in their own task's labels there (an upper bound of that Last).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from ecru.io import merge_json
from ecru.lifelong.evaluate import Evaluator
from ecru.lifelong.methods import ROUTED
from ecru.lifelong.router import FROZEN, LDARouter
from ecru.lifelong.stream import StreamConfig, build_clinc_stream
from ecru.models import load_minilm

FULL = dict(tasks=10, train_per_intent=100, test_per_intent=30, heldout_per_class=40, reference_size=1)
_P = ROUTED["routed-lora"]
RULES = {
    "prototype test, percentile 10 (routed-lora before)": (10.0, None, 0.0),
    **{f"prototype test, percentile {p:g}": (p, None, 0.0) for p in (12.0, 14.0, 16.0)},
    **{f"prototype {p:g} + relative Mahalanobis {q:g}": (p, q, 0.0) for p in (0.0, 5.0, 10.0) for q in (5.0, 10.0, 15.0)},
    **{f"prototype {p:g} + relative Mahalanobis {q:g}, margin {m:g}": (p, q, m)
       for p, q in ((10.0, 5.0), (10.0, 10.0), (0.0, 5.0)) for m in (-0.01, -0.02, -0.03, -0.04, -0.05, -0.06)},
}  # fmt: skip
"""(prototype percentile, relative Mahalanobis percentile or None, margin) per rule; the preset is one of them."""
PRESET = f"prototype {_P.percentile:g} + relative Mahalanobis {_P.rmd_percentile:g}" + (
    f", margin {_P.margin:g}" if _P.margin else ""
)
assert RULES[PRESET] == (_P.percentile, _P.rmd_percentile, _P.margin), "the preset must be one of the rules"


class Frozen:
    """Frozen MiniLM embeddings, memoised by text (the runs share most of their texts)."""

    def __init__(self):
        self.model, self.memo = load_minilm().eval(), {}

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> torch.Tensor:
        todo = [t for t in dict.fromkeys(texts) if t not in self.memo]
        for i in tqdm(range(0, len(todo), 512), desc="frozen embeddings", disable=not todo, leave=False):
            chunk = todo[i : i + 512]
            self.memo.update(zip(chunk, self.model.encode(chunk, batch_size=64), strict=True))
        return torch.stack([self.memo[t] for t in texts])


def answers(routes: torch.Tensor, accepted: torch.Tensor, scores: torch.Tensor, task_cols: list[list[int]],
            unlearned: list[int], margin: float = 0.0) -> torch.Tensor:  # fmt: skip
    """The column each text is answered with: rejected texts, and texts whose routed task's best name plus
    `margin` loses to an unlearned candidate, get the frozen model's best unlearned candidate; the others the frozen
    model's best name of their task (the adapter's choice in the method: only the group is exact)."""
    best_u = scores[:, unlearned].max(-1)
    out = torch.tensor(unlearned)[best_u.indices]
    for t in routes.unique().tolist():
        rows = ((routes == t) & accepted).nonzero().flatten()
        if len(rows):
            own = scores[rows][:, task_cols[t]].max(-1)
            win = own.values + margin >= best_u.values[rows]
            out[rows[win]] = torch.tensor(task_cols[t])[own.indices[win]]
    return out


class Scored:
    """One stream's label columns and frozen scores, as `Evaluator` lays them out."""

    def __init__(self, ev: Evaluator, emb: dict):
        col, self.T, self.sp, self.ev, self.emb = ev.column, len(ev.task_names), ev.spans, ev, emb
        self.task_cols = [[col[n] for n in names] for names in ev.task_names]
        self.held = [col[n] for n in ev.heldout_names]
        self.S, self.gold = emb["eval"] @ emb["names"].T, torch.tensor([col[g] for g in ev.gold])
        self.rows = [slice(self.sp[j], self.sp[j + 1]) for j in range(self.T)]
        # the frozen model on each task among its own labels: the transfer baseline, the same for every rule
        self.r0 = [self.accuracy(torch.tensor(c)[self.S[r][:, c].argmax(-1)], r)
                   for c, r in zip(self.task_cols, self.rows, strict=True)]  # fmt: skip

    def answers(self, router: LDARouter, rows: slice, own: list[int], margin: float = 0.0) -> torch.Tensor:
        """Answers of the texts `rows` among the router's learned labels plus `own` (their own label set)."""
        learned = {c for cols in self.task_cols[: len(router)] for c in cols}
        frozen = self.emb["eval"][rows]
        return answers(router(frozen, open_set=False), router(frozen) != FROZEN, self.S[rows],
                       self.task_cols[: len(router)], [c for c in own if c not in learned], margin)  # fmt: skip

    def accuracy(self, pred: torch.Tensor, rows: slice) -> float:
        return 100 * (pred == self.gold[rows]).float().mean().item()


def run_rule(sc: Scored, percentile: float, rmd: float | None, margin: float = 0.0) -> dict:
    """The rule's task-agnostic transfer retention and Banking77 change, and the shares it rejects."""
    T, sp, rows, router = sc.T, sc.sp, sc.rows, LDARouter(percentile=percentile, rmd_percentile=rmd)
    transfer, fit_s = [[] for _ in range(T)], 0.0
    for k in range(1, T + 1):
        start = time.process_time()
        router.add_task(sc.emb["train"][k - 1], labels=sc.emb["labels"][k - 1])
        fit_s += time.process_time() - start
        for j in range(k, T):  # texts of tasks not learned yet, among the learned labels and their own
            transfer[j].append(sc.accuracy(sc.answers(router, rows[j], sc.task_cols[j], margin), rows[j]))
    retention = sum(sum(t) / len(t) for t in transfer[1:]) / (T - 1) - sum(sc.r0[1:]) / (T - 1)
    learned_rows = slice(0, sp[T])
    kept = sc.answers(router, learned_rows, sc.held, margin)
    owner = torch.full((len(sc.ev.names),), -1)
    for t, cols in enumerate(sc.task_cols):
        owner[cols] = t
    text_task = torch.cat([torch.full((sp[j + 1] - sp[j],), j) for j in range(T)])
    return {"transfer_retention": retention,
            **heldout(sc, router, margin),
            "kept_with_heldout_labels": 100 * owner[kept].eq(text_task).float().mean().item(),
            "learned_rejected": 100 * (router(sc.emb["eval"][learned_rows]) == FROZEN).float().mean().item(),
            "router_fit_cpu_s_per_task": fit_s / T}  # fmt: skip


def heldout(sc: Scored, router: LDARouter, margin: float = 0.0) -> dict:
    """Banking77 after the last task (among the learned labels and its own) against before the first (its own
    labels): the change, the texts lost and gained, and how many of them owe it to a Banking77 label name
    that a task also learned ("exchange rate"), which a rejected text can never be answered with."""
    r = slice(sc.sp[sc.T], len(sc.ev.texts))
    gold, pred = sc.gold[r], sc.answers(router, r, sc.held, margin)
    first = torch.tensor(sc.held)[sc.S[r][:, sc.held].argmax(-1)]  # the frozen model's answer before
    shared = torch.tensor([c for c in sc.held if c in {c for cols in sc.task_cols for c in cols}])
    lost, gained = (first == gold) & (pred != gold), (first != gold) & (pred == gold)
    names = sc.ev.names
    pairs = Counter(
        f"{names[g]} -> {names[a]}" for g, a in zip(gold[lost].tolist(), pred[lost].tolist(), strict=True)
    )
    return {"heldout_change": sc.accuracy(pred, r) - sc.accuracy(first, r),
            "heldout_accepted": 100 * (router(sc.emb["eval"][r]) != FROZEN).float().mean().item(),
            "shared_label_texts": int(torch.isin(gold, shared).sum()),
            "heldout_lost": int(lost.sum()), "heldout_gained": int(gained.sum()),
            "heldout_lost_shared_gold": int((lost & torch.isin(gold, shared)).sum()),
            "heldout_gained_shared_before": int((gained & torch.isin(first, shared)).sum()),
            "heldout_lost_as": dict(pairs.most_common(12))}  # fmt: skip


def stream_embeddings(frozen: Frozen, stream, ev: Evaluator) -> dict:
    """Each task's training texts' frozen embeddings and class indices, the evaluation texts' (`ev`'s order)
    and the label names' (float32, as the method holds them)."""
    train = [frozen([e.text for e in t.train]) for t in stream.tasks]
    labels = [torch.tensor([t.intents.index(e.label) for e in t.train]) for t in stream.tasks]
    return {"train": train, "labels": labels, "eval": frozen(ev.texts), "names": frozen(ev.names)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", choices=["val", "test"], default="val", help="evaluation split (choose on val)")
    p.add_argument("--runs", default="0:0,1:1,2:2", help="(seed:order) pairs, as bench/lifelong.py --full")
    p.add_argument("--json", type=Path, default=None, help="write the results here, under the split's key")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    pairs = [tuple(int(x) for x in r.split(":")) for r in args.runs.split(",")]
    frozen, per_rule = Frozen(), {name: [] for name in RULES}
    for seed, order in pairs:
        stream = build_clinc_stream(StreamConfig(**FULL, split=args.split, seed=seed, order=order))
        ev = Evaluator(stream)
        scored = Scored(ev, stream_embeddings(frozen, stream, ev))
        for name, (percentile, rmd, margin) in tqdm(
            RULES.items(), desc=f"rules, run {seed}:{order}", leave=False
        ):
            per_rule[name].append(run_rule(scored, percentile, rmd, margin))
    out = {"split": args.split, "runs": args.runs, "stream": FULL, "preset": PRESET, "rules": {}}
    for name, runs in per_rule.items():
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if k != "heldout_lost_as"}
        out["rules"][name] = {"mean": mean, "per_run": runs}
        print(
            f"{name:<52} "
            + "  ".join(
                f"{k} {v:6.2f}"
                for k, v in mean.items()
                if not k.startswith(("shared", "heldout_lost", "heldout_gained", "router"))
            )
        )
    if args.json:
        merge_json(args.json, args.split, out)
        print(f"wrote {args.json} ({args.split!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
