"""`ecru l2l train`: fine-tune a causal LM on text with layer-to-layer training.

The model is a bundled name (smollm2, tiny) or any local Hugging Face model folder; the text is
CLINC150 or the user's .txt (one text per line) / .jsonl (a "text" field per line). Everything the run
writes goes to --out DIR: `checkpoint/` (the full training state, every --save-every steps and at the end;
on the disk tier the store under DIR/ecru-l2l is the checkpoint itself, committed every step), `state.json`
(arguments and losses, written after each checkpoint), `hf/` (the trained model and tokenizer in
save_pretrained format; with --lora-r, `adapter/`, a peft adapter folder, instead, and `hf/` only with
--merge) and `metrics.json`. `--resume` continues from DIR exactly: weights, optimizer states, RNG and the
data position (the batch of step k is a pure function of k and --seed); killed at any point, the same
command with `--resume` finishes the run. A folder holding a run is refused without `--resume` or
`--overwrite`; `--resume` with an argument that changes results refuses, naming it.
"""

# torch and transformers are imported inside the handler: `ecru --help` imports this module.

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ecru.cliargs import (
    add_out_dir,
    non_negative_float,
    non_negative_int,
    number_in,
    positive_float,
    positive_int,
)
from ecru.io import FolderLock

MODELS = ("smollm2", "tiny")  # "tiny" as in `ecru serve`; "tiny-llama" is still accepted
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
STATE, CHECKPOINT = "state.json", "checkpoint"
SEED = number_in(int, "an integer", lambda v: 0 <= v < 2**63, "0 <= seed < 2^63")
RUN_FILES = (STATE, CHECKPOINT, "hf", "adapter", "metrics.json", "ecru-l2l")  # what --overwrite deletes
# arguments a resumed run must keep: each changes the results (--steps may grow, the rest is speed)
RESULT_ARGS = ("model", "data", "batch_size", "max_length", "seed", "store", "lr", "weight_decay")
RESULT_ARGS += ("max_grad_norm", "dtype", "lr_schedule", "warmup_steps")
RESULT_ARGS += ("lora_r", "lora_alpha", "lora_targets")

# --lr-schedule name -> transformers' get_scheduler name (each warms up linearly over --warmup-steps)
SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give module names separated by commas, e.g. q_proj,v_proj")
    return names


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="l2l_command", metavar="COMMAND", required=True)
    train = sub.add_parser("train", help="fine-tune a causal LM with L2L", description=__doc__)
    train.add_argument(
        "--model",
        default="tiny",
        help="smollm2 (SmolLM2-135M-Instruct), tiny (a random Llama, byte tokens) or a local Hugging Face "
        "model folder (a decoder-only causal LM with its tokenizer)",
    )
    train.add_argument(
        "--data",
        default="clinc",
        help="clinc (CLINC150 utterances) or a .txt (one text per line) / .jsonl ('text' field) file",
    )
    add_out_dir(train, default="runs/l2l", overwrite=True)
    train.add_argument(
        "--eval-data",
        default=None,
        metavar="FILE",
        help="held-out .txt / .jsonl texts: their mean loss per token every --eval-every steps and at the end",
    )
    train.add_argument(
        "--eval-every", type=positive_int, default=None, metavar="N", help="with --eval-data: every N steps"
    )
    train.add_argument("--steps", type=positive_int, default=10, help="total optimizer steps of the run")
    train.add_argument("--save-every", type=positive_int, default=None, help="checkpoint every N steps")
    train.add_argument("--batch-size", type=positive_int, default=8, help="samples per step")
    train.add_argument("--micro-batch-size", type=positive_int, default=2, help="samples per micro-batch")
    train.add_argument("--max-length", type=positive_int, default=64, help="tokens per sample (truncation)")
    train.add_argument(
        "--stash", choices=("device", "host", "disk"), default="device", help="where block inputs wait"
    )
    train.add_argument(
        "--store",
        choices=("ram", "disk"),
        default="ram",
        help="where masters and optimizer states live (disk: under --out, committed every step)",
    )
    train.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    train.add_argument("--dtype", choices=tuple(DTYPE_NAMES), default="fp32", help="compute precision")
    train.add_argument("--prefetch", type=non_negative_int, default=1, help="blocks copied ahead (CUDA)")
    train.add_argument("--lr", type=positive_float, default=1e-4, help="AdamW learning rate")
    train.add_argument(
        "--lr-schedule",
        choices=tuple(SCHEDULES),
        default="constant",
        help="learning rate after the warm-up (transformers' get_scheduler, decaying to 0 at --steps)",
    )
    train.add_argument(
        "--warmup-steps", type=non_negative_int, default=0, help="steps of linear warm-up from 0 to --lr"
    )
    train.add_argument(
        "--lora-r",
        type=positive_int,
        default=None,
        metavar="R",
        help="train a LoRA adapter of rank R (peft) instead of every weight; written to DIR/adapter",
    )
    train.add_argument(
        "--lora-alpha",
        type=positive_float,
        default=None,
        metavar="A",
        help="LoRA scale numerator (default 2R)",
    )
    train.add_argument(
        "--lora-targets",
        type=_names,
        default=None,
        metavar="NAMES",
        help="comma-separated module names LoRA adapts, e.g. q_proj,v_proj (default: peft's per model type)",
    )
    train.add_argument(
        "--merge", action="store_true", help="with --lora-r: also write the merged model to DIR/hf"
    )
    train.add_argument("--weight-decay", type=non_negative_float, default=0.0, help="AdamW weight decay")
    train.add_argument(
        "--keep-graph-blocks",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="the last K blocks keep their forward graph instead of recomputing it in the backward "
        "(faster, holds their activations for every micro-batch)",
    )
    train.add_argument(
        "--max-grad-norm", type=positive_float, default=None, help="global clipping (disables overlap)"
    )
    train.add_argument(
        "--seed", type=SEED, default=0, help="data order and model init seed, 0 <= seed < 2^63"
    )
    train.set_defaults(func=run_train)


