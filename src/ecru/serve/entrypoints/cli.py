"""`ecru serve ...`: api, run, probe, simulate, label, cost. Argument parsing only: the flags of api, run,
probe and simulate are built from their configs' fields (`EngineSetup`, `ReplaySetup`: the name, the default,
the docstring as help; `cliargs.add_config_flags`); each handler maps its arguments onto a config (checked on
construction) and calls the serve package (`setup`, ...). Heavy imports happen inside the handlers. The
static-batching benchmark is a script, `bench/serve.py`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ecru.cliargs import (
    add_config_flags,
    config_from_args,
    existing_file,
    non_negative_float,
    non_negative_int,
    not_an_input,
    number_in,
    positive_float,
    positive_int,
    prepare_out_dir,
    prepare_out_file,
)
from ecru.errors import EcruError
from ecru.serve.entrypoints.setup import EngineSetup, ReplaySetup
from ecru.serve.sched.names import ENGINE_POLICIES
from ecru.serve.sched.names import POLICIES as POLICY_NAMES

PENALTY = number_in(float, "a number", lambda v: -2 <= v <= 2, "between -2 and 2")  # OpenAI's range
PORT = number_in(int, "an integer", lambda v: 1 <= v <= 65535, "a TCP port, 1..65535")
SEED = number_in(int, "an integer", lambda v: 0 <= v < 2**63, "0 <= seed < 2^63")
SLACK = number_in(float, "a number", lambda v: v >= 0, ">= 0 (inf: off)")
API_KEY_ENV = "ECRU_API_KEY"


# ---- api, run and probe: the request engine ------------------------------------------------------------
def _api(args: argparse.Namespace) -> int:
    from ecru.serve.entrypoints.openai_api import APIConfig
    from ecru.serve.entrypoints.setup import serve_api

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key == "" and args.api_key is None:
        raise EcruError(f"{API_KEY_ENV} is set but empty: unset it to serve without a key, or give a key")
    setup = config_from_args(EngineSetup, args)
    serve_api(setup, config_from_args(APIConfig, args, api_key=key), host=args.host, port=args.port)
    return 0


def _run(args: argparse.Namespace) -> int:
    from ecru.serve.engine.sampling import SamplingParams
    from ecru.serve.entrypoints.setup import run_file

    setup = config_from_args(EngineSetup, args)
    base = config_from_args(SamplingParams, args, max_tokens=args.max_new_tokens, stop=tuple(args.stop or ()))
    from ecru.io import FolderLock

    out = prepare_out_file(not_an_input(args.out, args.input))
    with FolderLock(out.parent, what="--out", name=f".{out.name}.ecru.lock"):  # two runs would both append
        print(run_file(setup, base, src=args.input, out=out, skip_invalid=args.skip_invalid))
    return 0


def _probe(args: argparse.Namespace) -> int:
    from ecru.io import MANIFEST
    from ecru.serve.entrypoints.setup import fit_probe_folder, probe_prompts
    from ecru.serve.predict.predictors import LENGTH_FILE
    from ecru.serve.predict.remaining import PROBE_FILE

    for name in ("probe.json", MANIFEST, PROBE_FILE, LENGTH_FILE):  # the files the folder gets
        not_an_input(Path(args.out) / name, args.input)
    setup = config_from_args(EngineSetup, args)
    lines = probe_prompts(args.input)
    print(fit_probe_folder(setup, lines, src=args.input, out=prepare_out_dir(args.out)))
    return 0


# ---- simulate, label, cost: the scheduling measurements ----------------------------------------------
def _simulate(args: argparse.Namespace) -> int:
    from ecru.io import atomic_write_json

    setup = config_from_args(ReplaySetup, args)
    if args.json:
        prepare_out_file(not_an_input(args.json, args.trace, args.cost_model, flag="--json"), flag="--json")
    result = setup.run()
    if args.json:
        atomic_write_json(args.json, result)
    print(f"wrote {args.json}" if args.json else json.dumps(result, indent=2))
    return 0


def _label(args: argparse.Namespace) -> int:
    from ecru.serve.entrypoints.setup import label_file

    prepare_out_file(args.out)
    print(label_file(args.model, args.prompts, out=args.out, n=args.n, split=args.split, samples=args.samples,
                     max_new_tokens=args.max_new_tokens, batch_size=args.batch_size))  # fmt: skip
    return 0


def _cost(args: argparse.Namespace) -> int:
    from ecru.serve.entrypoints.setup import measure_cost

    prepare_out_file(args.out)
    print(measure_cost(args.model, reps=args.reps, out=args.out))
    return 0


# ---- flags from the configs' fields ------------------------------------------------------------------
_ENGINE = {"policy": {"choices": ENGINE_POLICIES}, "prefix_cache": {"type": non_negative_int},
           "fcfs_slack": {"type": SLACK}, "length_predictor": {"metavar": "DIR"},
           "remaining_probe": {"metavar": "DIR"}}  # fmt: skip
"""`EngineSetup`'s flags that need more than their field (the policy names, 0 or inf allowed, a folder)."""
MODELS = ("smollm2", "tiny")
"""The models `serve label` and `serve cost` take by name."""


