"""How strongly a store's per-task fitted scale should lean on the preset's scale, chosen on VALIDATION streams only.

    OMP_NUM_THREADS=1 python bench/experiments/lifelong_scale_prior_val.py --json bench/results/lifelong_scale_prior_val.json

The quick streams of `lifelong_abstain_val.py` (3 CLINC domains, 4 training texts per intent, CLINC's validation
split, (seed, order) = (0, 0), (1, 1), (2, 2), (3, 0)): routed-lora (the preset, nothing held out) learns the
tasks, then its in-scope texts (CLINC val, 20 per intent) are scored among every learned label and `oos_val` sets
the abstention threshold (`evaluate.OOS_RECALL`). Per draw (20 per stream), `PER` texts of each intent play a
store's held-out texts: each task's scale is fitted on its own held-out texts' within-task scores
(`fit_scale(..., prior=score_scale, strength=k)`), and the ECE of the other answered texts is measured with the
scale of the task each text was routed to. k = 0 is plain temperature scaling, k = inf the preset's fixed scale.
About 1 min a stream on one thread; no `oos_test` text is read.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from ecru.datasets import humanize_intent, load_clinc
from ecru.io import atomic_write_json
from ecru.lifelong.calibration import expected_calibration_error, fit_scale
from ecru.lifelong.evaluate import OOS_RECALL
from ecru.lifelong.methods import TrainConfig, make_method
from ecru.lifelong.router import FROZEN
from ecru.lifelong.stream import StreamConfig, build_clinc_stream
from ecru.models import load_minilm

RUNS = ((0, 0), (1, 1), (2, 2), (3, 0))
PER = (1, 2, 5)
STRENGTHS = (0.0, 0.3, 1.0, 3.0, 10.0, 30.0, float("inf"))
DRAWS = 20


def scored_stream(seed: int, order: int) -> dict:
    """The learned stream's in-scope scores [N, L] among every learned label, gold [N], task [N], routed task [N]
    and whether each text is answered [N] (its claim above the `oos_val` threshold)."""
    stream = build_clinc_stream(StreamConfig(tasks=3, train_per_intent=4, test_per_intent=20, heldout_per_class=3,
                                             reference_size=400, split="val", seed=seed, order=order))  # fmt: skip
    train = TrainConfig(
        epochs=2, batch_size=16, lr=2e-5, scale=30.0, label_smoothing=0.2, seed=seed, progress=False
    )
    method = make_method("routed-lora", load_minilm(), train=train)
    for i, task in enumerate(stream.tasks):
        method.learn(task, index=i)
    names = [humanize_intent(i) for t in stream.tasks for i in t.intents]
    texts = [e.text for t in stream.tasks for e in t.test]
    oos = [e.text for e in load_clinc()["oos_val"]]
    enc = method.encoder()
    claim = enc.claim_scores(texts + oos)
    n = len(texts)
    return {
        "scores": enc.scores(texts, names).double(),
        "gold": torch.tensor([names.index(humanize_intent(e.label)) for t in stream.tasks for e in t.test]),
        "task": torch.tensor([k for k, t in enumerate(stream.tasks) for _ in t.test]),
        "routed": method.router(enc.frozen(texts), open_set=False),
        "answered": claim[:n] > torch.quantile(claim[n:], OOS_RECALL),
        "prior": method.scale(FROZEN),
    }


def draw_ece(s: dict, per: int, strength: float, g: torch.Generator) -> tuple[float, list[float]]:
    """One draw: `per` held-out texts per intent, each task's scale fitted on its own, the others' ECE."""
    held = torch.zeros(len(s["gold"]), dtype=torch.bool)
    for c in s["gold"].unique().tolist():
        idx = (s["gold"] == c).nonzero().flatten()
        held[idx[torch.randperm(len(idx), generator=g)[:per]]] = True
    scales = []
    for t in s["task"].unique().tolist():
        rows, cols = held & (s["task"] == t), s["gold"][s["task"] == t].unique()
        labels = torch.searchsorted(cols, s["gold"][rows])
        k = strength if strength != float("inf") else 0.0
        fitted = fit_scale(s["scores"][rows][:, cols], labels, prior=s["prior"], strength=k)
        scales.append(s["prior"] if strength == float("inf") else fitted)
    scale = torch.tensor([scales[r] for r in s["routed"].tolist()], dtype=torch.float64)
    conf = torch.softmax(scale[:, None] * s["scores"], -1).max(-1).values
    keep = ~held & s["answered"]
    right = s["scores"].argmax(-1) == s["gold"]
    return expected_calibration_error(conf[keep], right[keep]), scales


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    streams = [scored_stream(seed, order) for seed, order in RUNS]
    rows = {}
    for per in PER:
        for k in STRENGTHS:
            eces, scales = [], []
            for i, s in enumerate(streams):
                g = torch.Generator().manual_seed(i)
                for _ in range(DRAWS):
                    e, sc = draw_ece(s, per, k, g)
                    eces.append(e)
                    scales += sc
            e, sc = torch.tensor(eces), torch.tensor(scales)
            rows[f"per{per}_k{k:g}"] = {"per": per, "strength": k, "mean_ece": e.mean().item(),
                                        "p90_ece": e.quantile(0.9).item(), "scale_median": sc.median().item(),
                                        "scale_min": sc.min().item(), "scale_max": sc.max().item()}  # fmt: skip
            r = rows[f"per{per}_k{k:g}"]
            print(f"held-out per intent {per}  strength {k:>5g}  mean ECE {r['mean_ece']:.4f}  p90 "
                  f"{r['p90_ece']:.4f}  scales {r['scale_min']:.1f}..{r['scale_max']:.1f}")  # fmt: skip
    atomic_write_json(args.json, {"command": " ".join(["python", *sys.argv]), "prior": streams[0]["prior"],
                                  "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
