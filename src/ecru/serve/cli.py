"""`ecru serve ...`: api, run, probe, simulate, label, bench, cost. Heavy imports happen inside the handlers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ecru.cliargs import (
    existing_file,
    non_negative_float,
    non_negative_int,
    number_in,
    positive_float,
    positive_int,
)
from ecru.errors import EcruError
from ecru.serve.names import ENGINE_POLICIES, SJF_POLICIES
from ecru.serve.names import POLICIES as POLICY_NAMES
from ecru.serve.queues import DEFAULT_AGING

PENALTY = number_in(float, "a number", lambda v: -2 <= v <= 2, "between -2 and 2")  # OpenAI's range
PORT = number_in(int, "an integer", lambda v: 1 <= v <= 65535, "a TCP port, 1..65535")
SLACK = number_in(float, "a number", lambda v: v >= 0, ">= 0 (inf: off)")
API_KEY_ENV = "ECRU_API_KEY"

MODEL_HELP = "smollm2 (bundled), tiny (random, for tests) or the path of a local Hugging Face model folder"


def _write_json(data: dict, path: str | None) -> None:
    from ecru.io import atomic_write_json

    if path:
        atomic_write_json(path, data)
    print(json.dumps(data, indent=2) if not path else f"wrote {path}")


def _out_file(path: str | None, flag: str = "--json") -> None:
    """Check an output file's folder before any work (created if missing)."""
    from ecru.cliargs import prepare_out_file

    if path:
        prepare_out_file(path, flag=flag)


# ---- api and run: the request engine -------------------------------------------------------------------
def _engine_config(args: argparse.Namespace, *, max_new_tokens: int):
    from ecru.cliargs import config_from
    from ecru.serve.scheduler import EngineConfig

    if args.fcfs_slack is not None and args.policy not in SJF_POLICIES:
        raise EcruError(
            "--fcfs-slack applies to --policy cb-sjf or cb-srpt only: drop it or add --policy cb-sjf"
        )
    args.length_predictor = _length_folder(args)
    if args.length_predictor is not None:
        _check_length_file(args, max_new_tokens)
    if (args.policy == "cb-srpt") != (args.remaining_probe is not None):
        raise EcruError("--policy cb-srpt needs --remaining-probe DIR (fit one with `ecru serve probe`), and only "
                        "it takes one")  # fmt: skip
    return config_from(
        EngineConfig,
        policy=args.policy,
        max_batch_size=args.max_batch_size,
        max_new_tokens=max_new_tokens,
        prefix_cache=args.prefix_cache,
        fcfs_slack=args.fcfs_slack,
    )


def _length_folder(args: argparse.Namespace) -> str | None:
    """`--length-predictor`; for cb-srpt without it, the `--remaining-probe` folder when it holds one (`ecru serve
    probe` writes both there): plain cb-srpt is the shipped configuration, predictor included."""
    if args.length_predictor is not None or args.policy != "cb-srpt" or args.remaining_probe is None:
        return args.length_predictor
    from ecru.serve.predictors import LENGTH_FILE

    return args.remaining_probe if (Path(args.remaining_probe) / LENGTH_FILE).is_file() else None


def _check_bindable(host: str, port: int) -> None:
    """A busy port or a foreign address is refused before the model loads."""
    import socket

    from ecru.errors import EcruError

    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise EcruError(
            f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port or --host"
        ) from None


def _load_probe(args: argparse.Namespace):
    """`--remaining-probe DIR` loaded (None without the flag); a bad folder is refused in one line."""
    from ecru.serve.remaining import RemainingProbe

    if args.remaining_probe is None:
        return None
    try:
        return RemainingProbe.load(args.remaining_probe)
    except ValueError as exc:
        raise EcruError(f"--remaining-probe {exc}") from None


