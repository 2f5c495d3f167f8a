"""`ecru lifelong run`: one method on the CLINC stream, with progress, per-task checkpoints and JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

METHOD_NAMES = ("zeroshot", "seqft", "lwf", "replay", "wise-ft", "zscl", "independent", "joint",
                "seqlora", "lora-per-task", "ecru-shared", "ecru-text", "ecru")  # fmt: skip


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lifelong_command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="train one method on a task stream, evaluating after every task")
    run.add_argument("--stream", default="clinc", choices=["clinc"], help="task stream (CLINC150 domains)")
    run.add_argument("--tasks", type=int, default=10, help="number of domains in the stream (1..10)")
    run.add_argument("--order", type=int, default=0, help="fixed domain order 0, 1 or 2")
    run.add_argument("--method", default="ecru", choices=METHOD_NAMES, help="continual-learning method")
    run.add_argument("--seed", type=int, default=0, help="training and subsampling seed")
    run.add_argument("--train-per-intent", type=int, default=100, help="training utterances per intent")
    run.add_argument("--test-per-intent", type=int, default=30, help="test utterances per intent")
    run.add_argument("--heldout-per-class", type=int, default=40, help="Banking77 test utterances per class")
    run.add_argument("--reference-size", type=int, default=2000, help="reference sentences for distillation")
    run.add_argument("--epochs", type=int, default=2, help="epochs per task")
    run.add_argument("--batch-size", type=int, default=32, help="utterances per step")
    run.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="per-task checkpoints; resumes if present"
    )
    run.add_argument("--json", type=Path, default=None, help="write R, R0, metrics, heldout and cost here")
    run.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import torch

    from ecru.lifelong.experiment import Experiment
    from ecru.lifelong.methods import TrainConfig
    from ecru.lifelong.stream import StreamConfig

    torch.manual_seed(args.seed)
    stream = StreamConfig(tasks=args.tasks, order=args.order, train_per_intent=args.train_per_intent,
                          test_per_intent=args.test_per_intent, heldout_per_class=args.heldout_per_class,
                          reference_size=args.reference_size, seed=args.seed)  # fmt: skip
    train = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    result = Experiment(stream, log=log).run(args.method, train, checkpoint_dir=args.checkpoint_dir)
    m = result.metrics
    print(f"{args.method}: last {m['last']:.1f}  avg {m['avg']:.1f}  transfer {m['transfer']:.1f} "
          f"(retention {m['transfer_retention']:+.1f})  bwt {m['bwt']:+.1f}  "
          f"banking77 {result.heldout[0]:.1f} -> {result.heldout[-1]:.1f}  "
          f"{result.cost['wall_s']:.1f} s/task")  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"config": {"stream": vars(stream), "train": vars(train)}, **result.to_json()}
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    return 0
