"""`ecru serve ...`: simulate, label, bench, cost. Heavy imports happen inside the handlers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ecru.serve.policies import STATIC_POLICIES
from ecru.serve.queues import CONTINUOUS_POLICIES

POLICY_NAMES = (*STATIC_POLICIES, *CONTINUOUS_POLICIES)


def _write_json(data: dict, path: str | None) -> None:
    text = json.dumps(data, indent=2)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    print(text if not path else f"wrote {path}")


def _simulate(args: argparse.Namespace) -> int:
    from ecru.errors import EcruError
    from ecru.serve.cost import SMOLLM2_CPU, CostModel
    from ecru.serve.policies import PlanConfig
    from ecru.serve.simulator import read_trace, simulate

    try:
        config = PlanConfig(
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            token_budget=args.token_budget,
            max_batch_size=args.max_batch_size,
        )
    except ValueError as exc:
        raise EcruError(str(exc)) from exc
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
    from ecru.serve.labels import label_prompts
    from ecru.serve.models import load_model
    from ecru.serve.prompts import load_prompts

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
    print(
        f"{len(labels)} labels in {args.out}; median {lengths[len(lengths) // 2]}, at cap {sum(x >= args.max_new_tokens for x in lengths)}"
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ecru.serve.bench import BenchConfig, format_bench, run_bench

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
        labels=args.labels,
        train_n=args.train_n,
        aging=args.aging,
        lora_epochs=args.lora_epochs,
        repeats=args.repeats,
    )
    result = run_bench(config)
    print(format_bench(result))
    _write_json(result, args.json)
    return 0


def _cost(args: argparse.Namespace) -> int:
    import torch

    from ecru.serve.cost import measure_cost_model
    from ecru.serve.models import load_model

    model, _ = load_model(args.model)
    cost = measure_cost_model(
        model, reps=args.reps, source=f"{args.model}, {torch.get_num_threads()} thread(s), measured"
    )
    cost.save(args.out)
    print(f"wrote {args.out}: {cost}")
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="serve_command", metavar="SUBCOMMAND", required=True)

    sim = sub.add_parser("simulate", help="replay a length trace through a policy (exact slot accounting)")
    sim.add_argument(
        "--trace", required=True, help='JSONL lines {"prompt_len", "output_len", "predicted_len"}'
    )
    sim.add_argument("--policy", choices=POLICY_NAMES, default="fcfs")
    sim.add_argument("--batch-size", type=int, default=16)
    sim.add_argument("--max-new-tokens", type=int, default=512)
    sim.add_argument(
        "--token-budget", type=int, default=None, help="fcr+vbs: rows x (prompt + cap) per batch"
    )
    sim.add_argument("--max-batch-size", type=int, default=None, help="fcr+vbs: hard row limit per batch")
    sim.add_argument(
        "--cost-model",
        default=None,
        help="cost model JSON from `ecru serve cost` (default: SmolLM2 on 1 CPU thread)",
    )
    sim.add_argument("--refill-min", type=int, default=4, help="cb*: admit when this many rows are free")
    sim.add_argument(
        "--aging", type=float, default=0.5, help="cb-sjf, cb-ljf: priority tokens per decode step waited"
    )
    sim.add_argument("--predict-s", type=float, default=0.0, help="seconds of length prediction to add")
    sim.add_argument("--json", default=None, help="write the result here (default: print it)")
    sim.set_defaults(func=_simulate)

    lab = sub.add_parser("label", help="record the model's own response lengths (max of k samples), cached")
    lab.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    lab.add_argument("--prompts", default="mixed", help="clinc, banking, mixed or a JSONL file")
    lab.add_argument("--split", choices=("train", "test"), default="train")
    lab.add_argument("--n", type=int, default=256)
    lab.add_argument(
        "--samples", type=int, default=4, help="samples per prompt (temperatures 0, 0.3, 0.5, 0.7)"
    )
    lab.add_argument("--max-new-tokens", type=int, default=256)
    lab.add_argument("--batch-size", type=int, default=16)
    lab.add_argument("--out", required=True)
    lab.set_defaults(func=_label)

    bench = sub.add_parser("bench", help="run the policies for real on held-out prompts")
    bench.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    bench.add_argument(
        "--prompts", default="mixed", help="clinc, banking, mixed (test split) or a JSONL file"
    )
    bench.add_argument("--n", type=int, default=256)
    bench.add_argument("--max-new-tokens", type=int, default=256)
    bench.add_argument("--batch-size", type=int, default=16)
    bench.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated, any of {', '.join(POLICY_NAMES)} (default: all but cb-ljf)",
    )
    bench.add_argument(
        "--predictor", choices=("self-lora", "probe", "minilm", "oracle", "constant"), default="self-lora"
    )
    bench.add_argument(
        "--labels", default=None, help="train labels JSONL (default: cached, built on first use)"
    )
    bench.add_argument("--train-n", type=int, default=192)
    bench.add_argument("--aging", type=float, default=0.5)
    bench.add_argument("--lora-epochs", type=int, default=2, help="self-lora tuning epochs")
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every policy R times, repetition k starting at policy k; report medians and paired ratios",
    )
    bench.add_argument("--json", default=None)
    bench.set_defaults(func=_bench)

    cost = sub.add_parser(
        "cost", help="measure t_step(batch, context) on this machine, write a cost model JSON"
    )
    cost.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    cost.add_argument("--reps", type=int, default=3)
    cost.add_argument("--out", required=True)
    cost.set_defaults(func=_cost)


def main(argv=None) -> int:  # pragma: no cover - convenience for `python -m ecru.serve.cli`
    parser = argparse.ArgumentParser(prog="ecru serve")
    configure(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