def _check_length_file(args: argparse.Namespace, max_new_tokens: int) -> None:
    """`--length-predictor DIR` before the model loads: a policy that uses it, a folder holding one fitted for
    this model with a cap at least `max_new_tokens`."""
    from ecru.serve.predictors import read_length_file
    from ecru.serve.remaining import model_key

    if args.policy not in SJF_POLICIES:
        raise EcruError(
            "--length-predictor orders cb-sjf's and cb-srpt's queue: drop it or add --policy cb-sjf"
        )
    where = f"--length-predictor {args.length_predictor}"
    try:
        meta, _, _ = read_length_file(args.length_predictor)
    except ValueError as exc:
        raise EcruError(f"--length-predictor {exc}") from None
    if meta["model"] != model_key(args.model):
        raise EcruError(f"{where}: fitted for model {meta['model']!r}, not {model_key(args.model)!r}; fit one for it "
                        f"with `ecru serve probe --model {args.model}`")  # fmt: skip
    if max_new_tokens > meta["cap"]:
        raise EcruError(f"{where}: it predicts answers up to {meta['cap']} tokens, below --max-new-tokens "
                        f"{max_new_tokens}; lower it or fit with `ecru serve probe --max-new-tokens "
                        f"{max_new_tokens}`")  # fmt: skip


def _load_length(args: argparse.Namespace, served):
    """`--length-predictor DIR` (checked by `_check_length_file`) on the loaded model: its `engine_predict`
    (None without the flag)."""
    from ecru.serve.predictors import EmbeddingPredictor

    if args.length_predictor is None:
        return None
    try:
        return EmbeddingPredictor.load(args.length_predictor, served.model, served.tokenizer).engine_predict
    except ValueError as exc:
        raise EcruError(f"--length-predictor {exc}") from None


def _check_probe(args: argparse.Namespace, probe, served, config) -> None:
    """A loaded probe against the loaded model and the engine's `config`."""
    from ecru.serve.remaining import model_key

    if probe is None:
        return
    where = f"--remaining-probe {args.remaining_probe}"
    if probe.model != model_key(served.name):
        raise EcruError(f"{where}: fitted for model {probe.model!r}, not {model_key(served.name)!r}; fit one for "
                        f"it with `ecru serve probe --model {served.name}`")  # fmt: skip
    width = served.model.config.get_text_config().hidden_size
    if probe.hidden_size != width:
        raise EcruError(f"{where}: it reads hidden states of width {probe.hidden_size}, the model's are {width}; fit "
                        f"one for this model with `ecru serve probe --model {served.name}`")  # fmt: skip
    if config.max_new_tokens > probe.cap:
        raise EcruError(f"{where}: it predicts remainders of answers up to {probe.cap} tokens, below --max-new-tokens "
                        f"{config.max_new_tokens}; lower it or fit with `ecru serve probe --max-new-tokens "
                        f"{config.max_new_tokens}`")  # fmt: skip
    try:
        served.engine(config, remaining=probe)  # the engine's own checks (e.g. a sliding-window model)
    except ValueError as exc:
        raise EcruError(f"{where}: {exc}") from None


def _api_config(args: argparse.Namespace):
    import os

    from ecru.serve.api_guard import APIConfig

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        return APIConfig(api_key=key, max_body_bytes=args.max_body_bytes)
    except ValueError as exc:
        raise EcruError(f"--api-key: {exc}") from None


def _api(args: argparse.Namespace) -> int:
    from ecru.serve.models import ServedModel
    from ecru.serve.server import serve_forever

    api = _api_config(args)
    config = _engine_config(args, max_new_tokens=args.max_new_tokens)
    remaining = _load_probe(args)  # before the model loads
    _check_bindable(args.host, args.port)
    served = ServedModel.load(args.model, packed=args.packed_weights)
    _check_probe(args, remaining, served, config)
    predict = _load_length(args, served)
    print(
        f"serving {served.describe()} on http://{args.host}:{args.port}/v1 (policy {config.policy})",
        file=sys.stderr,
    )
    serve_forever(
        served, config, host=args.host, port=args.port, remaining=remaining, predict=predict, api=api
    )
    return 0


