"""Why label-routed `ecru` is weak in the class-incremental evaluation: routing vs what each adapter learned.

    OMP_NUM_THREADS=1 python bench/lifelong_ci.py --checkpoint runs/lifelong_full/ckpt/ecru-s0-o0/last.pt \
        --seed 0 --order 0 --json bench/results/lifelong_ci.json

Takes a finished full-configuration run of `ecru` (bench/lifelong.py --full --checkpoint-dir ...; test split)
and, for each domain's test utterances classified among all the learned intents (class-incremental after
the last task): the share the router sends to the domain's own adapter, the accuracy as evaluated (routed),
the accuracy when every utterance goes through its own adapter, the frozen model's accuracy, and the own
adapter's accuracy among the domain's own 15 intents only (task-incremental), and what a two-stage decision
would score: the router picks the task, its adapter picks among that task's intents only (right only if both
are). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ecru.datasets import humanize_intent
from ecru.lifelong import StreamConfig, TrainConfig, build_clinc_stream, make_method
from ecru.models import load_minilm

FULL = dict(tasks=10, train_per_intent=100, test_per_intent=30, heldout_per_class=40, reference_size=10)


def accuracy(emb: torch.Tensor, names: torch.Tensor, gold: torch.Tensor) -> float:
    return 100 * ((emb @ names.T).argmax(-1) == gold).double().mean().item()


def breakdown(method, stream) -> list[dict]:
    """Per domain: routing share and class-incremental accuracies over all the stream's intents."""
    enc = method.encoder()
    names = [humanize_intent(i) for t in stream.tasks for i in t.intents]
    label_emb = enc.encode_labels(names)
    rows, off = [], 0
    for j, task in enumerate(stream.tasks):
        own = names[off : off + len(task.intents)]
        texts = [e.text for e in task.test]
        gold = torch.tensor([task.intents.index(e.label) for e in task.test])
        forced = enc.encode_among(texts, own)  # the domain's own adapter for every utterance
        to_own = enc.routes_among(texts, names) == j
        within = (forced @ label_emb[off : off + len(own)].T).argmax(-1) == gold
        rows.append({
            "task": task.name,
            "routed_to_own_percent": 100 * to_own.double().mean().item(),
            # route, then classify among the routed task's intents only (task-id x within-task prediction)
            "ci_route_then_within": 100 * (to_own & within).double().mean().item(),
            "ci_routed": accuracy(enc.encode_among(texts, names), label_emb, gold + off),
            "ci_own_adapter": accuracy(forced, label_emb, gold + off),
            "ci_frozen": accuracy(enc.frozen(texts), label_emb, gold + off),
            "ti_own_adapter": accuracy(forced, label_emb[off : off + len(own)], gold),
        })  # fmt: skip
        off += len(task.intents)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="last.pt of a finished full `ecru` run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", type=int, default=0)
    ap.add_argument("--json", type=Path, default=Path("bench/results/lifelong_ci.json"))
    args = ap.parse_args(argv)
    if not args.checkpoint.is_file():
        raise SystemExit(f"{args.checkpoint} not found; fix: run bench/lifelong.py --full --methods ecru "
                         "--checkpoint-dir runs/lifelong_full/ckpt first")  # fmt: skip
    torch.set_num_threads(1)
    start = time.perf_counter()
    stream = build_clinc_stream(StreamConfig(**FULL, order=args.order, seed=args.seed))
    method = make_method("ecru", load_minilm(), train=TrainConfig(seed=args.seed, progress=False))
    method.load_state_dict(torch.load(args.checkpoint, weights_only=False)["method"])
    rows = breakdown(method, stream)
    keys = [k for k in rows[0] if k != "task"]
    print(f"{'domain':<20}" + "".join(f"{k:>22}" for k in keys))
    for r in rows:
        print(f"{r['task']:<20}" + "".join(f"{r[k]:>22.1f}" for k in keys))
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    print(f"{'mean':<20}" + "".join(f"{mean[k]:>22.1f}" for k in keys))
    out = {"config": {"checkpoint": str(args.checkpoint), "seed": args.seed, "order": args.order, "split": "test",
                      "wall_s": time.perf_counter() - start}, "per_domain": rows, "mean": mean}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
