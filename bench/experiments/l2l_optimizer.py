"""Host optimizer throughput: AdamW fused vs foreach vs for-loop on the CPU, against the memory bound.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/experiments/l2l_optimizer.py --quick --json bench/results/l2l_optimizer_quick.json

One L2L block's update is one `optimizer.step()` over the block's fp32 masters. AdamW touches 28 bytes
per parameter (reads parameter, gradient, m, v: 16 B; writes parameter, m, v: 12 B), so its ceiling
is memory bandwidth / 28 parameters per second; the bandwidth (memory-bus bytes per second of
`dst.copy_(src)` and of a STREAM triad, counting the write-allocate read of each stored line, the
larger) is measured in the same run, alternating with the optimizer runs (medians of several
repetitions on a shared machine). Reported per implementation and thread count: parameters/s and the
fraction of the bound. The parameter server should use the fastest one (`fused=True` on CPU: the store
warns when an Adam/AdamW factory leaves it off).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from ecru.io import atomic_write_json

BYTES_PER_PARAM = 28  # AdamW: read p, g, m, v; write p, m, v (fp32)
IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def _params(numel: int, pieces: int) -> list[torch.nn.Parameter]:
    """A block-like parameter list: `pieces` tensors of `numel` parameters in total, with gradients."""
    sizes = [numel // pieces] * pieces
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def time_adamw(impl: str, params, *, steps: int) -> float:
    """Seconds per `step()` (median over `steps`, after a warm-up step that creates the state)."""
    opt = torch.optim.AdamW(params, lr=1e-4, **IMPLS[impl])
    opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(numel: int, *, reps: int) -> tuple[float, float]:
    """Memory-bus bytes per second of a large fp32 copy and of a STREAM triad c = a + s * b (medians of
    `reps`, write-allocate reads included); the larger is the bound."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    c.copy_(a)
    copy_t, triad_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        c.copy_(a)
        copy_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.add(a, b, alpha=0.5, out=c)
        triad_t.append(time.perf_counter() - t0)
    # bytes on the memory bus: a store to a fresh line first reads it (write-allocate), so a copy moves
    # 3 x 4 bytes per element and the triad 4 x 4; AdamW's in-place updates pay no such extra read
    return 3 * numel * 4 / statistics.median(copy_t), 4 * numel * 4 / statistics.median(triad_t)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32M parameters, 3 rounds (~1 min)")
    ap.add_argument("--numel", type=int, default=None, help="parameters per block update")
    ap.add_argument("--pieces", type=int, default=9, help="tensors in the block (a Llama block has 9)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    numel = args.numel or (32_000_000 if args.quick else 64_000_000)
    rounds = args.rounds or (3 if args.quick else 5)
    out = {
        "numel": numel,
        "pieces": args.pieces,
        "bytes_per_param": BYTES_PER_PARAM,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "results": {},
    }
    params = _params(numel, args.pieces)
    for threads in args.threads:
        torch.set_num_threads(threads)
        samples: dict[str, list[float]] = {"copy": [], "triad": [], **{k: [] for k in IMPLS}}
        for _ in range(rounds):  # alternate, so that background load hits every variant alike
            copy_bw, triad_bw = copy_bandwidth(numel, reps=3)
            samples["copy"].append(copy_bw)
            samples["triad"].append(triad_bw)
            for impl in IMPLS:
                samples[impl].append(time_adamw(impl, params, steps=2 if impl == "for-loop" else 3))
        bw = max(statistics.median(samples["copy"]), statistics.median(samples["triad"]))
        bound = bw / BYTES_PER_PARAM
        res = {
            "copy_gb_s": round(statistics.median(samples["copy"]) / 1e9, 2),
            "triad_gb_s": round(statistics.median(samples["triad"]) / 1e9, 2),
            "bound_params_per_s": round(bound),
        }
        for impl in IMPLS:
            rate = numel / statistics.median(samples[impl])
            res[impl] = {"params_per_s": round(rate), "fraction_of_bound": round(rate / bound, 3)}
        res["fastest"] = max(IMPLS, key=lambda k: res[k]["params_per_s"])
        out["results"][str(threads)] = res
        print(
            f"threads {threads}: copy {res['copy_gb_s']} / triad {res['triad_gb_s']} GB/s -> bound {bound / 1e6:.0f}M params/s; "
            + "; ".join(
                f"{k} {res[k]['params_per_s'] / 1e6:.0f}M/s ({res[k]['fraction_of_bound']:.0%})"
                for k in IMPLS
            ),
            flush=True,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, out)


if __name__ == "__main__":
    main()