def _sampling(args: argparse.Namespace):
    from ecru.cliargs import config_from
    from ecru.serve.sampling import SamplingParams

    return config_from(
        SamplingParams,
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )


def _run(args: argparse.Namespace) -> int:
    from ecru.cliargs import prepare_out_file
    from ecru.serve import batch_run
    from ecru.serve.models import ServedModel

    out = prepare_out_file(args.out)
    base = _sampling(args)
    lines, skipped = batch_run.read_batch(args.input, skip_invalid=args.skip_invalid)
    done = {r["id"] for r in batch_run.read_answers(out)}
    todo_lines = [line for line in lines if line.id not in done]
    _engine_config(args, max_new_tokens=args.max_new_tokens)  # checked before the model loads
    remaining = _load_probe(args)
    served, todo = None, []
    if todo_lines:
        served = ServedModel.load(args.model, packed=args.packed_weights)
        print(f"loaded {served.describe()}", file=sys.stderr)
        todo = batch_run.encode_lines(
            served, todo_lines, base, path=args.input, skip_invalid=args.skip_invalid, skipped=skipped
        )
    cap = max([args.max_new_tokens, *(e.params.max_tokens for e in todo)])
    config = _engine_config(args, max_new_tokens=cap)
    predict = None
    if todo:
        _check_probe(args, remaining, served, config)
        predict = _load_length(args, served)
    for message in skipped:
        print(f"skipped {message}", file=sys.stderr)
    tokens = (
        batch_run.run_batch(served, todo, out=out, config=config, remaining=remaining, predict=predict)
        if todo
        else 0
    )
    batch_run.reorder(out, lines)
    print(
        f"{len(todo)} answered ({tokens} tokens), {len(done & {line.id for line in lines})} already in "
        f"{out}, {len(skipped)} invalid line(s) skipped"
    )
    return 0