# ---- the subcommands ---------------------------------------------------------------------------------
def _configure_api_run(sub) -> None:
    api = sub.add_parser("api", help="OpenAI-compatible HTTP server (chat, completions, streaming, /metrics)")
    add_config_flags(api, EngineSetup, **_ENGINE)
    api.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: every interface)")
    api.add_argument("--port", type=PORT, default=8000, help="TCP port (1..65535)")
    api.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every /v1 route (default: ${API_KEY_ENV} if set, "
        "else open); /health and /metrics stay open",
    )
    api.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=2**20,
        help="largest request body; a larger one is answered 413 (default 1 MiB)",
    )
    api.set_defaults(func=_api)

    run = sub.add_parser(
        "run", help="offline batch inference: a JSONL file of prompts -> answers (resumable)"
    )
    cap = {"help": "cap on generated tokens per line (a line's max_tokens wins)"}
    add_config_flags(run, EngineSetup, **_ENGINE, max_new_tokens=cap)
    run.add_argument(
        "--in",
        dest="input",
        required=True,
        type=existing_file,
        help='JSONL: {"prompt": str} or {"messages": [...]}, optional "id" and "max_tokens"',
    )
    run.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="answers JSONL {id, text, output_tokens, finish_reason}; rerunning skips the ids it holds",
    )
    run.add_argument(
        "--skip-invalid", action="store_true", help="skip and count bad lines instead of stopping"
    )
    _add_sampling_flags(run)
    run.set_defaults(func=_run)


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0 (the default): greedy; OpenAI's range is 0..2",
    )
    p.add_argument("--top-p", type=positive_float, default=1.0, help="nucleus sampling mass, (0, 1]")
    p.add_argument(
        "--top-k", type=non_negative_int, default=0, help="keep the k likeliest tokens (0, the default: off)"
    )
    p.add_argument(
        "--seed",
        type=SEED,
        default=0,
        help="sampling seed of every line, default 0 (the same answer on a rerun)",
    )
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeat for up to 4)")
    p.add_argument(
        "--presence-penalty", type=PENALTY, default=0.0, help="OpenAI's presence penalty, -2..2 (default 0)"
    )
    p.add_argument(
        "--frequency-penalty", type=PENALTY, default=0.0, help="OpenAI's frequency penalty, -2..2 (default 0)"
    )


def _configure_simulate(sub) -> None:
    sim = sub.add_parser("simulate", help="replay a length trace through a policy (exact slot accounting)")
    add_config_flags(sim, ReplaySetup, policy={"choices": POLICY_NAMES})
    sim.add_argument("--json", default=None, help="write the result here (default: print it)")
    sim.set_defaults(func=_simulate)


def _configure_label(sub) -> None:
    lab = sub.add_parser("label", help="record the model's own response lengths (max of k samples), cached")
    lab.add_argument("--model", choices=MODELS, default="smollm2", help="model to label with")
    lab.add_argument(
        "--prompts", default="mixed", help="clinc, banking, mixed, instructions (bundled) or a JSONL file"
    )
    lab.add_argument("--split", choices=("train", "test"), default="train", help="bundled dataset split")
    lab.add_argument("--n", type=positive_int, default=256, help="prompts to label")
    lab.add_argument(
        "--samples",
        type=int,
        choices=range(1, 5),
        default=4,
        help="samples per prompt (temperatures 0, 0.3, 0.5, 0.7); the label is the longest",
    )
    lab.add_argument("--max-new-tokens", type=positive_int, default=256, help="cap on each sample")
    lab.add_argument(
        "--batch-size", type=positive_int, default=16, help="rows decoded together on the request engine"
    )
    lab.add_argument("--out", required=True, metavar="FILE", help="labels JSONL (a cache: appended to)")
    lab.set_defaults(func=_label)


def _configure_cost(sub) -> None:
    cost = sub.add_parser(
        "cost", help="measure t_step(batch, context) on this machine, write a cost model JSON"
    )
    cost.add_argument("--model", choices=MODELS, default="smollm2", help="model to time")
    cost.add_argument("--reps", type=positive_int, default=3, help="timings per point (median)")
    cost.add_argument("--out", required=True, metavar="FILE", help="cost model JSON; its folder is created")
    cost.set_defaults(func=_cost)


def _configure_probe(sub) -> None:
    probe = sub.add_parser(
        "probe",
        help="fit cb-srpt's remaining-length probe and cb-sjf's prompt-length predictor for a model on your "
        "prompts (their greedy answers)",
    )
    probe.add_argument("--in", dest="input", required=True, type=existing_file,
                       help='JSONL as for `serve run`: {"prompt": str} or {"messages": [...]} a line')  # fmt: skip
    probe.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="folder for the probe and the predictor (remaining_probe.safetensors, length_predictor.safetensors, "
        "probe.json)",
    )
    cap = {"help": "cap on each greedy answer: the longest answer the predictor and the probe predict (serve "
           "with --max-new-tokens at most this)"}  # fmt: skip
    add_config_flags(probe, EngineSetup, only=("model", "max_batch_size", "max_new_tokens", "packed_weights"),
                max_new_tokens=cap)  # fmt: skip
    probe.set_defaults(func=_probe)


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="serve_command", metavar="SUBCOMMAND", required=True)
    _configure_api_run(sub)
    _configure_probe(sub)
    _configure_simulate(sub)
    _configure_label(sub)
    _configure_cost(sub)
