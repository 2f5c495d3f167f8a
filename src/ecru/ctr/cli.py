"""`ecru ctr ...`: train CTR models with large-batch recipes, score files with a trained model, and write
synthetic Criteo-format data.

ecru ctr synth --rows 100000 --out day_0.tsv
ecru ctr train --data criteo:day_0.tsv --batch-size 8192 --recipe cowclip --out runs/ctr
ecru ctr predict --model runs/ctr --data criteo:new.tsv --out scores.txt
ecru ctr schema --data clicks.csv > schema.json    # propose a schema for your own table
ecru ctr train --data table:clicks.csv --schema schema.json --out runs/mine
torchrun --nproc-per-node 2 -m ecru ctr train ...     # data parallel (gloo on CPU, nccl on GPU)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ecru.cliargs import (
    add_out_dir,
    existing_file,
    fraction,
    int_list,
    non_negative_int,
    positive_float,
    positive_int,
    removed_if_refused,
)

MODELS = ("deepfm", "wdl", "dcn", "dcnv2")
RECIPES = (
    "adam",
    "adam-sqrt",
    "linear",
    "cowclip",
    "tempered",
)  # ecru.cowclip.RECIPES (no torch import here)


def hash_buckets(text: str) -> int:
    """0 (vocabularies) or >= 2 (one bucket is the empty/unknown id, so 1 would leave none for tokens)."""
    value = non_negative_int(text)
    if value == 1:
        raise argparse.ArgumentTypeError("must be 0 (vocabularies) or >= 2, got 1")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ctr_command", metavar="COMMAND", required=True)
    _configure_train(sub.add_parser("train", help="train a CTR model; --out DIR saves it for `predict`"))
    p = sub.add_parser("predict", help="score a Criteo/Avazu file with a trained model folder")
    p.add_argument("--model", required=True, metavar="DIR", help="folder written by `ecru ctr train --out`")
    p.add_argument(
        "--data",
        required=True,
        help="criteo:FILE, avazu:FILE or table:FILE (or FILE: the model's format); label optional",
    )
    p.add_argument(
        "--schema", default=None, metavar="FILE", help="table: the schema (default: the model folder's)"
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="one click probability per input line (nan: a blank or skipped line); with --id-column, "
        "FILE.csv (id,probability) or FILE.jsonl",
    )
    p.add_argument(
        "--id-column",
        default=None,
        metavar="COL",
        help="write this column of the file (named in its header, e.g. Avazu's id) beside each probability",
    )
    p.add_argument("--batch-size", type=positive_int, default=65536, help="rows scored at once")
    p.add_argument(
        "--skip-malformed", action="store_true", help="write nan for malformed lines instead of stopping"
    )
    p.set_defaults(func=_predict)
    c = sub.add_parser("schema", help="propose a schema (JSON on stdout) for a CSV, TSV or Parquet table")
    c.add_argument("--data", required=True, metavar="FILE", help="the table (its first --rows rows are read)")
    c.add_argument("--rows", type=positive_int, default=10_000, help="rows sampled")
    c.set_defaults(func=_schema)
    s = sub.add_parser("synth", help="write synthetic Criteo-shaped rows as Criteo TSV (with the oracle)")
    s.add_argument("--rows", type=positive_int, default=100_000, help="rows to write")
    s.add_argument("--scale", type=positive_float, default=1e-2, help="cardinalities x this")
    s.add_argument("--seed", type=non_negative_int, default=0, help="seed of the teacher and the rows")
    s.add_argument(
        "--out", required=True, metavar="FILE", help="TSV file to write (folder created if missing)"
    )
    s.set_defaults(func=_synth)


def _configure_train(t: argparse.ArgumentParser) -> None:
    t.add_argument("--model", choices=MODELS, default="deepfm", help="CTR architecture")
    t.add_argument(
        "--data",
        default="synthetic",
        help="synthetic | criteo:FILE | avazu:FILE | table:FILE (with --schema)",
    )
    t.add_argument(
        "--schema",
        default=None,
        metavar="FILE",
        help="table:FILE's schema (JSON: label, dense, categorical, multi_hot; see docs/ctr.md)",
    )
    t.add_argument("--batch-size", type=positive_int, default=1024, help="global batch size")
    t.add_argument(
        "--recipe", choices=RECIPES, default="cowclip", help="scaling rule relative to --base-batch"
    )
    t.add_argument(
        "--mode",
        choices=("full", "sparse"),
        default="full",
        help="full: faithful full-table L2 + Adam; sparse: row-sparse updates (faster)",
    )
    t.add_argument(
        "--epochs", type=positive_int, default=10, help="most passes over the training split (see --patience)"
    )
    t.add_argument(
        "--patience",
        type=non_negative_int,
        default=1,
        help="stop once the validation AUC has not improved for this many epochs and keep the best epoch's "
        "model (0: train all --epochs, keep the last)",
    )
    t.add_argument(
        "--val-fraction",
        type=fraction,
        default=0.1,
        help="share of the training split held out as validation rows for --patience",
    )
    t.add_argument(
        "--embed-lr",
        type=positive_float,
        default=1e-3,
        help="Adam LR of the embeddings at --base-batch, scaled by the recipe (1e-3: the usual Adam default; "
        "the CowClip paper's 1e-4 was set for Criteo's 45M rows and under-trains a file of 0.1-1M rows)",
    )
    t.add_argument(
        "--base-batch", type=positive_int, default=1024, help="batch the recipe's base settings are for"
    )
    t.add_argument("--mlp", type=int_list, default=(400, 400, 400), help="hidden widths, comma-separated")
    t.add_argument(
        "--split", choices=("random", "chrono"), default="random", help="how the test rows are chosen"
    )
    t.add_argument("--test-fraction", type=fraction, default=0.1, help="held-out share of the rows")
    t.add_argument("--rows", type=positive_int, default=200_000, help="synthetic: number of rows")
    t.add_argument("--scale", type=positive_float, default=1e-2, help="synthetic: cardinalities x this")
    t.add_argument(
        "--hash-buckets", type=hash_buckets, default=0, help="files: hash ids per field (0: vocabularies)"
    )
    t.add_argument("--min-count", type=positive_int, default=10, help="files: vocabulary frequency threshold")
    t.add_argument("--skip-malformed", action="store_true", help="files: skip and count malformed lines")
    t.add_argument(
        "--group-field",
        default=None,
        metavar="FIELD",
        help="also report group AUC grouped by this categorical field: its name (a table's column, Criteo's "
        "C1..C26, an Avazu column) or its index from 0",
    )
    t.add_argument("--seed", type=non_negative_int, default=0, help="seed of the init, split and shuffles")
    t.add_argument(
        "--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)"
    )
    t.add_argument("--device", default="cpu", help="cpu or cuda")
    add_out_dir(t, overwrite=True)
    t.add_argument("--json", default=None, metavar="FILE", help="also write the metrics JSON here")
    t.set_defaults(func=_train)


def _data_id(spec: str, args: argparse.Namespace) -> str:
    """What the training rows depend on: the file's content hash (or the synthetic config) and the split."""
    from ecru.ctr.model_dir import file_digest

    source = spec if spec == "synthetic" else file_digest(spec.partition(":")[2])
    how = (args.split, args.test_fraction, args.seed, args.hash_buckets, args.min_count, args.skip_malformed)
    how += (_table_schema(args).to_json(),) if spec.startswith("table:") else ()
    how += (args.val_fraction,) if args.patience else ()
    synthetic = (args.rows, args.scale) if spec == "synthetic" else ()
    import hashlib

    return hashlib.blake2b(repr((source, how, synthetic)).encode(), digest_size=8).hexdigest()