def _add_engine_flags(p: argparse.ArgumentParser, *, max_new_tokens_help: str) -> None:
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument(
        "--policy",
        choices=ENGINE_POLICIES,
        default="cb",
        help="admission: cb first come first served, cb-sjf shortest predicted answer first (aged; by "
        "--length-predictor, or by max_tokens without it), cb-srpt cb-sjf plus shortest predicted remaining "
        "first, re-predicted every 16 tokens by --remaining-probe, cb-kv KV memory reserved per request (more rows)",
    )
    p.add_argument(
        "--length-predictor",
        default=None,
        metavar="DIR",
        help="cb-sjf, cb-srpt: predict each answer's length from the prompt with the predictor `ecru serve probe "
        "--out DIR` fitted for this model (a lookup of its own embeddings and a dot product per request); "
        "cb-srpt's default: the --remaining-probe folder's",
    )
    p.add_argument(
        "--remaining-probe",
        default=None,
        metavar="DIR",
        help="cb-srpt: the remaining-length probe `ecru serve probe --out DIR` fitted for this model",
    )
    p.add_argument("--max-batch-size", type=positive_int, default=16, help="rows decoded together at most")
    p.add_argument(
        "--fcfs-slack",
        type=SLACK,
        default=None,
        help="cb-sjf, cb-srpt without aging: a request that has waited (1 + S) x the wait first come first "
        "served would now impose is admitted first (the wait estimated from the predicted lengths; "
        "docs/serve.md); cb-srpt's default 0.15, inf: off (aged instead)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help=max_new_tokens_help)
    p.add_argument(
        "--prefix-cache",
        type=non_negative_int,
        default=16,
        help="recent prompts whose KV is kept so that prompts starting alike (a system prompt) skip "
        "recomputing the start; 0: off",
    )
    p.add_argument(
        "--packed-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="multiply by a copy of the linear layers' weights pre-packed for the CPU: faster decode "
        "steps, those weights twice in memory (--no-packed-weights: once)",
    )


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
        type=non_negative_int,
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


def _configure_api_run(sub) -> None:
    api = sub.add_parser("api", help="OpenAI-compatible HTTP server (chat, completions, streaming, /metrics)")
    _add_engine_flags(
        api, max_new_tokens_help="max_tokens of a request that gives none, and the largest one may ask"
    )
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
    _add_engine_flags(run, max_new_tokens_help="cap on generated tokens per line (a line's max_tokens wins)")
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


# ---- simulate, label, bench, cost: the scheduling measurements ----------------------------------------
def _simulate(args: argparse.Namespace) -> int:
    from ecru.cliargs import config_from
    from ecru.serve.bench import check_keep_kv
    from ecru.serve.cost import SMOLLM2_CPU, CostModel
    from ecru.serve.policies import PlanConfig
    from ecru.serve.simulator import read_trace, simulate

    _out_file(args.json)
    check_keep_kv(keep_kv=args.keep_kv, resume_failures=args.resume_failures)
    config = config_from(
        PlanConfig,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        token_budget=args.token_budget,
        max_batch_size=args.max_batch_size,
        resume=args.resume_failures,
        keep_kv=args.keep_kv,
    )
    cost = CostModel.load(args.cost_model) if args.cost_model else SMOLLM2_CPU
    trace = read_trace(args.trace)
    if args.policy.startswith("cb"):
        result = _simulate_continuous(args, trace, cost)
    else:
        result = simulate(trace, policy=args.policy, config=config, cost=cost, predict_s=args.predict_s)
    out = {
        **result.to_json(),
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "resume_failures": args.resume_failures,
        "keep_kv": args.keep_kv,
        "cost_model": cost.source,
    }
    _write_json(out, args.json)
    return 0


def _simulate_continuous(args: argparse.Namespace, trace, cost):
    from ecru.errors import EcruError
    from ecru.serve.policies import PlanConfig
    from ecru.serve.queues import make_queue
    from ecru.serve.runner import continuous_config, reservations
    from ecru.serve.simulator import simulate_continuous

    predicted = [r.predicted_len for r in trace]
    if args.policy != "cb" and any(p is None for p in predicted):
        raise EcruError(f"policy {args.policy!r} needs predicted_len on every trace line")
    try:
        plan = PlanConfig(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
        config = continuous_config(
            args.policy, plan, [r.prompt_len for r in trace], refill_min=args.refill_min
        )
        queue = make_queue(args.policy, predicted, aging=args.aging)
    except ValueError as exc:
        raise EcruError(str(exc)) from exc
    result, _ = simulate_continuous(
        trace,
        queue=queue,
        config=config,
        cost=cost,
        predict_s=args.predict_s,
        policy=args.policy,
        reserve=reservations(args.policy, predicted),
    )
    return result


def _label(args: argparse.Namespace) -> int:
    from ecru.serve.labels import label_prompts, read_labels
    from ecru.serve.models import load_model
    from ecru.serve.prompts import load_prompts

    _out_file(args.out, "--out")
    read_labels(args.out)  # a malformed cache stops here, before any work
    prompts = load_prompts(args.prompts, n=args.n, split=args.split)
    model, tokenizer = load_model(args.model)
    labels = label_prompts(
        model,
        tokenizer,
        prompts,
        out=args.out,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    lengths = sorted(r.label for r in labels)
    at_cap = sum(x >= args.max_new_tokens for x in lengths)
    print(f"{len(labels)} labels in {args.out}; median {lengths[len(lengths) // 2]}, at cap {at_cap}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ecru.cliargs import note_long_run
    from ecru.serve.bench import BenchConfig, format_bench, run_bench
    from ecru.serve.labels import read_labels

    chosen = (
        {}
        if args.policies is None
        else {"policies": tuple(p.strip() for p in args.policies.split(",") if p.strip())}
    )
    config = BenchConfig(
        model=args.model,
        prompts=args.prompts,
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        **chosen,
        predictor=args.predictor,
        labels=str(args.labels) if args.labels else None,
        train_n=args.train_n,
        aging=args.aging,
        lora_epochs=args.lora_epochs,
        lora_readout=args.lora_readout,
        repeats=args.repeats,
        resume_failures=args.resume_failures,
        keep_kv=args.keep_kv,
    )
    _out_file(args.json)
    if args.labels:
        read_labels(args.labels)  # malformed: one line now, not a traceback after the run
    if config.model == "smollm2" and config.n * config.max_new_tokens * config.repeats >= 8192:
        # ~14 ms per row-token at batch 16 on one CPU thread (docs/serve.md), every row to the cap at worst
        hours = config.n * config.max_new_tokens * 0.014 * len(config.policies) * config.repeats / 3600
        note_long_run(f"{len(config.policies)} policies x {config.repeats} repeat(s) x {config.n} prompts x cap "
                      f"{config.max_new_tokens} on SmolLM2: up to ~{hours:.1f} h on a CPU, plus the predictor's "
                      "training (less with --n, --max-new-tokens or --policies)")  # fmt: skip
    result = {"command": args.command_line, **run_bench(config)}
    print(format_bench(result))
    _write_json(result, args.json)
    return 0


def _cost(args: argparse.Namespace) -> int:
    import torch

    from ecru.serve.cost import measure_cost_model
    from ecru.serve.models import load_model

    _out_file(args.out, "--out")
    model, _ = load_model(args.model)
    cost = measure_cost_model(
        model, reps=args.reps, source=f"{args.model}, {torch.get_num_threads()} thread(s), measured"
    )
    cost.save(args.out)
    print(f"wrote {args.out}: {cost}")
    return 0


def _configure_simulate(sub) -> None:
    sim = sub.add_parser("simulate", help="replay a length trace through a policy (exact slot accounting)")
    sim.add_argument(
        "--trace",
        required=True,
        type=existing_file,
        help='JSONL lines {"prompt_len", "output_len", "predicted_len"}',
    )
    sim.add_argument("--policy", choices=POLICY_NAMES, default="fcfs", help="scheduling policy")
    sim.add_argument("--batch-size", type=positive_int, default=16, help="rows per batch")
    sim.add_argument("--max-new-tokens", type=positive_int, default=512, help="global cap on answer tokens")
    sim.add_argument(
        "--token-budget", type=positive_int, default=None, help="fcr+vbs: rows x (prompt + cap) per batch"
    )
    sim.add_argument(
        "--max-batch-size", type=positive_int, default=None, help="fcr+vbs: hard row limit per batch"
    )
    _add_resume_flag(sim)
    sim.add_argument(
        "--cost-model",
        default=None,
        type=existing_file,
        help="cost model JSON from `ecru serve cost` (default: SmolLM2 on 1 CPU thread)",
    )
    sim.add_argument(
        "--refill-min", type=positive_int, default=4, help="cb*: admit when this many rows are free"
    )
    sim.add_argument(
        "--aging",
        type=non_negative_float,
        default=DEFAULT_AGING,
        help="cb-sjf, cb-ljf: priority tokens per step waited",
    )
    sim.add_argument(
        "--predict-s", type=non_negative_float, default=0.0, help="seconds of length prediction to add"
    )
    sim.add_argument("--json", default=None, help="write the result here (default: print it)")
    sim.set_defaults(func=_simulate)


def _configure_label(sub) -> None:
    lab = sub.add_parser("label", help="record the model's own response lengths (max of k samples), cached")
    lab.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="model to label with")
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


def _add_resume_flag(parser) -> None:
    parser.add_argument(
        "--resume-failures",
        action="store_true",
        help="fcr*: a row cut at its predicted cap keeps its tokens and is resumed (prompt + them prefilled), "
        "not recomputed from scratch",
    )
    parser.add_argument(
        "--keep-kv",
        action="store_true",
        help="with --resume-failures: a cut row keeps its KV cache in memory and its rerun continues it "
        "without a prefill",
    )


def _configure_bench(sub) -> None:
    bench = sub.add_parser("bench", help="run the scheduling policies for real on held-out prompts")
    bench.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="model to serve")
    bench.add_argument(
        "--prompts",
        default="mixed",
        help="test split of clinc, banking, mixed (CLINC and Banking77 queries interleaved) or instructions "
        "(the instruction workload, lengths that follow the request; docs/serve.md), or a JSONL file",
    )
    bench.add_argument("--n", type=positive_int, default=256, help="prompts served")
    bench.add_argument("--max-new-tokens", type=positive_int, default=256, help="global cap on answer tokens")
    bench.add_argument("--batch-size", type=positive_int, default=16, help="rows per batch")
    bench.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated, any of {', '.join(POLICY_NAMES)} (default: all but cb-ljf)",
    )
    bench.add_argument(
        "--predictor",
        choices=("self-lora", "probe", "embed", "minilm", "oracle", "constant"),
        default="self-lora",
        help="length predictor of the predicted policies",
    )
    bench.add_argument(
        "--labels",
        default=None,
        type=existing_file,
        help="train labels JSONL (default: cached, built on first use)",
    )
    bench.add_argument("--train-n", type=positive_int, default=192, help="labelled train prompts used")
    bench.add_argument(
        "--aging", type=non_negative_float, default=DEFAULT_AGING, help="cb-sjf priority tokens per step"
    )
    bench.add_argument("--lora-epochs", type=positive_int, default=2, help="self-lora tuning epochs")
    bench.add_argument(
        "--lora-readout",
        choices=("greedy", "expected"),
        default="greedy",
        help="self-lora's prediction: the number it generates (the paper's) or its expected bucket",
    )
    _add_resume_flag(bench)
    bench.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="run every policy R times, repetition k starting at policy k; report medians and paired ratios",
    )
    bench.add_argument("--json", default=None, help="write the result here (default: print it)")
    bench.set_defaults(func=_bench)


