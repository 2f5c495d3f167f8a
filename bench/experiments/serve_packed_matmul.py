"""Pre-packed weights against `F.linear`, per SmolLM2 weight shape and row count, and in the engine on
SmolLM2 (the rule in `ecru.serve.engine.packed`: which weights to pack, for how many rows).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/experiments/serve_packed_matmul.py [--in-model] --json out.json

Per shape: random fp32 weights of SmolLM2's linear shapes (attention 576 x 576 and 192 x 576, MLP 1536 x 576 and
576 x 1536, LM head 49152 x 576), inputs of 4, 8 and 16 rows. Per shape and row count, `--pairs` pairs of
timings: `F.linear` then `PackedLinear` on the same input, back to back, so that a drift in the machine's
speed weighs on both alike; the figure is the median of the pairs' time ratios (plain / packed: > 1 means
packing is faster). Each weight stays in the CPU's cache between calls, which a decode step through the
whole model (540 MB of weights) never has.

`--in-model` also times what decides the rule: the request engine on SmolLM2 serving 16 prompts of the
mixed workload (40 answer tokens each, greedy) on plain layers, with only the weights of >= 2^19 elements
packed (the earlier rule: LM head and MLP), of >= 2^18 (also the attention's 576 x 576, not its 192 x 576)
and with the shipped rule (`MIN_SIZE`: every layer), in `--rounds` rounds whose order rotates;
the figure per rule is the median over rounds of plain time / its time. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"attention_q_o": (576, 576), "attention_k_v": (192, 576), "mlp_up_gate": (1536, 576),
          "mlp_down": (576, 1536), "lm_head": (49152, 576)}  # fmt: skip
ROWS = (4, 8, 16)


def timed(f) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def paired_ratio(plain, packed, x, pairs: int) -> float:
    """Median over `pairs` back-to-back pairs of plain time / packed time (after 3 warm-up calls each)."""
    for _ in range(3):
        plain(x), packed(x)
    return statistics.median(timed(lambda: plain(x)) / timed(lambda: packed(x)) for _ in range(pairs))


def in_model(rounds: int) -> dict:
    """The engine on SmolLM2 with each packing rule, rounds in rotating order: plain / rule time medians."""
    from ecru.serve import EngineConfig, SamplingParams
    from ecru.serve.engine.models import ServedModel
    from ecru.serve.engine.packed import MIN_SIZE, pack_linears_, unpack_linears_
    from ecru.serve.prompts import load_prompts

    served = ServedModel.load("smollm2", packed=False)
    prompts = [
        served.encode_chat([{"role": "user", "content": t}])
        for t in load_prompts("mixed", n=16, split="test")
    ]
    rules = {"plain": None, "min_2^19": 1 << 19, "min_2^18": 1 << 18, "shipped": MIN_SIZE}
    times: dict[str, list[float]] = {r: [] for r in rules}
    layers, reference = {}, None
    for k in range(rounds):
        for rule in [*rules][k % len(rules) :] + [*rules][: k % len(rules)]:
            unpack_linears_(served.model)
            layers[rule] = 0 if rules[rule] is None else pack_linears_(served.model, min_size=rules[rule])
            engine = served.engine(EngineConfig(max_batch_size=16, max_new_tokens=40))
            start = time.perf_counter()
            outputs = [r.output for r in engine.generate(prompts, SamplingParams(max_tokens=40))]
            times[rule].append(time.perf_counter() - start)
            reference = reference or outputs
            if outputs != reference:
                sys.exit(f"greedy outputs differ with packing rule {rule}")
        print(f"round {k}: " + ", ".join(f"{r} {t[-1]:.2f} s" for r, t in times.items()), flush=True)
    ratios = {
        r: statistics.median(p / t for p, t in zip(times["plain"], times[r], strict=True)) for r in rules
    }
    return {"prompts": len(prompts), "max_tokens": 40, "rounds": rounds, "min_size": rules,
            "packed_layers": layers, "times_s": times, "plain_over_rule": ratios,
            "shipped_against": pairwise(times, "shipped"), "identical_greedy_outputs": True}  # fmt: skip


def pairwise(times: dict[str, list[float]], rule: str) -> dict[str, dict[str, float]]:
    """`rule` against every other rule round by round: the median of their time / its time, and the rounds
    in which it was faster."""
    return {other: {"median_ratio": statistics.median(o / t for o, t in zip(times[other], times[rule], strict=True)),
                    "faster_rounds": sum(o > t for o, t in zip(times[other], times[rule], strict=True))}
            for other in times if other != rule}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=40, help="timing pairs per shape and row count")
    ap.add_argument(
        "--in-model", action="store_true", help="also time the engine on SmolLM2 per rule (~6 min)"
    )
    ap.add_argument("--rounds", type=int, default=12, help="--in-model: rounds of the four rules")
    ap.add_argument("--json", required=True, help="result JSON")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    from torch import nn

    from ecru.cliargs import prepare_out_file
    from ecru.io import atomic_write_json
    from ecru.serve.engine.packed import PackedLinear, packing_available

    prepare_out_file(args.json, flag="--json")
    if not packing_available():
        sys.exit("this torch build has no oneDNN packed linear ops")
    torch.manual_seed(0)
    ratios: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name, (out_f, in_f) in SHAPES.items():
            plain = nn.Linear(in_f, out_f, bias=False)
            packed = PackedLinear(plain)
            ratios[name] = {
                str(r): paired_ratio(plain, packed, torch.randn(r, in_f), args.pairs) for r in ROWS
            }
            print(name, {r: f"{v:.2f}x" for r, v in ratios[name].items()}, flush=True)
    model = in_model(args.rounds) if args.in_model else None
    if model:
        print("in the engine, plain / rule:", {r: f"{v:.2f}x" for r, v in model["plain_over_rule"].items()})
    atomic_write_json(args.json, {
        "command": "python bench/experiments/serve_packed_matmul.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "measure": "median over pairs of F.linear time / PackedLinear time (> 1: packing is faster)",
        "shapes": {k: list(v) for k, v in SHAPES.items()}, "rows": list(ROWS), "pairs": args.pairs,
        "torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "plain_over_packed": ratios, "in_model": model,
    })  # fmt: skip
    print(json.dumps(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
