"""`ecru ctr ...`: train CTR models with large-batch recipes, and write synthetic Criteo-format data.

ecru ctr train --model deepfm --data synthetic --batch-size 32768 --recipe cowclip --json out.json
torchrun --nproc-per-node 2 -m ecru ctr train ...     # data parallel (gloo on CPU, nccl on GPU)
ecru ctr synth --rows 100000 --out day_0.tsv
"""

from __future__ import annotations

import argparse

MODELS = ("deepfm", "wdl", "dcn", "dcnv2")
RECIPES = ("adam", "adam-sqrt", "linear", "cowclip", "ecru")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ctr_command", metavar="COMMAND", required=True)
    t = sub.add_parser("train", help="train a CTR model and report held-out AUC / logloss")
    t.add_argument("--model", choices=MODELS, default="deepfm")
    t.add_argument(
        "--data", default="synthetic", help="synthetic | criteo:PATH | avazu:PATH (default synthetic)"
    )
    t.add_argument("--batch-size", type=int, default=1024)
    t.add_argument(
        "--recipe", choices=RECIPES, default="cowclip", help="scaling rule relative to --base-batch"
    )
    t.add_argument(
        "--mode",
        choices=("full", "sparse"),
        default="full",
        help="full: faithful full-table L2 + Adam; sparse: row-sparse updates (faster)",
    )
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--base-batch", type=int, default=1024)
    t.add_argument("--mlp", default="400,400,400", help="hidden widths, comma-separated")
    t.add_argument("--split", choices=("random", "chrono"), default="random")
    t.add_argument("--test-fraction", type=float, default=0.1)
    t.add_argument("--rows", type=int, default=200_000, help="synthetic: number of rows")
    t.add_argument("--scale", type=float, default=1e-2, help="synthetic: cardinalities x this")
    t.add_argument("--hash-buckets", type=int, default=0, help="files: hash ids per field (0: vocabularies)")
    t.add_argument("--min-count", type=int, default=10, help="files: vocabulary frequency threshold")
    t.add_argument("--skip-malformed", action="store_true", help="files: skip and count malformed lines")
    t.add_argument("--checkpoint", default=None, help="checkpoint file written after every epoch")
    t.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    t.add_argument("--device", default="cpu", help="cpu or cuda")
    t.add_argument("--json", default=None, help="write the result as JSON here")
    t.set_defaults(func=_train)
    s = sub.add_parser("synth", help="write synthetic Criteo-shaped rows as Criteo TSV (with the oracle)")
    s.add_argument("--rows", type=int, default=100_000)
    s.add_argument("--scale", type=float, default=1e-2)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True, help="TSV file to write")
    s.set_defaults(func=_synth)


def load_data(spec: str, args: argparse.Namespace):
    """(train, test, info) for --data synthetic | criteo:PATH | avazu:PATH."""
    from ecru.ctr.data import ReaderConfig, load_ctr_file, restrict_vocabulary_to_train
    from ecru.ctr.synthetic import SyntheticConfig, generate, oracle_summary, realised_oracle
    from ecru.errors import EcruError

    if spec == "synthetic":
        data = generate(SyntheticConfig(n_rows=args.rows, scale=args.scale, seed=args.seed))
        info = oracle_summary(data)
    else:
        fmt, _, path = spec.partition(":")
        if fmt not in ("criteo", "avazu") or not path:
            raise EcruError(f"--data must be synthetic, criteo:PATH or avazu:PATH, got {spec!r}")
        cfg = ReaderConfig(
            hash_buckets=args.hash_buckets, min_count=args.min_count, skip_malformed=args.skip_malformed
        )
        data, skipped = load_ctr_file(path, fmt, cfg=cfg)
        info = {"rows": len(data), "skipped_lines": skipped, "ids": sum(data.cardinalities)}
    split = (
        data.split_random(args.test_fraction, seed=args.seed)
        if args.split == "random"
        else data.split_chronological(args.test_fraction)
    )
    if spec == "synthetic":
        info["oracle_auc"], info["oracle_logloss"] = realised_oracle(split[1])
    elif not args.hash_buckets:  # the vocabulary must be the training split's alone
        split = restrict_vocabulary_to_train(*split, min_count=args.min_count)
    return split[0], split[1], info


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


def _train(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from ecru.ctr.training import TrainConfig, train
    from ecru.errors import EcruError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        mlp = tuple(int(w) for w in args.mlp.split(",") if w)
    except ValueError:
        raise EcruError(f"--mlp must be comma-separated ints, got {args.mlp!r}") from None
    rank, device = _init_distributed(args.device)
    train_data, test_data, info = load_data(args.data, args)
    dataset = "avazu" if args.data.startswith("avazu:") else "criteo"
    cfg = TrainConfig(
        model=args.model,
        batch_size=args.batch_size,
        epochs=args.epochs,
        recipe=args.recipe,
        mode=args.mode,
        base_batch=args.base_batch,
        dataset=dataset,
        mlp=mlp,
        seed=args.seed,
        checkpoint=args.checkpoint,
        resume=args.resume,
        device=device,
    )
    res = train(cfg, train_data, test_data)
    _close_distributed()
    if rank:
        return 0
    out = {
        "data": args.data,
        **info,
        **{k: v for k, v in res.as_dict().items() if k != "losses"},
        "threads": torch.get_num_threads(),
        "config": {k: getattr(cfg, k) for k in ("model", "batch_size", "recipe", "mode")},
    }
    print(
        f"{args.model} b={args.batch_size} recipe={args.recipe} mode={args.mode}: test AUC {res.auc:.5f} "
        f"logloss {res.logloss:.5f} ({res.steps} steps, {res.samples_per_s:,.0f} samples/s, "
        f"clipped {res.clip.clipped_fraction:.2%} of rows, ||g||/threshold max {res.clip.ratio_quantiles['max']:.3g})"
    )
    if "oracle_auc" in info:
        print(f"oracle (teacher FM) AUC {info['oracle_auc']:.5f} logloss {info['oracle_logloss']:.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


def _synth(args: argparse.Namespace) -> int:
    from ecru.ctr.synthetic import SyntheticConfig, generate, oracle_summary, write_criteo_tsv

    data = generate(SyntheticConfig(n_rows=args.rows, scale=args.scale, seed=args.seed))
    path = write_criteo_tsv(data, args.out)
    summary = oracle_summary(data)
    print(
        f"wrote {len(data)} rows to {path}; oracle AUC {summary['oracle_auc']:.5f} logloss {summary['oracle_logloss']:.5f}"
    )
    return 0