def in_place(args: argparse.Namespace) -> Path | None:
    """The model folder whose frozen base a run reads in place (a LoRA run on the disk tier from a folder
    of safetensors: ecru.l2l.frozen), else None (the model is loaded whole)."""
    folder = Path(args.model).expanduser()
    if args.lora_r is None or args.store != "disk" or args.model in MODELS:
        return None
    return folder if any(folder.glob("*.safetensors")) else None


def load_model(name: str, *, seed: int = 0, empty: bool = False):
    """(model, tokenizer) for a CLI model name or a local model folder, in fp32 on the CPU; with `empty`
    (a folder only) the parameters stay on the meta device, read later in place."""
    from ecru.l2l.data import byte_tokenizer

    if name == "smollm2":
        from ecru.models import load_smollm2

        return load_smollm2()
    if name in ("tiny", "tiny-llama"):
        from ecru.models import tiny_llama

        tok = byte_tokenizer()
        model = tiny_llama(
            vocab_size=len(tok), hidden_size=64, num_layers=4, intermediate_size=128, seed=seed
        )
        return model, tok
    return _load_folder(Path(name).expanduser(), empty=empty)


def _load_folder(path: Path, *, empty: bool = False):
    from ecru.errors import EcruError
    from ecru.models.folder import load_causal_lm

    if not (path / "config.json").is_file():
        raise EcruError(
            f"--model {path}: not one of {MODELS} and not a Hugging Face model folder (no config.json)"
        )
    prefix = "--model: "
    if not empty:
        return load_causal_lm(path, prefix=prefix)
    try:  # the skeleton alone (no weights: the blocks stream from the store)
        from transformers import AutoTokenizer

        from ecru.l2l.frozen import empty_model

        return empty_model(path), AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - whatever a broken folder makes transformers raise, one line
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise EcruError(f"{prefix}cannot load the model folder {path}: {reason}") from None


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _check_args(args: argparse.Namespace) -> None:
    from ecru.errors import EcruError

    if args.micro_batch_size > args.batch_size:
        raise EcruError(
            f"--micro-batch-size {args.micro_batch_size} is larger than --batch-size {args.batch_size}; "
            "a micro-batch is a slice of the batch"
        )
    if args.lora_r is None and (args.lora_alpha is not None or args.lora_targets or args.merge):
        raise EcruError("--lora-alpha, --lora-targets and --merge need --lora-r R (the adapter's rank)")
    if args.warmup_steps > args.steps:
        raise EcruError(f"--warmup-steps {args.warmup_steps} is more than --steps {args.steps}")
    if args.data != "clinc" and not Path(args.data).expanduser().is_file():
        raise EcruError(f"--data {args.data}: not 'clinc' and not an existing file")
    if args.eval_every is not None and args.eval_data is None:
        raise EcruError("--eval-every needs --eval-data FILE (the held-out texts)")
    if args.eval_data is not None and not Path(args.eval_data).expanduser().is_file():
        raise EcruError(f"--eval-data {args.eval_data}: not an existing .txt or .jsonl file")