def _configure_cost(sub) -> None:
    cost = sub.add_parser(
        "cost", help="measure t_step(batch, context) on this machine, write a cost model JSON"
    )
    cost.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="model to time")
    cost.add_argument("--reps", type=positive_int, default=3, help="timings per point (median)")
    cost.add_argument("--out", required=True, metavar="FILE", help="cost model JSON; its folder is created")
    cost.set_defaults(func=_cost)


# ---- probe: cb-srpt's remaining-length probe for a user's prompts ----------------------------------------
MIN_PROBE_PROMPTS = 10


def _probe(args: argparse.Namespace) -> int:
    from ecru.cliargs import config_from, prepare_out_dir
    from ecru.serve import batch_run
    from ecru.serve.models import ServedModel
    from ecru.serve.scheduler import EngineConfig

    config = config_from(EngineConfig, max_batch_size=args.max_batch_size, max_new_tokens=args.max_new_tokens)
    lines, _ = batch_run.read_batch(args.input, skip_invalid=False, hint="")
    if len(lines) < MIN_PROBE_PROMPTS:
        raise EcruError(f"{args.input}: {len(lines)} prompt(s); a probe needs at least {MIN_PROBE_PROMPTS} "
                        "(hundreds are better)")  # fmt: skip
    out = prepare_out_dir(args.out)
    served = ServedModel.load(args.model, packed=args.packed_weights)
    print(f"loaded {served.describe()}; answering {len(lines)} prompts greedily", file=sys.stderr)
    prompts, answers = _greedy_answers(args, served, lines, config)
    report, length_report = _fit_and_save(args, served, prompts, answers, out)
    print(f"fitted on {report['answers']} greedy answers ({report['answer_tokens']} tokens); held out "
          f"{report['held_out_answers']}: remaining-length Spearman {_rho(report)} over {report['held_out_points']} "
          f"re-predictions, prompt-length Spearman {_rho(length_report)}; wrote {out}")  # fmt: skip
    return 0


