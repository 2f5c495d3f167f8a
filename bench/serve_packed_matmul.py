"""Pre-packed weights against `F.linear`, per SmolLM2 weight shape and row count (the rule in
`ecru.serve.packed`: which weights to pack, for how many rows).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/serve_packed_matmul.py --json out.json

Random fp32 weights of SmolLM2's linear shapes (attention 576 x 576 and 192 x 576, MLP 1536 x 576 and
576 x 1536, LM head 49152 x 576), inputs of 4, 8 and 16 rows. Per shape and row count, `--pairs` pairs of
timings: `F.linear` then `PackedLinear` on the same input, back to back, so that a drift in the machine's
speed weighs on both alike; the figure is the median of the pairs' time ratios (plain / packed: > 1 means
packing is faster). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=40, help="timing pairs per shape and row count")
    ap.add_argument("--json", required=True, help="result JSON")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    from torch import nn

    from ecru.cliargs import atomic_write_json, prepare_out_file
    from ecru.serve.packed import PackedLinear, packing_available

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
    atomic_write_json(args.json, {
        "command": "python bench/serve_packed_matmul.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "measure": "median over pairs of F.linear time / PackedLinear time (> 1: packing is faster)",
        "shapes": {k: list(v) for k, v in SHAPES.items()}, "rows": list(ROWS), "pairs": args.pairs,
        "torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "plain_over_packed": ratios,
    })  # fmt: skip
    print(json.dumps(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