def _prepare_out(args: argparse.Namespace) -> tuple[Path, dict | None]:
    """The --out folder (checked writable, after every other check) and the state of the run it holds."""
    import shutil

    from ecru.cliargs import prepare_out_dir
    from ecru.errors import EcruError

    out = Path(args.out).expanduser()
    _check_out_paths(args, out)
    held = any((out / name).exists() for name in (STATE, CHECKPOINT, "ecru-l2l"))
    if held and not (args.resume or args.overwrite):
        raise EcruError(
            f"--out {out} already holds a run; pass --resume to continue it, --overwrite to start again, "
            "or choose another --out"
        )
    state = None
    if held and args.resume and (out / STATE).is_file():
        state = _read_state(out / STATE)
        _check_same(args, state["args"], out)
    out = prepare_out_dir(out)
    if held and args.overwrite:
        for name in RUN_FILES:
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    if args.resume and not held:
        print(f"note: {out} holds no run yet; starting one", file=sys.stderr)
    return out, state


def _check_out_paths(args: argparse.Namespace, out: Path) -> None:
    """What this run writes in --out must not hold its inputs (--overwrite and the export rewrite them) nor be a
    link (it would write and delete outside --out); --out must not be inside the model folder."""
    from ecru.cliargs import not_an_input
    from ecru.errors import EcruError

    inputs = {"--model": args.model, "--data": args.data, "--eval-data": args.eval_data}
    model = Path(args.model).expanduser()
    if model.is_dir():
        not_an_input(out, model)
    for name in RUN_FILES:
        target = (out / name).absolute()
        if target.is_symlink():
            raise EcruError(f"--out {out}: {name} is a symbolic link; a run writes only inside its own --out")
        for flag, given in inputs.items():
            source = (
                Path(given).expanduser().resolve() if given and Path(given).expanduser().exists() else None
            )
            if source is not None and (source == target.resolve() or target.resolve() in source.parents):
                raise EcruError(f"{flag} {given} lies in {target}, which this run rewrites; copy it out of --out "
                                "or choose another --out")  # fmt: skip


def _read_state(path: Path) -> dict:
    """state.json, checked: a damaged or hand-edited one is one line, not a traceback."""
    from ecru.errors import EcruError
    from ecru.io import read_json_object

    state = read_json_object(path)
    if not isinstance(state.get("args"), dict):
        raise EcruError(f"{path}: not a run's state (no args); pass --overwrite to start again")
    _check_history(state.get("losses", []), state.get("eval", []), path)
    return state


def data_digest(data: str) -> str:
    """What a run's --data holds: the sha256 of the file's bytes (the bundled "clinc" as itself)."""
    from ecru.io import sha256_file

    return data if data == "clinc" else sha256_file(Path(data).expanduser())