def _greedy_answers(args: argparse.Namespace, served, lines, config) -> tuple[list, list]:
    """The lines' prompt ids (as `serve run` encodes them) and their greedy answers, capped at
    --max-new-tokens (each line's own max_tokens ignored)."""
    from dataclasses import replace

    from ecru.serve import batch_run
    from ecru.serve.remaining import greedy_answers
    from ecru.serve.sampling import SamplingParams

    base, lines = SamplingParams(max_tokens=args.max_new_tokens), [replace(x, max_tokens=None) for x in lines]
    todo = batch_run.encode_lines(
        served, lines, base, path=args.input, skip_invalid=False, skipped=[], hint=""
    )
    prompts = [e.prompt_ids for e in todo]
    return prompts, greedy_answers(served, prompts, cap=args.max_new_tokens, config=config, progress=True)


def _fit_and_save(args: argparse.Namespace, served, prompts, answers, out) -> tuple[dict, dict]:
    """Fit the remaining-length probe and the prompt-length predictor, write them and their held-out
    reports (probe.json) to `out`; the two reports."""
    from ecru.io import atomic_write_json, write_manifest
    from ecru.serve.predictors import fit_length_predictor
    from ecru.serve.remaining import fit_probe, model_key

    try:
        probe, report = fit_probe(served, prompts, answers, cap=args.max_new_tokens)
    except ValueError as exc:
        raise EcruError(f"{args.input}: {exc}") from None
    length, length_report = fit_length_predictor(
        served, prompts, [len(a) for a in answers], cap=args.max_new_tokens
    )
    meta = {"model": model_key(served.name), "cap": args.max_new_tokens, "held_out": report,
            "length_predictor_held_out": length_report}  # fmt: skip
    atomic_write_json(out / "probe.json", meta)  # the report first: the weight files are what serving reads
    files = [probe.save(out).name, length.save(out).name, "probe.json"]
    write_manifest(out, files)  # checked when either is loaded: a damaged file is refused in one line
    return report, length_report


