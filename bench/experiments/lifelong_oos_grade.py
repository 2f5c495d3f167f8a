"""Which in-scope grade `routed-lora` should give CLINC's out-of-scope benchmark on the FULL stream.

    OMP_NUM_THREADS=1 python bench/experiments/lifelong_oos_grade.py --split val --runs 0:0 --json bench/results/lifelong_oos_grade.json   # frozen grades: choice
    OMP_NUM_THREADS=1 python bench/experiments/lifelong_oos_grade.py --split test --runs 0:0 --json bench/results/lifelong_oos_grade.json  # report
    OMP_NUM_THREADS=1 python bench/experiments/lifelong_oos_grade.py --split val --adapters DIR_VAL     # train routed-lora (~25 min)
    OMP_NUM_THREADS=1 python bench/experiments/lifelong_oos_grade.py --split val --features DIR_VAL --json bench/results/lifelong_oos_grade.json
    (and the same two with --split test; DIR/checkpoint resumes: a copy of the benchmark's own
    `--full --checkpoint-dir D` run, D/routed-lora-s0-o0, gives its features without training)

`bench/lifelong.py`'s open-set rule abstains on a text whose grade is at most the `OOS_RECALL` quantile of
`oos_val`'s grades. For routed-lora the grade is the router's claim (`claim_margin`), which reads the frozen
embeddings only, so which texts are abstained is exact here without training any adapter, in minutes instead
of the hours a full run takes: the router the method builds after the 10 tasks (`LDARouter` with the preset's
tests, every training text; the benchmark holds none out) scores the in-scope texts of every task and
CLINC's out-of-scope texts. Each candidate grade, from the same frozen statistics:
- `claim`: the router's claim (the best task's prototype cosine standardised by its own texts' scores);
- `mahalanobis`: minus the squared Mahalanobis distance to the nearest learned class under the pooled shrunk
  covariance LDA keeps (Lee et al., 2018);
- `prototype`: the best class prototype's cosine; `knn-k`: the cosine to the k-th nearest training text.
On val, `oos_val` is split in halves: one sets the threshold, the other's recall is reported (and the
reverse, averaged). On test, all of `oos_val` sets it and `oos_test` is measured, as in the benchmark. The
in-scope cost is the share of in-scope texts abstained (an upper bound of the accuracy the rule costs: an
abstained text that was answered wrong costs nothing; the adapters decide which ones those are).
With `--adapters` (routed-lora trained, the benchmark's settings) the grades add the adapters' view: the
claim plus w x ln p (the answer's probability), or plus w x a within-task score of the text's best task
(`within_task`: the best blended score the product scores with, `best_within_task`; the adapter's cosine to
the names alone; the adapted embedding's cosine to the adapter's class means). The grade is chosen by its
AUROC against all of `oos_val` on the val split (threshold-free, every `oos_val` text), the weight too
(`routed.OPEN_SET_WITHIN_WEIGHT`); the quantile rows show what a threshold costs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from lifelong_open_set import FULL, Frozen, stream_embeddings  # this folder is on sys.path

from ecru.cliargs import run_main
from ecru.datasets import load_clinc
from ecru.errors import EcruError
from ecru.io import merge_json
from ecru.lifelong.evaluate import OOS_RECALL, Evaluator
from ecru.lifelong.methods import ROUTED
from ecru.lifelong.router import LDARouter, shrunk_covariance
from ecru.lifelong.stream import StreamConfig, build_clinc_stream

QUANTILES = (0.7, 0.75, 0.8, 0.82, 0.84, 0.86, 0.9)
_P = ROUTED["routed-lora"]


def grades(router: LDARouter, train: torch.Tensor, emb: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each candidate grade [Q] of the frozen embeddings `emb` [Q, D] (higher = more in scope)."""
    emb64 = emb.double()
    weight, bias, _ = router.head()
    cov = shrunk_covariance(sum(s.double() for s in router.scatters), sum(router.counts), sum(router.fourths))
    quad = ((emb64 @ torch.linalg.inv(cov)) * emb64).sum(-1)
    logits = emb64 @ weight.double().T + bias.double()
    protos = torch.cat(router.prototypes).double()
    sims = emb64 @ train.double().T
    top = sims.topk(10, dim=-1).values
    centred = router.claim_margin(emb, standardise=False).double()
    return {
        "claim": router.claim_margin(emb).double(),
        "centred": centred,
        "pooled-z": centred / torch.tensor(router.claim_sds).double().mean(),
        "mahalanobis": 2 * logits.max(-1).values - quad,
        "prototype": (emb64 @ protos.T).max(-1).values,
        "knn-1": top[:, 0],
        "knn-5": top[:, 4],
        "knn-10": top[:, 9],
    }


