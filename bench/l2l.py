"""Plain PyTorch training vs L2L at the same batch: step time (same process, alternating, median) and peak
host RSS (a fresh subprocess per configuration and mode; peak device memory too on CUDA).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/l2l.py --quick --json bench/results/l2l_quick.json

Models: a random Llama of SmolLM2-135M's shape (30 blocks, width 576, 49K vocabulary, tied embedding)
and a deep narrow random Llama (width 256, 32 or 48 blocks, SmolLM2's vocabulary). Each L2L step runs
the blocks ~3.75x (forward, a recompute that skips each Llama layer's down projection, whose output
value the backward never reads (ecru.l2l.recompute), 2x backward) against 3x in plain training, the
head 3x in both, so a FLOP count predicts ~1.16 for deep-narrow, less the optimizer time L2L hides
behind the backward. Measured per phase (bench/experiments/l2l_profile.py --quick, thread CPU ms/step): the
recompute costs deep-narrow 363 (419 before the lean recompute), smollm2-shape 917 (1159), 18-21% of a
plain step, and the elementwise / attention work in it is recomputed in full; deep-narrow's 256-token
matmuls cost no more per token than plain's 512-token ones (torch.profiler by shape); the rest of L2L's
bookkeeping (store calls, optimizer hand-off waits) is under 1%. `bench/experiments/l2l_profile.py --quick --sweep`
times the backward's block work alone with both recomputes alternating: the lean one saves 48 ms/step
(4.0%, deep-narrow, 15 reps) and 298 ms/step (8.1%, smollm2-shape, 7 reps), paired medians.
The cases share one process: after smollm2-shape the heap keeps enough freed memory that deep-narrow
runs without page faults in both modes (measured: plain 1.94 -> 1.57 CPU s/step, L2L 2.47 -> 2.09), so
its ratio is the compute ratio (~1.33, measured with the ordinary recompute). The warm heap is not
guaranteed: a bench/experiments/l2l_profile.py run of both cases did fault in deep-narrow. Alone in a fresh process
both pay ~0.25 s/step of system time for faults (the head's 50 MB logits), which dilutes the ratio to
~1.22-1.28.
A third mode, `l2l_keep`, is L2L with `keep_graph_blocks` = ceil(blocks / 3): the last third of the
blocks keep their forward graph per micro-batch instead of being recomputed (memory for speed), timed
in the same alternating rounds (`ratio_keep`) with its own peak RSS (`keep_rss_below_plain`).
Both sides use fused AdamW (the fastest CPU optimizer) in fp32; the compute runs on one thread, and L2L
adds its optimizer worker thread (on 2 cores it overlaps the backward).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ecru.cliargs import ArgumentParser, positive_int, prepare_out_file, run_main
from ecru.io import atomic_write_text


@dataclass(frozen=True)
class Case:
    """One benchmark configuration."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batch: int
    seq: int
    micro: int


# Micro-batches of ~200+ tokens: smaller ones lose matmul efficiency on a CPU core. deep-narrow has
# SmolLM2's 49K vocabulary: its head is not recomputed by L2L, which is why a FLOP count predicts ~1.22.
CASES = {
    "smollm2-shape": Case("smollm2-shape", 576, 30, 9, 3, 1536, 49152, batch=8, seq=128, micro=2),
    "deep-narrow": Case("deep-narrow", 256, 48, 4, 2, 688, 49152, batch=16, seq=128, micro=4),
}
QUICK = {
    "smollm2-shape": Case("smollm2-shape", 576, 30, 9, 3, 1536, 49152, batch=4, seq=96, micro=2),
    "deep-narrow": Case("deep-narrow", 256, 32, 4, 2, 688, 49152, batch=8, seq=64, micro=4),
}

REPS = {True: {"smollm2-shape": 3, "deep-narrow": 7}, False: {"smollm2-shape": 5, "deep-narrow": 7}}