def _rho(report: dict) -> str:
    return "n/a" if report["spearman"] is None else f"{report['spearman']:.2f}"


def _configure_probe(sub) -> None:
    probe = sub.add_parser(
        "probe",
        help="fit cb-srpt's remaining-length probe and cb-sjf's prompt-length predictor for a model on your "
        "prompts (their greedy answers)",
    )
    probe.add_argument("--model", default="smollm2", help=MODEL_HELP)
    probe.add_argument("--in", dest="input", required=True, type=existing_file,
                       help='JSONL as for `serve run`: {"prompt": str} or {"messages": [...]} a line')  # fmt: skip
    probe.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="folder for the probe and the predictor (remaining_probe.safetensors, length_predictor.safetensors, "
        "probe.json)",
    )
    probe.add_argument("--max-new-tokens", type=positive_int, default=256,
                       help="cap on each greedy answer: the longest answer the predictor and the probe "
                       "predict (serve with --max-new-tokens at most this)")  # fmt: skip
    probe.add_argument("--max-batch-size", type=positive_int, default=16, help="rows decoded together")
    probe.add_argument("--packed-weights", action=argparse.BooleanOptionalAction, default=True,
                       help="pre-packed weights while answering (as in `serve api`)")  # fmt: skip
    probe.set_defaults(func=_probe)


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="serve_command", metavar="SUBCOMMAND", required=True)
    _configure_api_run(sub)
    _configure_probe(sub)
    _configure_simulate(sub)
    _configure_label(sub)
    _configure_bench(sub)
    _configure_cost(sub)


def main(argv=None) -> int:  # pragma: no cover - convenience for `python -m ecru.serve.cli`
    from ecru.cli import main as ecru_main

    return ecru_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