def _check_same(args: argparse.Namespace, saved: dict, out: Path) -> None:
    """A resumed run's arguments that change results, as the run had them; --data by its content where the run
    recorded it (the same file under another path resumes, a changed file is refused)."""
    from ecru.errors import EcruError

    if "data_sha256" in saved and saved["data_sha256"] != args.data_sha256:
        raise EcruError(f"--resume: --data {args.data} is not the data the run in {out} trained on (its content "
                        "changed, or another file); resume with that data, or pass --overwrite to start again")  # fmt: skip
    for key in RESULT_ARGS:
        if key == "data" and "data_sha256" in saved:
            continue
        if key in saved and saved[key] != getattr(args, key):
            flag = f"--{key.replace('_', '-')}"
            raise EcruError(
                f"--resume: the run in {out} used {flag} {saved[key]}, not {getattr(args, key)}; resume "
                f"with the same {flag}, or pass --overwrite to start again"
            )


def _texts(data: str) -> list[str]:
    if data == "clinc":
        from ecru.datasets import load_clinc

        return [e.text for e in load_clinc()["train"]]
    from ecru.l2l.data import read_texts

    return read_texts(Path(data).expanduser())


def _engine(args: argparse.Namespace, out: Path, model, resume: bool):
    import functools

    import torch

    from ecru.cliargs import config_from
    from ecru.l2l import L2L, L2LConfig

    config = config_from(
        L2LConfig,
        micro_batch_size=args.micro_batch_size,
        device=args.device,
        compute_dtype=DTYPE_NAMES[args.dtype],
        stash=args.stash,
        prefetch=args.prefetch,
        max_grad_norm=args.max_grad_norm,
        keep_graph_blocks=args.keep_graph_blocks,
        store=args.store,
        store_dir=str(out) if "disk" in (args.store, args.stash) else None,
        frozen_weights=str(in_place(args)) if in_place(args) else None,
    )
    optimizer = functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay, fused=True)
    if resume and args.store == "ram" and (out / CHECKPOINT / "manifest.json").is_file():
        engine = L2L.resume(out / CHECKPOINT, model, optimizer=optimizer, config=config)
    else:
        engine = L2L.from_hf(model, optimizer=optimizer, config=config)
    engine.lr_scheduler(lr_schedule(args))
    return engine


def lr_schedule(args: argparse.Namespace):
    """optimizer -> its scheduler for --lr-schedule / --warmup-steps over --steps."""
    import functools

    from transformers import get_scheduler

    return functools.partial(
        get_scheduler,
        SCHEDULES[args.lr_schedule],
        num_warmup_steps=args.warmup_steps,
        num_training_steps=args.steps,
    )


def with_lora(args: argparse.Namespace, model):
    """`model` wrapped in a peft LoRA adapter of rank --lora-r (only the adapter trains), or as it is."""
    if args.lora_r is None:
        return model
    import peft

    from ecru.errors import EcruError
    from ecru.l2l.frozen import init_adapters_

    alpha = args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r
    config = peft.LoraConfig(r=args.lora_r, lora_alpha=alpha, target_modules=args.lora_targets)
    try:
        model = peft.get_peft_model(model, config)
    except ValueError as exc:  # e.g. --lora-targets naming no module of the model
        raise EcruError(f"--lora-targets: {str(exc).splitlines()[0][:200]}") from None
    init_adapters_(model, seed=args.seed)  # the same adapter whether the base is loaded or read in place
    return model


def _export(args: argparse.Namespace, engine, out: Path, tokenizer) -> None:
    """DIR/hf (the trained model), or with --lora-r DIR/adapter (a peft folder, no copy of the base) and
    with --merge also DIR/hf (the base with the adapter merged in). Each folder is written whole or not at
    all (`atomic_folder`: a kill mid-export left a folder that looked complete; `--resume` writes it again)."""
    from ecru.io import atomic_folder

    if args.lora_r is None:
        with atomic_folder(out / "hf", replace=True) as tmp:
            engine.save_pretrained(tmp, tokenizer=tokenizer)
        return
    with atomic_folder(out / "adapter", replace=True) as tmp:
        engine.save_pretrained(tmp, tokenizer=tokenizer)
    if args.merge:
        merged = engine.model_on("cpu", dtype=engine.model_dtype).merge_and_unload()
        with atomic_folder(out / "hf", replace=True) as tmp:
            merged.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)


