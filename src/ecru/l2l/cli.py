"""`ecru l2l train`: fine-tune a causal LM on CLINC150 utterances with layer-to-layer training.

torch and transformers are imported inside the handler: `ecru --help` imports this module.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

MODELS = ("smollm2", "tiny-llama")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="l2l_command", metavar="COMMAND", required=True)
    train = sub.add_parser("train", help="fine-tune a causal LM with L2L", description=__doc__)
    train.add_argument(
        "--model",
        choices=MODELS,
        default="tiny-llama",
        help="smollm2 (SmolLM2-135M-Instruct) or tiny-llama (random, byte tokens)",
    )
    train.add_argument(
        "--data", choices=("clinc",), default="clinc", help="training text (CLINC150 utterances)"
    )
    train.add_argument("--steps", type=int, default=10, help="optimizer steps")
    train.add_argument("--batch-size", type=int, default=8, help="samples per minibatch (one optimizer step)")
    train.add_argument("--micro-batch-size", type=int, default=2, help="samples per micro-batch")
    train.add_argument("--max-length", type=int, default=64, help="tokens per sample (truncation)")
    train.add_argument(
        "--stash",
        choices=("device", "host", "disk"),
        default="device",
        help="where block inputs wait (disk: under --store-dir)",
    )
    train.add_argument(
        "--store-dir",
        default=None,
        help="disk tier: masters and optimizer states per block in this folder (resumed if present)",
    )
    train.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    train.add_argument("--dtype", choices=tuple(DTYPE_NAMES), default="fp32", help="compute precision")
    train.add_argument("--prefetch", type=int, default=1, help="blocks copied ahead (CUDA)")
    train.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    train.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    train.add_argument(
        "--keep-graph-blocks",
        type=int,
        default=0,
        metavar="K",
        help="the last K blocks keep their forward graph instead of recomputing it in the backward "
        "(faster, holds their activations for every micro-batch)",
    )
    train.add_argument("--max-grad-norm", type=float, default=None, help="global clipping (disables overlap)")
    train.add_argument("--seed", type=int, default=0, help="data order and model init seed")
    train.add_argument("--save", default=None, help="folder for a training checkpoint and an HF export")
    train.add_argument("--resume", default=None, help="continue from a checkpoint folder written by --save")
    train.add_argument("--json", default=None, help="write the run's numbers to this JSON file")
    train.set_defaults(func=run_train)


def load_model(name: str, *, seed: int = 0):
    """(model, tokenizer) for a CLI model name, in fp32 on the CPU."""
    from ecru.l2l.data import ByteTokenizer

    if name == "smollm2":
        from ecru.models import load_smollm2

        model, tokenizer = load_smollm2()
        return model, tokenizer
    from ecru.models import tiny_llama

    tok = ByteTokenizer()
    model = tiny_llama(
        vocab_size=tok.vocab_size, hidden_size=64, num_layers=4, intermediate_size=128, seed=seed
    )
    return model, tok


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _check_args(args: argparse.Namespace) -> None:
    from ecru.errors import EcruError

    for name in ("steps", "batch_size", "micro_batch_size", "max_length"):
        if getattr(args, name) < 1:
            raise EcruError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.store_dir and args.resume:
        raise EcruError("--resume reads a RAM-tier checkpoint; with --store-dir the store resumes by itself")


def run_train(args: argparse.Namespace) -> int:
    import functools

    import torch
    from tqdm import tqdm

    from ecru.l2l import L2L, L2LConfig
    from ecru.l2l.data import clinc_batches

    _check_args(args)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, seed=args.seed)
    model.train()
    config = L2LConfig(
        micro_batch_size=args.micro_batch_size,
        device=args.device,
        compute_dtype=DTYPE_NAMES[args.dtype],
        stash=args.stash,
        prefetch=args.prefetch,
        max_grad_norm=args.max_grad_norm,
        keep_graph_blocks=args.keep_graph_blocks,
        store="disk" if args.store_dir else "ram",
        store_dir=args.store_dir,
    )
    optimizer = functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay, fused=True)
    if args.resume:
        engine = L2L.resume(args.resume, model, optimizer=optimizer, config=config)
    else:
        engine = L2L.from_hf(model, optimizer=optimizer, config=config)
    batches = clinc_batches(tokenizer, batch_size=args.batch_size, max_length=args.max_length, seed=args.seed)
    losses, tokens, start = [], 0, time.perf_counter()
    with tqdm(range(args.steps), desc=f"l2l {args.model}", unit="step", file=sys.stderr) as bar:
        for _ in bar:
            batch = next(batches)
            losses.append(engine.step(batch))
            tokens += int(batch["attention_mask"].sum())
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    wall = time.perf_counter() - start
    result = _summary(args, engine, losses, tokens, wall)
    if args.save:
        if not args.store_dir:  # the disk tier's store_dir is its own training checkpoint
            engine.save(args.save)
        engine.save_pretrained(Path(args.save) / "hf")
        result["saved"] = str(args.save)
    engine.close()
    _report(result, args.json)
    return 0


def _summary(args: argparse.Namespace, engine, losses: list[float], tokens: int, wall: float) -> dict:
    import torch

    result = {
        "model": args.model,
        "steps": len(losses),
        "batch_size": args.batch_size,
        "micro_batch_size": args.micro_batch_size,
        "device": str(engine.device),
        "dtype": args.dtype,
        "stash": args.stash,
        "keep_graph_blocks": args.keep_graph_blocks,
        "losses": losses,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "peak_rss_mb": peak_rss_mb(),
        "parameters": sum(g.numel for g in engine.store.groups),
    }
    if engine.device.type == "cuda":
        result["peak_device_mb"] = torch.cuda.max_memory_allocated(engine.device) / 2**20
    return result


def _report(result: dict, json_path: str | None) -> None:
    print(
        f"model {result['model']} ({result['parameters'] / 1e6:.1f}M params) on {result['device']}, "
        f"{result['dtype']}, stash on {result['stash']}"
    )
    print(f"loss {result['first_loss']:.4f} -> {result['final_loss']:.4f} over {result['steps']} steps")
    print(f"tokens/s {result['tokens_per_s']:.1f}   peak host RSS {result['peak_rss_mb']:.0f} MiB", end="")
    print(f"   peak device memory {result['peak_device_mb']:.0f} MiB" if "peak_device_mb" in result else "")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")