def _data_spec(spec: str) -> tuple[str, str]:
    from ecru.errors import EcruError

    fmt, _, path = spec.partition(":")
    if fmt not in ("criteo", "avazu", "table") or not path:
        raise EcruError(f"--data must be synthetic, criteo:FILE, avazu:FILE or table:FILE, got {spec!r}")
    try:
        existing_file(path)
    except argparse.ArgumentTypeError as exc:
        raise EcruError(f"--data {exc}") from None
    return fmt, path


def load_data(spec: str, args: argparse.Namespace):
    """(train, test, info) for --data synthetic | criteo:FILE | avazu:FILE."""
    from ecru.ctr.data import restrict_vocabulary_to_train
    from ecru.ctr.reader import ReaderConfig, load_ctr_file
    from ecru.ctr.synthetic import SyntheticConfig, generate, oracle_summary, realised_oracle
    from ecru.errors import EcruError

    if spec == "synthetic":
        data = generate(SyntheticConfig(n_rows=args.rows, scale=args.scale, seed=args.seed))
        info = oracle_summary(data)
    else:
        fmt, path = _data_spec(spec)
        schema = _table_schema(args) if fmt == "table" else None
        buckets = schema.hash_buckets if schema else args.hash_buckets
        cfg = ReaderConfig(hash_buckets=buckets, min_count=args.min_count, skip_malformed=args.skip_malformed)
        data, skipped = load_ctr_file(path, schema or fmt, cfg=cfg)
        if skipped:
            print(f"skipped {skipped:,} malformed line(s) of {path}", file=sys.stderr)
        if data.labels.isnan().any():
            raise EcruError(f"{path} has no label column; training needs labelled rows")
        info = {"rows": len(data), "skipped_lines": skipped, "ids": sum(data.cardinalities)}
    if len(data) < 2:
        raise EcruError(f"{spec}: {len(data)} row(s) read; training needs more")
    split = (
        data.split_random(args.test_fraction, seed=args.seed)
        if args.split == "random"
        else data.split_chronological(args.test_fraction)
    )
    if spec == "synthetic":
        info["oracle_auc"], info["oracle_logloss"] = realised_oracle(split[1])
    elif not cfg.hash_buckets and not data.sequence_fields:  # the vocabulary: the training split's alone
        split = restrict_vocabulary_to_train(*split, min_count=args.min_count)
    return split[0], split[1], info