def run_train(args: argparse.Namespace) -> int:

    from ecru.errors import EcruError

    _check_args(args)
    texts = _texts(args.data)
    if args.eval_data is not None:  # read now: a bad file is refused before any step, not after the last
        from ecru.l2l.data import read_texts

        read_texts(Path(args.eval_data).expanduser(), flag="--eval-data")
    if len(texts) < args.batch_size:
        raise EcruError(f"--data has {len(texts)} texts, fewer than one batch of {args.batch_size}")
    args.data_sha256 = data_digest(args.data)
    out, state = _prepare_out(args)
    with FolderLock(out, what="--out"):  # a second run into --out is refused, not interleaved with this one
        return _run(args, out, state, texts)


def _run(args: argparse.Namespace, out: Path, state: dict | None, texts: list[str]) -> int:
    import torch

    from ecru.io import clean_leftovers

    clean_leftovers(out)  # what a kill mid-export (or mid-write of state.json) left
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, seed=args.seed, empty=in_place(args) is not None)
    model = with_lora(args, model)
    model.train()
    engine = _engine(args, out, model, resume=state is not None)
    state = _committed(args, out, state)
    losses = (state or {}).get("losses", [])[: engine.steps]
    evals = [e for e in (state or {}).get("eval", []) if e["step"] <= engine.steps]
    # the disk tier commits a step (with its loss) before state.json records it: a kill between them leaves
    # state.json one step behind; a store from before the loss was committed leaves it NaN
    if len(losses) == engine.steps - 1 and engine.committed_loss is not None:
        losses.append(engine.committed_loss)
    losses += [float("nan")] * (engine.steps - len(losses))
    try:
        if _eval_due(args, engine.steps) and not any(e["step"] == engine.steps for e in evals):
            evals.append(_evaluate(args, engine, tokenizer))  # the same weights: the evaluation the kill lost
        losses, tokens, wall = _train(args, engine, tokenizer, texts, out, losses, evals)
        if args.eval_data and (not evals or evals[-1]["step"] != engine.steps):
            evals.append(_evaluate(args, engine, tokenizer))
        _checkpoint(args, engine, out, losses, evals)
        _export(args, engine, out, tokenizer)
        result = _summary(args, engine, losses, tokens, wall, evals)
    finally:
        engine.close()
    _report(result, out)
    return 0


def _committed(args, out: Path, state: dict | None) -> dict | None:
    """`state` with the losses and evaluations the RAM tier's checkpoint committed with its weights (a kill
    after the checkpoint and before state.json leaves state.json a step behind); the disk tier's as is."""
    from ecru.l2l.checkpoint import read_meta

    meta = read_meta(out / CHECKPOINT) if args.store == "ram" and state is not None else None
    if not meta or "losses" not in meta:
        return state
    _check_history(meta.get("losses"), meta.get("eval"), out / CHECKPOINT / "manifest.json")
    return {**state, "losses": meta["losses"], "eval": meta["eval"]}


def _check_history(losses, evals, where: Path) -> None:
    """A run's losses (numbers) and evaluations ({"step": int, ...}) as read back, or one line."""
    from ecru.errors import EcruError

    ok = isinstance(losses, list) and all(isinstance(x, int | float) for x in losses)
    ok = (
        ok
        and isinstance(evals, list)
        and all(isinstance(e, dict) and isinstance(e.get("step"), int) for e in evals)
    )
    if not ok:
        raise EcruError(
            f"{where}: its losses or evaluations are not a run's; pass --overwrite to start again"
        )


def _evaluate(args, engine, tokenizer) -> dict:
    """{"step", "loss"}: the held-out loss of --eval-data now, in batches of --batch-size (the last may be
    smaller), through the engine's own block executor."""
    from ecru.l2l.data import encode_batch, read_texts
    from ecru.l2l.evaluate import heldout_loss

    texts = read_texts(Path(args.eval_data).expanduser(), flag="--eval-data")
    batches = (
        encode_batch(tokenizer, texts[i : i + args.batch_size], max_length=args.max_length)
        for i in range(0, len(texts), args.batch_size)
    )
    return {"step": engine.steps, "loss": heldout_loss(engine, batches)}


