"""`ecru lifelong`: a knowledge store you teach tasks to (learn, predict, tasks, forget, export), and `run`,
one method of the benchmark on the CLINC stream."""

from __future__ import annotations

import argparse
import json
import sys

from ecru.cliargs import (
    existing_file,
    non_negative_int,
    not_an_input,
    positive_int,
    prepare_out_dir,
    prepare_out_file,
    probability,
)
from ecru.io import atomic_write_json, atomic_write_text

METHOD_NAMES = ("zeroshot", "ncm", "seqft", "lwf", "replay", "wise-ft", "zscl", "independent", "joint",
                "seqlora", "lora-per-task", "shared-lora-zscl", "routed-lora", "routed-lora-proto",
                "routed-lora-knn")  # fmt: skip
OLD_NAMES = ("ecru", "ecru-shared")  # still accepted (ecru.lifelong.methods.ALIASES)


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lifelong_command", metavar="COMMAND", required=True)
    _configure_store(sub)
    _configure_run(sub)


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, metavar="DIR", help="the knowledge store folder")


def _configure_store(sub) -> None:
    learn = sub.add_parser(
        "learn", help="teach the store a task from a JSONL/CSV file of text,label examples"
    )
    _store_arg(learn)
    learn.add_argument("--task", required=True, help="task name; learning it again replaces it")
    learn.add_argument(
        "--data", required=True, type=existing_file, help='JSONL {"text","label"} or CSV text,label'
    )
    learn.add_argument("--model", default=None, metavar="PATH",
                       help="encoder folder for a new store (Hugging Face, sentence-transformers style); "
                            "default: the bundled all-MiniLM-L6-v2")  # fmt: skip
    learn.add_argument("--epochs", type=positive_int, default=3, help="passes over the examples")
    learn.add_argument("--batch-size", type=positive_int, default=16, help="examples per step")
    learn.add_argument("--seed", type=non_negative_int, default=0, help="training seed")
    learn.set_defaults(func=_learn)

    predict = sub.add_parser(
        "predict", help="label each text of a JSONL/CSV file, one JSON line per input line"
    )
    _store_arg(predict)
    predict.add_argument("--data", required=True, type=existing_file, help='JSONL {"text"[,"label"]} or CSV')
    predict.add_argument(
        "--out", required=True, metavar="FILE", help='output JSONL: {"text","label","score"}'
    )
    which = predict.add_mutually_exclusive_group()
    which.add_argument(
        "--labels", default=None, help="comma-separated candidate labels (default: all learned)"
    )
    which.add_argument(
        "--labels-file", type=existing_file, default=None, help="candidate labels, one per line"
    )
    predict.add_argument("--abstain", action="store_true",
                         help='a text no learned task claims gets "label": null and a "reason" '
                              "(unlearned --labels still answer it zero-shot)")  # fmt: skip
    predict.add_argument("--min-score", type=probability, default=None, metavar="P",
                         help='"label": null when the answer\'s probability is below P')  # fmt: skip
    predict.set_defaults(func=_predict)

    tasks = sub.add_parser("tasks", help="list the learned tasks")
    _store_arg(tasks)
    tasks.add_argument("--json", default=None, metavar="FILE", help="also write the list as JSON here")
    tasks.set_defaults(func=_tasks)

    forget = sub.add_parser("forget", help="remove a learned task")
    _store_arg(forget)
    forget.add_argument("--task", required=True, help="the task to remove")
    forget.set_defaults(func=_forget)

    export = sub.add_parser("export", help="write one standard peft adapter folder per task")
    _store_arg(export)
    export.add_argument("--out", required=True, metavar="DIR", help="export folder; created if missing")
    export.set_defaults(func=_export)


def _existing_store(path: str):
    from pathlib import Path

    from ecru.errors import EcruError
    from ecru.lifelong.store import KnowledgeStore

    if not (Path(path) / "store.json").is_file():
        raise EcruError(f"--store {path}: no knowledge store there; create one with `ecru lifelong learn`")
    return KnowledgeStore(path)


def _learn(args: argparse.Namespace) -> int:
    from ecru.lifelong.store import KnowledgeStore
    from ecru.lifelong.userdata import read_records

    records = read_records(args.data, labels=True)
    store = KnowledgeStore(args.store, model=args.model)
    info = store.learn(args.task, records, epochs=args.epochs, batch_size=args.batch_size, seed=args.seed,
                       progress=sys.stderr.isatty())  # fmt: skip
    print(f"learned {info['task']!r}: {info['examples']} examples, {len(info['labels'])} labels, "
          f"{info['trainable_params']:,} trainable parameters, {info['stored_bytes']:,} bytes stored")  # fmt: skip
    return 0


def _candidates(args: argparse.Namespace) -> list[str] | None:
    from ecru.errors import EcruError

    if args.labels is not None:
        labels = [x.strip() for x in args.labels.split(",") if x.strip()]
    elif args.labels_file is not None:
        labels = [
            x.strip() for x in args.labels_file.read_text(encoding="utf-8-sig").splitlines() if x.strip()
        ]
    else:
        return None
    if not labels:
        raise EcruError("--labels/--labels-file: no label given")
    from ecru.lifelong.userdata import label_name

    one = {}  # one candidate per label name (`freeze_account` and `freeze account` are one), as first written
    for label in labels:
        one.setdefault(label_name(label), label)
    return list(one.values())