def build(case: Case) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=case.vocab,
        hidden_size=case.hidden,
        num_hidden_layers=case.layers,
        num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads,
        intermediate_size=case.intermediate,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def make_batch(case: Case, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, case.vocab, (case.batch, case.seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4, fused=True)


class Plain:
    """Ordinary training: model (on the device), fused AdamW, full-batch forward/backward."""

    def __init__(self, model: torch.nn.Module, device: str):
        self.model, self.device = model.to(device), device
        self.opt = (
            ADAMW(self.model.parameters())
            if device == "cpu"
            else torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        )

    def step(self, batch: dict) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(**{k: v.to(self.device) for k, v in batch.items()}).loss
        loss.backward()
        self.opt.step()
        return loss.item()


MODES = ("plain", "l2l", "l2l_keep")


def keep_blocks(case: Case) -> int:
    """Blocks whose graph `l2l_keep` keeps: the last third."""
    return -(-case.layers // 3)


def make_runner(mode: str, model: torch.nn.Module, case: Case, device: str):
    if mode == "plain":
        return Plain(model, device)
    from ecru.l2l import L2L, L2LConfig

    keep = keep_blocks(case) if mode == "l2l_keep" else 0
    return L2L.from_hf(
        model,
        optimizer=ADAMW,
        config=L2LConfig(micro_batch_size=case.micro, device=device, keep_graph_blocks=keep),
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_alternating(case: Case, *, reps: int, device: str) -> dict[str, list[float]]:
    """Step times of every mode, in rotating order so that load changes hit all alike; first step is warm-up."""
    base = build(case)
    runners = {mode: make_runner(mode, copy.deepcopy(base), case, device) for mode in MODES}
    del base
    times: dict[str, list[float]] = {key: [] for mode in MODES for key in (mode, f"{mode}_cpu")}
    for rep in range(reps + 1):
        for mode in MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]:
            batch = make_batch(case, rep)
            sync(device)
            start, cpu = time.perf_counter(), time.process_time()  # process time: all threads' CPU seconds
            runners[mode].step(batch)
            sync(device)
            if rep > 0:
                times[mode].append(time.perf_counter() - start)
                times[f"{mode}_cpu"].append(time.process_time() - cpu)
        print(
            f"  {case.name} rep {rep}: " + " ".join(f"{m} {times[m][-1:]}" for m in MODES),
            file=sys.stderr,
            flush=True,
        )
    for mode in MODES[1:]:
        runners[mode].close()  # stop its optimizer thread; the next case starts from a clean process heap
    del runners
    gc.collect()
    return times


def reset_peak_rss() -> None:
    """Linux: a child inherits its parent's peak RSS through fork; writing 5 to clear_refs resets it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    try:
        status = Path("/proc/self/status").read_text()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(case: Case, mode: str, device: str) -> dict:
    """Peak memory of one mode in this (fresh) process: build, two steps."""
    reset_peak_rss()
    runner = make_runner(mode, build(case), case, device)
    for s in range(2):
        runner.step(make_batch(case, s))
    out = {"peak_rss_mb": peak_rss_mb()}
    if device.startswith("cuda"):
        out["peak_device_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def peak_in_subprocess(name: str, mode: str, *, quick: bool, device: str) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--mode", mode, "--device", device] + (
        ["--quick"] if quick else []
    )
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_case(case: Case, *, reps: int, quick: bool, device: str) -> dict:
    # memory first: the children then start from this process before it holds any model
    peaks = {mode: peak_in_subprocess(case.name, mode, quick=quick, device=device) for mode in MODES}
    times = time_alternating(case, reps=reps, device=device)
    result = {
        "case": asdict(case),
        "tokens_per_step": case.batch * case.seq,
        "micro_batches": -(-case.batch // case.micro),
    }
    for mode in MODES:
        result[mode] = {
            "step_s": statistics.median(times[mode]),
            "step_s_all": times[mode],
            "cpu_s": statistics.median(times[f"{mode}_cpu"]),
            **peaks[mode],
        }
    result["l2l_keep"]["keep_graph_blocks"] = keep_blocks(case)
    for mode, suffix in (("l2l", ""), ("l2l_keep", "_keep")):
        result[f"ratio{suffix}"] = result[mode]["step_s"] / result["plain"]["step_s"]
        # each round times the modes back to back: the median of per-round ratios cancels slow load drifts
        result[f"paired_ratio{suffix}"] = statistics.median(
            a / b for a, b in zip(times[mode], times["plain"], strict=True)
        )
        result[f"cpu_ratio{suffix}"] = (
            result[mode]["cpu_s"] / result["plain"]["cpu_s"]
        )  # less sensitive to load
        result[f"rss_ratio{suffix}"] = result[mode]["peak_rss_mb"] / result["plain"]["peak_rss_mb"]
    result["keep_rss_below_plain"] = result["l2l_keep"]["peak_rss_mb"] < result["plain"]["peak_rss_mb"]
    if device.startswith("cuda"):
        result["device_memory_ratio"] = result["l2l"]["peak_device_mb"] / result["plain"]["peak_device_mb"]
    result["params"] = sum(p.numel() for p in build(case).parameters())
    return result


def plot(results: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    names = list(results)
    for k, mode in enumerate(MODES):
        xs = [i + 0.27 * k for i in range(len(names))]
        ax1.bar(xs, [results[n][mode]["step_s"] for n in names], width=0.27, label=mode)
        ax2.bar(xs, [results[n][mode]["peak_rss_mb"] for n in names], width=0.27, label=mode)
    for ax, label in ((ax1, "median step time (s)"), (ax2, "peak host RSS (MiB)")):
        ax.set_xticks([i + 0.27 for i in range(len(names))], names)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(
        "L2L / plain (keep): "
        + ", ".join(f"{n} {results[n]['ratio']:.2f}x ({results[n]['ratio_keep']:.2f}x)" for n in names),
        fontsize=9,
    )
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: within 5 minutes on 2 CPU cores")
    parser.add_argument("--json", default=None, help="write results here (a PNG is written beside it)")
    parser.add_argument(
        "--reps",
        type=positive_int,
        default=None,
        help="timed steps per mode after one warm-up (default per case)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = QUICK if args.quick else CASES
    if args.child:
        print(json.dumps(child(cases[args.child], args.mode, args.device)))
        return 0
    names = args.only.split(",") if args.only else list(cases)
    if set(names) - set(cases):
        parser.error(f"--only: comma-separated names among {','.join(cases)}, got {args.only!r}")
    path = prepare_out_file(args.json, flag="--json") if args.json else None
    start = time.perf_counter()
    results = {
        n: run_case(cases[n], reps=args.reps or REPS[args.quick][n], quick=args.quick, device=args.device)
        for n in names
    }
    print(
        f"\n{'case':<15}{'params':>9}{'plain s':>10}{'l2l s':>9}{'ratio':>7}{'cpu ratio':>10}{'keep s':>8}{'ratio':>7}"
        f"{'plain RSS':>11}{'l2l RSS':>9}{'keep RSS':>10}"
    )
    for n, r in results.items():
        print(
            f"{n:<15}{r['params'] / 1e6:>8.1f}M{r['plain']['step_s']:>10.3f}{r['l2l']['step_s']:>9.3f}"
            f"{r['ratio']:>7.2f}{r['cpu_ratio']:>10.2f}{r['l2l_keep']['step_s']:>8.3f}{r['ratio_keep']:>7.2f}"
            f"{r['plain']['peak_rss_mb']:>10.0f}M{r['l2l']['peak_rss_mb']:>8.0f}M{r['l2l_keep']['peak_rss_mb']:>9.0f}M"
        )
    head = results[names[0]]
    out = {
        "command": " ".join(["python", *sys.argv]),
        "threads": {
            "torch": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
            "l2l_optimizer_worker_threads": 1,
        },
        "device": args.device,
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "dtype": "float32",
        "headline_case": names[0],
        "plain": head["plain"],
        "l2l": head["l2l"],
        "ratio": head["ratio"],
        "cpu_ratio": head["cpu_ratio"],
        "paired_ratio": head["paired_ratio"],
        "ratio_max": max(r["ratio"] for r in results.values()),
        "l2l_keep": head["l2l_keep"],
        "ratio_keep": head["ratio_keep"],
        "cpu_ratio_keep": head["cpu_ratio_keep"],
        "paired_ratio_keep": head["paired_ratio_keep"],
        "ratio_keep_max": max(r["ratio_keep"] for r in results.values()),
        "keep_rss_below_plain": all(r["keep_rss_below_plain"] for r in results.values()),
        "load_average_1min": os.getloadavg()[0],
        "cases": results,
        "wall_s": time.perf_counter() - start,
    }
    if path:
        atomic_write_text(path, json.dumps(out, indent=2))
        plot(results, path.with_suffix(".png"))
        print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