def _table_schema(args: argparse.Namespace):
    """The --schema of a table:FILE (read once per run)."""
    from ecru.ctr.schema import load_schema
    from ecru.errors import EcruError

    if not args.schema:
        raise EcruError("--data table:FILE needs --schema FILE (`ecru ctr schema --data FILE` proposes one)")
    if not hasattr(args, "_schema"):
        args._schema = load_schema(args.schema)
    return args._schema


def _init_distributed(device: str) -> tuple[int, str]:
    import os

    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, device
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), device


def _close_distributed() -> None:
    """Under torchrun: every rank done communicating, then the process group torn down together (a rank that
    exits while its peer is still connected can abort inside gloo)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


RUN_FILES = (
    "checkpoint.safetensors",
    "manifest.json",
    "config.json",
    "model.safetensors",
    "vocab.safetensors",
)
RUN_FILES += ("schema.json", "metrics.json")  # what a run writes in --out (--overwrite deletes them)


def _prepare_outputs(args: argparse.Namespace):
    """The --out folder and --json file, created and checked writable before any work."""
    from ecru.cliargs import not_an_input, prepare_out_dir, prepare_out_file
    from ecru.errors import EcruError
    from ecru.io import FolderLock

    if (args.resume or args.overwrite) and not args.out:
        raise EcruError("--resume and --overwrite act on the run in --out DIR; give --out")
    held = [f for f in RUN_FILES if args.out and (Path(args.out) / f).exists()]
    if held and not (args.resume or args.overwrite):
        raise EcruError(
            f"--out {args.out} already holds a run ({held[0]}); pass --resume to continue it, --overwrite to "
            "start again, or choose another --out"
        )
    out = prepare_out_dir(args.out) if args.out else None
    lock = None
    if out and int(os.environ.get("RANK", "0")) == 0:  # torchrun's ranks share one --out; rank 0 writes it
        lock = FolderLock(out, what="--out").acquire()  # a second run into it is refused, not interleaved
    for name in held if args.overwrite else ():
        (out / name).unlink(missing_ok=True)
    if args.json:
        data = None if args.data == "synthetic" else _data_spec(args.data)[1]
        json_file = prepare_out_file(not_an_input(args.json, data, args.schema, flag="--json"), flag="--json")
    else:
        json_file = None
    return out, json_file, lock


def _train(args: argparse.Namespace) -> int:
    from ecru.errors import EcruError

    if args.data != "synthetic":
        _data_spec(args.data)
    if args.data.startswith("table:"):  # the schema and the file's columns, before --out is created
        from ecru.ctr.reader import sniff_layout

        sniff_layout(Path(_data_spec(args.data)[1]), _table_schema(args))
    elif args.schema:
        raise EcruError("--schema describes a table; give --data table:FILE")
    args.group_index, args.group_name = _group_index(args)
    _check_device(args.device)
    with removed_if_refused(args.out, args.json and Path(args.json).parent):  # e.g. a label found not 0/1
        out, json_file, lock = _prepare_outputs(args)
        try:
            return _fit(args, out, json_file)
        finally:
            if lock is not None:
                lock.release()


def _field_names(args: argparse.Namespace) -> list[str]:
    """The single-valued categorical fields of --data, in field order (multi-hot fields come after them)."""
    if args.data == "synthetic":
        from ecru.ctr.synthetic import SyntheticConfig

        return [f"C{i}" for i in range(1, SyntheticConfig(n_rows=args.rows, scale=args.scale).fields + 1)]
    from ecru.ctr.reader import sniff_layout

    fmt, path = _data_spec(args.data)
    return sniff_layout(Path(path), _table_schema(args) if fmt == "table" else fmt).cats


def _group_index(args: argparse.Namespace) -> tuple[int | None, str | None]:
    """--group-field as (field index, name), checked before any work (a name, or an index below the field
    count)."""
    from ecru.errors import EcruError

    if args.group_field is None:
        return None, None
    names = _field_names(args)
    index = int(args.group_field) if args.group_field.isdigit() else None
    if index is None and args.group_field in names:
        index = names.index(args.group_field)
    if index is None or index >= len(names):
        raise EcruError(f"--group-field {args.group_field}: not a categorical field of {args.data}; give one of "
                        f"{', '.join(names[:30])}{' ...' if len(names) > 30 else ''} or an index below {len(names)}")  # fmt: skip
    return index, names[index]


def _check_device(device: str) -> None:
    import torch

    from ecru.errors import EcruError

    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise EcruError(f"--device {device!r}: not a device; use cpu or cuda[:N]") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise EcruError(
            f"--device {device}: no CUDA device here (torch {torch.__version__}); use --device cpu"
        )


def _fit(args: argparse.Namespace, out, json_file) -> int:
    import torch

    from ecru.ctr.training import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    rank, device = _init_distributed(args.device)
    train_data, test_data, info = load_data(args.data, args)
    val_data = None
    if (
        args.patience
    ):  # validation rows for early stopping, out of the training split (the test split stays unseen)
        train_data, val_data = train_data.split_random(args.val_fraction, seed=args.seed + 1)
    dataset = "avazu" if args.data.startswith("avazu:") else "criteo"
    cfg = TrainConfig(
        model=args.model,
        batch_size=args.batch_size,
        epochs=args.epochs,
        embed_lr=args.embed_lr,
        patience=args.patience or None,
        recipe=args.recipe,
        mode=args.mode,
        base_batch=args.base_batch,
        dataset=dataset,
        mlp=tuple(args.mlp),
        seed=args.seed,
        checkpoint=str(out / "checkpoint.safetensors") if out else None,
        resume=args.resume,
        device=device,
        data_id=_data_id(args.data, args),
    )
    res = train(cfg, train_data, test_data, val_data=val_data)
    _close_distributed()
    if rank:
        return 0
    metrics = _metrics(args, cfg, res, info, test_data)
    _report(args, res, info, metrics)
    if out:
        _save_folder(out, args, cfg, res, train_data, metrics)
    if json_file:
        from ecru.io import atomic_write_json

        atomic_write_json(json_file, metrics)
    return 0


def _metrics(args, cfg, res, info: dict, test_data) -> dict:
    import torch

    from ecru.ctr.metrics import group_auc
    from ecru.ctr.training import predict_probs

    metrics = {
        "data": args.data,
        **{k: v for k, v in info.items()},
        **{k: v for k, v in res.as_dict().items() if k != "losses"},
        "threads": torch.get_num_threads(),
        "config": {k: getattr(cfg, k) for k in ("model", "batch_size", "recipe", "mode")},
    }
    if args.group_index is not None:
        probs = predict_probs(res.model, test_data)
        metrics["group_auc"] = group_auc(test_data.labels, probs, test_data.cats[:, args.group_index])
        metrics["group_field"], metrics["group_field_name"] = args.group_index, args.group_name
    return metrics


def _report(args, res, info: dict, metrics: dict) -> None:
    print(
        f"{args.model} b={args.batch_size} recipe={args.recipe} mode={args.mode}: test AUC {res.auc:.5f} "
        f"logloss {res.logloss:.5f} ({res.steps} steps, {res.samples_per_s:,.0f} samples/s, "
        f"clipped {res.clip.clipped_fraction:.2%} of rows, ||g||/threshold max {res.clip.ratio_quantiles['max']:.3g})"
    )
    print(clip_note(res.recipe.clip, res.clip.clipped_fraction))
    if args.patience:
        from ecru.ctr.training import best_epoch

        best = best_epoch(res.history)
        print(
            f"early stopping: {len(res.history)} of {args.epochs} epoch(s) trained; kept epoch {best['epoch']} "
            f"(validation AUC {best['val_auc']:.5f})"
        )
    if "group_auc" in metrics:
        print(f"group AUC (by field {metrics['group_field_name']}) {metrics['group_auc']:.5f}")
    if "oracle_auc" in info:
        print(f"oracle (teacher FM) AUC {info['oracle_auc']:.5f} logloss {info['oracle_logloss']:.5f}")


def clip_note(clip_on: bool, clipped_fraction: float) -> str:
    """One line saying what the CowClip clip did in a run, and why it is near zero under a mean loss."""
    if not clip_on:
        return "clip: off for this recipe (only --recipe cowclip clips embedding gradients)"
    return (
        f"clip: {clipped_fraction:.2%} of the id rows updated were clipped; near zero is expected: under a mean "
        "loss each id's gradient is divided by the batch size and rarely exceeds its threshold "
        "(docs/ctr.md, 'Why the clip rarely fires')"
    )


def _save_folder(out, args, cfg, res, train_data, metrics: dict) -> None:
    from dataclasses import asdict

    from ecru.ctr.model_dir import save_model
    from ecru.io import atomic_write_json

    encoder = train_data.info.get("encoder")
    extra = {"train_config": asdict(cfg), "recipe": asdict(res.recipe), "data": args.data}
    save_model(
        out,
        res.model,
        encoder,
        name=args.model,
        data_format=args.data.partition(":")[0] if args.data.startswith(("avazu:", "table:")) else "criteo",
        extra=extra,
        schema=_table_schema(args).to_json() if args.data.startswith("table:") else None,
    )
    atomic_write_json(out / "metrics.json", metrics)
    note = "" if encoder else " (synthetic ids: `predict` needs a model trained on a file)"
    print(f"model saved to {out}/ (model.safetensors, config.json, metrics.json){note}")


def _predict(args: argparse.Namespace) -> int:
    from ecru.cliargs import not_an_input, prepare_out_file
    from ecru.ctr.metrics import auc, logloss
    from ecru.ctr.model_dir import load_model
    from ecru.errors import EcruError
    from ecru.io import atomic_write_text

    if args.id_column and Path(args.out).suffix not in ID_SUFFIXES:
        raise EcruError(f"--id-column writes FILE.csv or FILE.jsonl; got --out {args.out}")
    predictor = load_model(args.model)
    data = args.data.partition(":")[2] if ":" in args.data else args.data
    with removed_if_refused(Path(args.out).parent):
        out = prepare_out_file(not_an_input(args.out, args.model, data, args.schema))
        fmt, path = _data_spec(args.data) if ":" in args.data else (predictor.data_format, args.data)
        if ":" not in args.data:
            _data_spec(f"{fmt}:{path}")
        if fmt != predictor.data_format:
            raise EcruError(f"the model in {args.model} reads {predictor.data_format} files, not {fmt}")
        ids = read_id_column(path, args.id_column) if args.id_column else None
        probs, labels = _scores(args, predictor, fmt, path)  # one per input line, NaN for a blank one
        atomic_write_text(out, score_lines(probs.tolist(), ids, out.suffix))
    line = f"wrote {len(probs):,} click probabilities to {out}"
    known = ~(labels.isnan() | probs.isnan())
    if known.any() and (labels[known] == 1).any() and (labels[known] == 0).any():
        line += f"; the file has labels: AUC {auc(labels[known], probs[known]):.5f} logloss {logloss(labels[known], probs[known]):.5f}"
    print(line)
    return 0


def _scores(args: argparse.Namespace, predictor, fmt: str, path: str):
    """(probabilities, labels) of every data row of the file (NaN for a skipped malformed one)."""
    if fmt != "table":
        return predictor.predict_file(path, batch_size=args.batch_size, skip_malformed=args.skip_malformed)
    from ecru.ctr.schema import load_schema, predict_table
    from ecru.errors import EcruError

    if args.schema and load_schema(args.schema).to_json() | {"label": None} != load_schema(
        Path(args.model) / "schema.json"
    ).to_json() | {"label": None}:
        raise EcruError(
            f"--schema {args.schema} differs from the schema the model in {args.model} was trained with"
        )
    return predict_table(args.model, path, batch_size=args.batch_size, skip_malformed=args.skip_malformed)


def _is_parquet(path: str) -> bool:
    from ecru.ctr.reader import _is_parquet as parquet

    return parquet(Path(path))


def _schema(args: argparse.Namespace) -> int:
    import json

    from ecru.ctr.schema import propose_schema

    schema, facts = propose_schema(args.data, rows=args.rows)
    for name, seen in facts.items():
        print(
            f"{name}: {seen['kind']}, {seen['distinct']:,} distinct, {seen['empty']:,} empty", file=sys.stderr
        )
    if schema["label"] is None:
        print('no 0/1 column named like a label was found: set "label" yourself', file=sys.stderr)
    print(json.dumps(schema, indent=1))
    return 0


def read_id_column(path: str, column: str) -> list[str]:
    """The `column` of a file with a header (CSV, or TSV if its header has tabs), one entry per data line
    ("" for a blank or short line), so ids stay aligned with the scores."""
    import io

    import pyarrow as pa

    from ecru.errors import EcruError

    if _is_parquet(path):
        import pyarrow.parquet as pq

        names = pq.ParquetFile(path).schema_arrow.names
        if column not in names:
            raise EcruError(f"--id-column {column!r}: {path} has no such column ({names[:30]})")
        ids = pq.read_table(path, columns=[column]).column(0).cast(pa.string()).fill_null("")
        return ids.to_pylist()
    with pa.input_stream(path, compression="detect") as raw:
        lines = io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace", newline="")
        names = lines.readline().rstrip("\r\n")
        sep = "\t" if "\t" in names else ","
        if column not in names.split(sep):
            raise EcruError(f"--id-column {column!r}: {path}'s header has no such column ({names[:200]})")
        j = names.split(sep).index(column)
        return [(parts[j] if len(parts := line.rstrip("\r\n").split(sep)) > j else "") for line in lines]


ID_SUFFIXES = (".csv", ".jsonl")


def score_lines(probs: list[float], ids: list[str] | None, suffix: str) -> str:
    """One float per line; with ids, CSV (`id,probability`) or JSON lines (by the --out suffix)."""
    import csv
    import io
    import json

    from ecru.errors import EcruError

    if ids is None:
        return "".join(f"{p:.7g}\n" for p in probs)
    if len(ids) != len(probs):
        raise EcruError(f"{len(ids)} ids for {len(probs)} scores; cannot align them with the input lines")
    rounded = [None if p != p else float(f"{p:.7g}") for p in probs]  # NaN (blank/skipped): JSON null
    if suffix == ".jsonl":
        rows = zip(ids, rounded, strict=True)
        return "".join(json.dumps({"id": i, "probability": p}) + "\n" for i, p in rows)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["id", "probability"])
    writer.writerows((i, "nan" if p is None else f"{p:.7g}") for i, p in zip(ids, rounded, strict=True))
    return text.getvalue()


def _synth(args: argparse.Namespace) -> int:
    from ecru.cliargs import prepare_out_file
    from ecru.ctr.synthetic import SyntheticConfig, generate, oracle_summary, write_criteo_tsv
    from ecru.errors import EcruError

    with removed_if_refused(Path(args.out).parent):
        out = prepare_out_file(args.out)
        data = generate(SyntheticConfig(n_rows=args.rows, scale=args.scale, seed=args.seed))
        try:
            summary = oracle_summary(data)  # before writing: a refused run leaves no file
        except ValueError as exc:
            raise EcruError(f"--rows {args.rows}: {exc}; ask for more rows") from None
        path = write_criteo_tsv(data, out)
    print(
        f"wrote {len(data)} rows to {path}; oracle AUC {summary['oracle_auc']:.5f} logloss {summary['oracle_logloss']:.5f}"
    )
    return 0