def auroc(inside: torch.Tensor, outside: torch.Tensor) -> float:
    """P(an in-scope text grades above an out-of-scope one), ties counted half."""
    diff = inside[:, None] - outside[None, :]
    return ((diff > 0).double().mean() + 0.5 * (diff == 0).double().mean()).item()


def rule(grade_in: torch.Tensor, fit: torch.Tensor, measure: torch.Tensor, q: float) -> tuple[float, float]:
    """(out-of-scope recall on `measure`, in-scope abstained share), both percent, with the threshold at the
    `q` quantile of the `fit` out-of-scope grades."""
    threshold = torch.quantile(fit, q)
    return 100 * (measure <= threshold).double().mean().item(), 100 * (
        grade_in <= threshold
    ).double().mean().item()


def run(frozen: Frozen, split: str, seed: int, order: int, oos_val: list[str], oos_test: list[str]) -> dict:
    stream = build_clinc_stream(StreamConfig(**FULL, split=split, seed=seed, order=order))
    ev = Evaluator(stream)
    emb = stream_embeddings(frozen, stream, ev)
    router = LDARouter(percentile=_P.percentile, rmd_percentile=_P.rmd_percentile)
    for train, labels in zip(emb["train"], emb["labels"], strict=True):
        router.add_task(train, labels=labels)
    inside = emb["eval"][: ev.spans[-1]]
    outside = frozen(oos_val + oos_test)
    g = grades(router, torch.cat(emb["train"]), torch.cat([inside, outside]))
    n, v = len(inside), len(oos_val)
    out = {}
    for name, grade in g.items():
        gi, gv, gt = grade[:n], grade[n : n + v], grade[n + v :]
        row = {"auroc_val": auroc(gi, gv), "auroc_test": auroc(gi, gt)}
        for q in QUANTILES:
            if split == "val":
                perm = torch.randperm(v, generator=torch.Generator().manual_seed(seed))
                a, b = gv[perm[: v // 2]], gv[perm[v // 2 :]]
                (r1, c1), (r2, c2) = rule(gi, a, b, q), rule(gi, b, a, q)
                row[f"q{q:g}"] = {"recall": (r1 + r2) / 2, "abstained": (c1 + c2) / 2}
            else:
                recall, cost = rule(gi, gv, gt, q)
                row[f"q{q:g}"] = {"recall": recall, "abstained": cost}
        out[name] = row
    return out


def adapter_features(split: str, seed: int, order: int, folder: Path) -> Path:
    """Train routed-lora on the benchmark's full stream (its training settings, resumable from `folder`) and
    write, for the in-scope texts, `oos_val` and `oos_test`, the answer's probability, whether it is right, the
    claim (standardised and centred) and `within_task`'s scores, to `folder`/features.safetensors (what
    `--features` reads)."""
    from safetensors.torch import save_file

    from ecru.lifelong.evaluate import confidences
    from ecru.lifelong.experiment import Experiment
    from ecru.lifelong.methods import TrainConfig

    bench = dict(FULL, reference_size=2000)
    train = TrainConfig(batch_size=32, seed=seed)
    exp = Experiment(StreamConfig(**bench, split=split, seed=seed, order=order), open_set_scale=train.scale)
    method = exp.make("routed-lora", train)
    exp.run(method, checkpoint_dir=folder / "checkpoint")
    ev, clinc = exp.evaluator, load_clinc()
    n = ev.spans[-1]
    texts = ev.texts[:n] + [e.text for e in clinc["oos_val"]] + [e.text for e in clinc["oos_test"]]
    names = list(dict.fromkeys(x for task in ev.task_names for x in task))
    enc = method.encoder()
    best, conf, _ = confidences(enc, texts, names, scale=train.scale)
    right = torch.tensor([names[b] == g for b, g in zip(best[:n].tolist(), ev.gold[:n], strict=True)])
    out = folder / "features.safetensors"
    save_file({"conf": conf.double(), "claim": enc.claim_scores(texts),
               "centred": enc.claim_scores(texts, standardise=False), "right": right.long(),
               **within_task(enc, texts)},
              str(out), metadata={"in_scope": str(n), "oos_val": str(len(clinc["oos_val"]))})  # fmt: skip
    return out


@torch.no_grad()
def within_task(enc, texts: list[str]) -> dict[str, torch.Tensor]:
    """[Q] per text, in its best task (the router's choice without the open-set veto): the best within-task
    score (`best_within_task`, the product's), the adapter's best cosine to the names alone and the adapted
    embedding's best cosine to the task's adapter class means."""
    m = enc.m
    frozen = enc.frozen(texts)
    routes = m.router(frozen, open_set=False)
    out = {k: torch.empty(len(texts), dtype=torch.float64) for k in ("name_cos_max", "adapter_proto_max")}
    for task in routes.unique().tolist():
        rows = (routes == task).nonzero().flatten()
        emb = enc._embed([texts[i] for i in rows.tolist()], task, batch_size=64)
        out["name_cos_max"][rows] = (emb @ enc.encode_labels(m.names[task]).T).max(-1).values.double()
        protos = m.adapter_prototypes[task][0].to(emb.dtype)  # the preset keeps them
        out["adapter_proto_max"][rows] = (emb @ protos.T).max(-1).values.double()
    return {"blend_max": enc.best_within_task(texts), **out}


WEIGHTS = (0.0, 0.5, 1.0, 2.0, 4.0)
"""w in the combined grades `claim + w ln p` (p: the answer's probability), in sd per nat; for the centred claim
w x 0.02 cosine per nat (the grade's name gives the weight it used)."""
WITHIN = {"blend_max": (0.1, 0.2, 0.4, 0.8), "name_cos_max": (0.1, 0.2, 0.4, 0.8),
          "adapter_proto_max": (0.1, 0.2, 0.4, 0.8)}  # fmt: skip
"""Cosine of the centred claim per unit of each within-task feature (`within_task`) in its combined grades."""


def candidates(feats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each combined grade [Q] (named by the weights it uses) from `adapter_features`' tensors."""
    log_p = feats["conf"].clamp(min=1e-12).log()
    out = {}
    for base in ("claim", "centred"):
        unit = 1.0 if base == "claim" else 0.02
        for w in WEIGHTS:
            out[f"{base} + {w * unit:g} ln p"] = feats[base] + w * unit * log_p
    for name, weights in WITHIN.items():
        if name not in feats or feats[name].isnan().any():
            continue
        out[name] = feats[name]
        for w in weights:
            out[f"centred + {w:g} {name}"] = feats["centred"] + w * feats[name]
    return out


def measure(grade: torch.Tensor, right: torch.Tensor, n: int, v: int, split: str, seed: int) -> dict:
    """One grade's AUROCs and, per quantile, out-of-scope recall, in-scope accuracy (abstentions wrong) and its
    cost against Last (val: `oos_val` halves, as `run`; test: all of `oos_val` sets, `oos_test` measures)."""
    last = 100 * right.double().mean().item()
    gi, gv, gt = grade[:n], grade[n : n + v], grade[n + v :]
    row = {"auroc_val": auroc(gi, gv), "auroc_test": auroc(gi, gt)}
    if split == "val":
        perm = torch.randperm(v, generator=torch.Generator().manual_seed(seed))
        a, b = gv[perm[: v // 2]], gv[perm[v // 2 :]]
        pairs = [(a, b), (b, a)]
    else:
        pairs = [(gv, gt)]
    for q in QUANTILES:
        cells = []
        for fit, held in pairs:
            threshold = torch.quantile(fit, q)
            cells.append((100 * (held <= threshold).double().mean().item(),
                          100 * (right & (gi > threshold)).double().mean().item()))  # fmt: skip
        recall, acc = (sum(c[i] for c in cells) / len(cells) for i in (0, 1))
        row[f"q{q:g}"] = {"recall": recall, "in_scope_accuracy": acc, "cost": last - acc}
    if split == "test":  # a bound, not a rule: the threshold set on oos_test itself at 70% recall
        kept = right & (gi > torch.quantile(gt, 0.7))
        row["cost_at_test_recall_70"] = last - 100 * kept.double().mean().item()
    return row


def mean_over_runs(rows: list[dict]) -> dict:
    """The elementwise mean of several runs' nested result dicts (same keys, numbers at the leaves)."""
    if isinstance(rows[0], dict):
        return {k: mean_over_runs([r[k] for r in rows]) for k in rows[0]}
    return sum(rows) / len(rows)


def combined(folder: Path, split: str, seed: int) -> dict:
    """Per combined grade (`candidates`), `measure` from `adapter_features`' file in `folder`."""
    from safetensors import safe_open

    path = folder / "features.safetensors"
    if not path.is_file():
        raise EcruError(
            f"--features {folder}: no features.safetensors there; write it first with --adapters {folder}"
        )
    with safe_open(str(path), "pt") as f:
        feats, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    n, v = int(meta["in_scope"]), int(meta["oos_val"])
    right = feats["right"].bool()
    grades = candidates(feats)
    return {"last": 100 * right.double().mean().item(),
            "grades": {name: measure(g, right, n, v, split, seed) for name, g in grades.items()}}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", choices=["val", "test"], default="val", help="evaluation split (choose on val)")
    p.add_argument("--runs", default="0:0,1:1,2:2", help="(seed:order) pairs, as bench/lifelong.py --full")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--adapters", type=Path, default=None, metavar="DIR",
                   help="instead: train routed-lora on the stream of the one --runs pair and write its features to DIR")  # fmt: skip
    p.add_argument("--features", default=None, metavar="DIR[,DIR...]",
                   help="instead: the combined grades from each DIR's features (written by --adapters), one DIR "
                        "per --runs pair, averaged")  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.runs.split(",")]
    if args.features is not None:
        folders = [Path(f) for f in str(args.features).split(",")]
        if len(folders) != len(pairs):
            raise EcruError(f"--features: {len(folders)} folders for {len(pairs)} --runs; give one per run")
        res = mean_over_runs(
            [combined(f, args.split, seed) for f, (seed, _) in zip(folders, pairs, strict=True)]
        )
        print(f"last {res['last']:.2f}")
        for name, row in res["grades"].items():
            cells = "  ".join(
                f"q{q:g} {row[f'q{q:g}']['recall']:5.1f}/{row[f'q{q:g}']['cost']:4.2f}" for q in QUANTILES
            )
            print(f"{name:<18} auroc val {row['auroc_val']:.4f} test {row['auroc_test']:.4f}  {cells}")
        if args.json:
            merge_json(args.json, f"adapters_{args.split}", {"runs": args.runs, **res})
        return 0
    if args.adapters is not None:
        if len(pairs) != 1:
            raise EcruError(f"--adapters trains one run; give --runs SEED:ORDER, not {args.runs}")
        print(f"wrote {adapter_features(args.split, *pairs[0], args.adapters)}")
        return 0
    clinc = load_clinc()
    oos_val, oos_test = [e.text for e in clinc["oos_val"]], [e.text for e in clinc["oos_test"]]
    frozen = Frozen()
    runs = [run(frozen, args.split, seed, order, oos_val, oos_test) for seed, order in pairs]
    mean = mean_over_runs(runs)
    for name, row in mean.items():
        cells = "  ".join(
            f"q{q:g} {row[f'q{q:g}']['recall']:5.1f}/{row[f'q{q:g}']['abstained']:4.1f}" for q in QUANTILES
        )
        print(f"{name:<12} auroc val {row['auroc_val']:.4f} test {row['auroc_test']:.4f}  {cells}")
    if args.json:
        merge_json(args.json, f"frozen_{args.split}", {"runs": args.runs, "stream": FULL,
                                                     "benchmark_quantile": OOS_RECALL, "mean": mean, "per_run": runs})  # fmt: skip
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
