"""Where `routed-lora` loses points, and cheap what-ifs: train the adapters once, cache every embedding, then
score decision rules offline in seconds (task-agnostic protocol, validation split by default).

    python bench/experiments/lifelong_diagnose.py --cache runs/diag/quick_val.pt                      # quick stream, val
    python bench/experiments/lifelong_diagnose.py --cache runs/diag/medium_val.pt --tasks 5 --train-per-intent 16 \
        --test-per-intent 10 --heldout-per-class 5

Then `python bench/experiments/lifelong_rules.py CACHE...` scores decision rules on the caches. The cache holds, for the
evaluation texts (every task's val texts, then the Banking77 probe), the frozen embeddings, each learned
adapter's embeddings (an adapter never changes after its task, so the final adapters give every row of the
accuracy matrix) and the method's own scores after the last task; for the training texts, their frozen
embeddings (the LDA rules' statistics) and their embeddings through their own task's adapter (`train_adapted`:
the adapter prototypes); and the frozen embeddings of every label name and the router's state.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys
from pathlib import Path

import torch

from ecru.datasets import humanize_intent
from ecru.lifelong.evaluate import Evaluator
from ecru.lifelong.methods import ROUTED, TrainConfig, make_method
from ecru.lifelong.stream import StreamConfig, build_clinc_stream
from ecru.models import load_minilm


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, required=True, help="cache file (built if missing)")
    p.add_argument("--tasks", type=int, default=3, help="CLINC domains")
    p.add_argument("--train-per-intent", type=int, default=4, help="training texts per intent")
    p.add_argument("--test-per-intent", type=int, default=20, help="evaluation texts per intent")
    p.add_argument("--heldout-per-class", type=int, default=5, help="Banking77 texts per class")
    p.add_argument("--split", choices=["val", "test"], default="val", help="evaluation split")
    p.add_argument("--seed", type=int, default=0, help="stream and training seed")
    p.add_argument("--order", type=int, default=0, help="domain order")
    p.add_argument("--batch-size", type=int, default=16, help="training batch size")
    p.add_argument(
        "--skip-train-adapted",
        action="store_true",
        help="no effect (once: skip the training texts through every adapter; now each goes through its own "
        "task's adapter only, `train_adapted`); kept so recorded commands run and the cache's config keeps its fields",
    )
    p.add_argument("--epochs", type=int, default=2, help="epochs per task")
    p.add_argument("--config", default="", metavar="K=V[;K=V]", help="routed-lora preset fields to replace")
    p.add_argument("--label-smoothing", type=float, default=0.2, help="of the task loss")
    return p.parse_args(argv)


def build_cache(args) -> dict:
    cfg = StreamConfig(tasks=args.tasks, train_per_intent=args.train_per_intent,
                       test_per_intent=args.test_per_intent, heldout_per_class=args.heldout_per_class,
                       reference_size=400, split=args.split, seed=args.seed, order=args.order)  # fmt: skip
    stream = build_clinc_stream(cfg)
    ev = Evaluator(stream)
    train = TrainConfig(
        batch_size=args.batch_size,
        seed=args.seed,
        progress=False,
        epochs=args.epochs,
        label_smoothing=args.label_smoothing,
    )
    fields = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in args.config.split(";") if kv)}
    config = dataclasses.replace(ROUTED["routed-lora"], **fields)
    m = make_method("routed-lora", load_minilm(), train=train, config=config)
    for i, task in enumerate(stream.tasks):
        m.learn(task, index=i)
        print(f"learned {task.name}", file=sys.stderr, flush=True)
    return cache_of(m, stream, ev, vars(args) | {"cache": str(args.cache)})


@torch.no_grad()
def cache_of(m, stream, ev: Evaluator, config: dict) -> dict:
    """The cache of a `routed-lora` method `m` trained on every task of `stream` (`ev` its evaluator)."""
    enc = m.encoder()
    train_texts = [e.text for t in stream.tasks for e in t.train]
    out: dict = {"names": ev.names, "task_names": ev.task_names, "heldout_names": ev.heldout_names,
                 "gold": ev.gold, "spans": ev.spans, "name_emb": enc.frozen(ev.names),
                 "train_task": [i for i, t in enumerate(stream.tasks) for _ in t.train],
                 "train_gold": [humanize_intent(e.label) for t in stream.tasks for e in t.train],
                 "router": m.router.state_dict(), "config": config,
                 "method_config": dataclasses.asdict(m.cfg)}  # fmt: skip
    out["eval_frozen"] = enc.frozen(ev.texts)
    out["eval_adapted"] = torch.stack(
        [enc._embed(ev.texts, t, batch_size=64) for t in range(len(stream.tasks))]
    )
    out["scores"] = enc.scores(ev.texts, ev.names)  # the method's own scores after the last task
    print(f"encoded eval: {len(ev.texts)} texts", file=sys.stderr, flush=True)
    out["train_frozen"] = enc.frozen(train_texts)
    out["train_adapted"] = torch.cat(  # each training text through its own task's adapter
        [enc._embed([e.text for e in t.train], i, batch_size=64) for i, t in enumerate(stream.tasks)]
    )
    print(f"encoded train: {len(train_texts)} texts", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.cache.exists():
        print(f"{args.cache} exists; delete it to rebuild", file=sys.stderr)
        return 0
    args.cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(build_cache(args), args.cache)
    print(f"wrote {args.cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