def _predict(args: argparse.Namespace) -> int:
    from ecru.lifelong.userdata import label_name, read_records

    store = _existing_store(args.store)
    out = prepare_out_file(not_an_input(args.out, store.path, args.data))
    records = read_records(args.data, labels=False)
    labels = _candidates(args)
    if labels is not None:
        learned = {label_name(x) for x in store.learned_labels()}
        zero_shot = [x for x in labels if label_name(x) not in learned]
        if zero_shot:
            print(f"zero-shot (learned by no task): {', '.join(zero_shot)}", file=sys.stderr)
    preds = store.predict([r.text for r in records], labels, abstain=args.abstain, min_score=args.min_score)
    atomic_write_text(out, "".join(json.dumps(_prediction_row(p)) + "\n" for p in preds))
    print(f"wrote {len(preds)} predictions to {out}")
    abstained = sum(p.label is None for p in preds)
    if args.abstain or args.min_score is not None:
        print(f"abstained on {abstained} of {len(preds)}")
    if records[0].label is not None:
        right = sum(p.label is not None and label_name(p.label) == label_name(r.label)
                    for p, r in zip(preds, records, strict=True))  # fmt: skip
        print(
            f"accuracy {100 * right / len(records):.1f}% ({right}/{len(records)}, abstentions counted wrong)"
        )
    return 0


def _prediction_row(p) -> dict:
    row = {"text": p.text, "label": p.label, "score": round(p.score, 6)}
    return row if p.reason is None else {**row, "reason": p.reason}


def _tasks(args: argparse.Namespace) -> int:
    store = _existing_store(args.store)
    tasks = store.tasks()
    if args.json is not None:
        atomic_write_json(
            prepare_out_file(not_an_input(args.json, store.path, flag="--json"), flag="--json"), tasks
        )
    for t in tasks:
        print(f"{t['task']}: {len(t['labels'])} labels, {t['examples']} examples, "
              f"{t['trainable_params']:,} trainable parameters, {t['stored_bytes']:,} bytes")  # fmt: skip
    if not tasks:
        print("no tasks learned")
    return 0


def _forget(args: argparse.Namespace) -> int:
    _existing_store(args.store).forget(args.task)
    print(f"forgot {args.task!r}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from ecru.errors import EcruError

    store = _existing_store(args.store)
    if not store.tasks():
        raise EcruError(f"{args.store}: no learned task to export")
    out = prepare_out_dir(not_an_input(args.out, store.path))
    for folder in store.export(out):
        print(f"exported {folder}")
    return 0


def _configure_run(sub) -> None:
    run = sub.add_parser("run", help="train one method on the CLINC task stream, evaluating after every task")
    run.add_argument("--stream", default="clinc", choices=["clinc"], help="task stream (CLINC150 domains)")
    run.add_argument("--tasks", type=positive_int, default=10, help="number of domains in the stream (1..10)")
    run.add_argument("--order", type=non_negative_int, default=0, help="fixed domain order 0, 1 or 2")
    run.add_argument("--method", default="routed-lora", choices=METHOD_NAMES + OLD_NAMES,
                     help="continual-learning method")  # fmt: skip
    run.add_argument("--seed", type=non_negative_int, default=0, help="training and subsampling seed")
    run.add_argument(
        "--train-per-intent", type=positive_int, default=100, help="training utterances per intent"
    )
    run.add_argument("--test-per-intent", type=positive_int, default=30, help="test utterances per intent")
    run.add_argument(
        "--heldout-per-class", type=non_negative_int, default=40, help="Banking77 test utterances per class"
    )
    run.add_argument(
        "--reference-size", type=positive_int, default=2000, help="reference sentences for distillation"
    )
    run.add_argument("--epochs", type=positive_int, default=2, help="epochs per task")
    run.add_argument("--batch-size", type=positive_int, default=32, help="utterances per step")
    run.add_argument(
        "--checkpoint-dir", default=None, metavar="DIR", help="per-task checkpoints; resumes if present"
    )
    run.add_argument(
        "--json", default=None, metavar="FILE", help="write R, metrics, agnostic, gated, cost here"
    )
    run.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import torch

    from ecru.lifelong.experiment import Experiment
    from ecru.lifelong.methods import TrainConfig
    from ecru.lifelong.stream import StreamConfig

    out = None if args.json is None else prepare_out_file(args.json, flag="--json")
    ckpt = None if args.checkpoint_dir is None else prepare_out_dir(args.checkpoint_dir)
    torch.manual_seed(args.seed)
    stream = StreamConfig(tasks=args.tasks, order=args.order, train_per_intent=args.train_per_intent,
                          test_per_intent=args.test_per_intent, heldout_per_class=args.heldout_per_class,
                          reference_size=args.reference_size, seed=args.seed)  # fmt: skip
    train = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    result = Experiment(stream, log=log).run(args.method, train, checkpoint_dir=ckpt)
    a, g = result.agnostic, result.gated
    print(f"{result.method}: task-agnostic last {a['last']:.1f}  avg {a['avg']:.1f}  "
          f"transfer retention {a['transfer_retention']:+.1f}  banking77 change {a['heldout_change']:+.1f} | "
          f"label-gated last {g['last']:.1f}  bwt {g['bwt']:+.1f} | {result.cost['wall_s']:.1f} s/task")  # fmt: skip
    if out is not None:
        payload = {"config": {"stream": vars(stream), "train": vars(train)}, **result.to_json()}
        atomic_write_json(out, payload)
    return 0