def _eval_due(args: argparse.Namespace, steps: int) -> bool:
    """Whether --eval-every evaluates after step `steps`."""
    return bool(args.eval_every) and 0 < steps <= args.steps and steps % args.eval_every == 0


def _train(args, engine, tokenizer, texts, out: Path, losses: list[float], evals: list[dict]):
    from tqdm import tqdm

    from ecru.l2l.data import batch_texts, encode_batch

    tokens, start, first = 0, time.perf_counter(), engine.steps
    with tqdm(total=args.steps, initial=first, desc="l2l train", unit="step", file=sys.stderr) as bar:
        for step in range(first, args.steps):
            batch = encode_batch(
                tokenizer,
                batch_texts(texts, step, batch_size=args.batch_size, seed=args.seed),
                max_length=args.max_length,
            )
            losses.append(engine.step(batch))
            tokens += int(batch["attention_mask"].sum())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if _eval_due(args, engine.steps):
                evals.append(_evaluate(args, engine, tokenizer))
                bar.write(f"step {engine.steps}: held-out loss {evals[-1]['loss']:.4f}")
            saving = args.save_every and engine.steps % args.save_every == 0
            if engine.steps < args.steps and (saving or args.store == "disk"):
                _checkpoint(
                    args, engine, out, losses, evals
                )  # the disk tier: state.json follows every commit
    return losses, tokens, time.perf_counter() - start


def _checkpoint(args, engine, out: Path, losses: list[float], evals: list[dict]) -> None:
    """The engine's checkpoint (the commit point of the weights), then state.json: a kill between them
    leaves state.json behind the checkpoint, and resume trusts the checkpoint's step."""
    from ecru.io import atomic_write_json

    if args.store == "ram":  # the disk tier committed this step in its store already
        engine.save(out / CHECKPOINT, meta={"losses": losses, "eval": evals})
    keys = ("micro_batch_size", "steps", "data_sha256", *RESULT_ARGS)
    atomic_write_json(
        out / STATE,
        {"args": {k: getattr(args, k) for k in keys}, "steps": engine.steps, "losses": losses, "eval": evals},
    )


def _summary(
    args: argparse.Namespace, engine, losses: list[float], tokens: int, wall: float, evals: list[dict]
) -> dict:
    import torch

    result = {
        "model": args.model,
        "data": args.data,
        "steps": len(losses),
        "batch_size": args.batch_size,
        "micro_batch_size": args.micro_batch_size,
        "device": str(engine.device),
        "dtype": args.dtype,
        "stash": args.stash,
        "store": args.store,
        "keep_graph_blocks": args.keep_graph_blocks,
        "losses": losses,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "tokens_this_run": tokens,
        "wall_s_this_run": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "eval": evals,
        "final_eval_loss": evals[-1]["loss"] if evals else None,
        "peak_rss_mb": peak_rss_mb(),
        "parameters": sum(g.numel for g in engine.store.groups),
    }
    if engine.device.type == "cuda":
        result["peak_device_mb"] = torch.cuda.max_memory_allocated(engine.device) / 2**20
    return result


def _report(result: dict, out: Path) -> None:
    from ecru.io import atomic_write_json

    print(
        f"model {result['model']} ({result['parameters'] / 1e6:.1f}M params) on {result['device']}, "
        f"{result['dtype']}, stash on {result['stash']}, store in {result['store']}"
    )
    print(f"loss {result['first_loss']:.4f} -> {result['final_loss']:.4f} over {result['steps']} steps")
    if result["final_eval_loss"] is not None:
        print(f"held-out loss {result['final_eval_loss']:.4f} at step {result['eval'][-1]['step']}")
    if result["tokens_per_s"] is not None:
        print(
            f"tokens/s {result['tokens_per_s']:.1f}   peak host RSS {result['peak_rss_mb']:.0f} MiB", end=""
        )
        print(
            f"   peak device memory {result['peak_device_mb']:.0f} MiB" if "peak_device_mb" in result else ""
        )
    atomic_write_json(out / "metrics.json", result)
    written = ", ".join(str(out / n) for n in ("hf", "adapter") if (out / n).is_dir())
    print(f"wrote {out}/metrics.json, {written}")
