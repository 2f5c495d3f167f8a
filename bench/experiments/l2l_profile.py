"""Where one L2L step spends its time against one plain step (CPU, fp32): phase timers and op totals.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/experiments/l2l_profile.py --quick [--only deep-narrow] [--ops]

For each `bench/l2l.py` case it times, on one thread, alternating, medians of --reps steps:
  plain        forward, backward, optimizer step of ordinary training;
  plain-micro  (--micro) the same with gradient accumulation over L2L's micro-batches (the micro-batch
               effect alone, without anything L2L adds);
  l2l          the engine's phases (forward, head, block backward with its recompute, stem backward,
               waiting for the last updates), read from the engine's torch.profiler spans (`l2l.*`) in
               one extra profiled step per round (main thread; the worker's updates show as waits);
  l2l-ordinary (--ordinary) the same engine with the ordinary recompute (the full block forward, not the
               lean Llama graph of ecru.l2l.recompute): an A/B of the lean recompute in the same rounds.
--sweep instead times only the backward's block work, outside the engine: every layer of the case in
reverse, recompute + backward per micro-batch, with the ordinary (full forward) and the lean recompute
(ecru.l2l.recompute) alternating, and prints the paired median saving.
Phase times are the spans' wall time under the profiler (its overhead included); wall, process CPU,
main-thread CPU, system time and minor page faults of the whole (unprofiled) steps are printed too. --ops adds torch.profiler op totals of one step of each.
"""

from __future__ import annotations

import argparse
import collections
import copy
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]  # bench/: the product benchmark this study builds on
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))
from l2l import CASES, QUICK, Plain, build, make_batch, make_runner  # noqa: E402


class PlainMicro(Plain):
    """Plain training with gradient accumulation over micro-batches of `micro` rows (same loss)."""

    def __init__(self, model: torch.nn.Module, micro: int):
        super().__init__(model, "cpu")
        self.micro = micro

    def step(self, batch: dict) -> float:
        self.opt.zero_grad(set_to_none=True)
        n = int((batch["labels"][:, 1:] != -100).sum())
        total = 0.0
        for rows in range(0, batch["input_ids"].shape[0], self.micro):
            mb = {k: v[rows : rows + self.micro] for k, v in batch.items()}
            loss = self.model(**mb, num_items_in_batch=n).loss
            loss.backward()
            total += loss.item()
        self.opt.step()
        return total


def spans(engine, batch: dict) -> dict[str, float]:
    """One more step of `engine` under torch.profiler: seconds inside each of the engine's own spans
    (`l2l.forward`, `l2l.head`, `l2l.backward.block`, `l2l.recompute`, `l2l.finish_update`, ...), summed
    over their calls; nothing of the engine is patched. The profiler sees the calling thread only: the
    optimizer worker's time shows as what the main thread waits for it (`l2l.finish_update`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step(batch)
    return {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages() if e.key.startswith("l2l.")}


def plain_phases(runner: Plain, batch: dict) -> dict[str, float]:
    out = {}
    runner.opt.zero_grad(set_to_none=True)
    t0 = time.thread_time()
    loss = runner.model(**batch).loss
    t1 = time.thread_time()
    loss.backward()
    t2 = time.thread_time()
    runner.opt.step()
    t3 = time.thread_time()
    out["forward"], out["backward"], out["optimizer"] = t1 - t0, t2 - t1, t3 - t2
    return out


def op_table(fn, label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    print(f"\n--- {label}: top ops by self CPU time (all threads) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40))


def run(case, *, reps: int, profile_ops: bool, with_micro: bool, ordinary: bool) -> None:
    base = build(case)
    plain = make_runner("plain", copy.deepcopy(base), case, "cpu")
    micro = PlainMicro(copy.deepcopy(base), case.micro) if with_micro else None
    engines = {"l2l": make_runner("l2l", copy.deepcopy(base), case, "cpu")}
    if ordinary:
        engines["l2l-ordinary"] = make_runner("l2l", copy.deepcopy(base), case, "cpu")
        engines["l2l-ordinary"].parts.output_unused_ok = False  # every block recomputes its full forward
    del base
    engine = engines["l2l"]
    times = collections.defaultdict(list)
    pph = collections.defaultdict(list)
    for rep in range(reps + 1):
        batch = make_batch(case, rep)
        runs = [
            ("plain", lambda b=batch: pph_append(pph, plain_phases(plain, b))),
            *((name, lambda b=batch, e=e: e.step(b)) for name, e in engines.items()),
        ]
        if with_micro:
            runs.insert(1, ("plain-micro", lambda b=batch: micro.step(b)))
        for name, fn in runs if rep % 2 == 0 else runs[::-1]:
            start, cpu, ru = (
                time.perf_counter(),
                time.process_time(),
                resource.getrusage(resource.RUSAGE_SELF),
            )
            thread = time.thread_time()
            fn()
            if rep > 0:
                after = resource.getrusage(resource.RUSAGE_SELF)
                times[name].append(time.perf_counter() - start)
                times[name + " [cpu]"].append(time.process_time() - cpu)
                times[name + " [main thread cpu]"].append(time.thread_time() - thread)
                times[name + " [sys]"].append(after.ru_stime - ru.ru_stime)
                times[name + " [minflt/1000]"].append((after.ru_minflt - ru.ru_minflt) / 1000)
        if rep > 0:  # the phases from one extra, profiled step of each engine (outside the timed steps)
            for name, e in engines.items():
                for k, v in spans(e, batch).items():
                    times[f"{name}.{k}"].append(v)
        print(f"  rep {rep} done", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n=== {case.name}: batch {case.batch}x{case.seq}, micro {case.micro}, medians of {reps} ===")
    for k, v in pph.items():
        print(f"  plain.{k:<30}{1e3 * statistics.median(v[1:]):9.1f} ms")
    for k in sorted(med):
        print(f"  {k:<36}{1e3 * med[k]:9.1f} ms")
    for k in ("", " [cpu]"):
        print(f"  ratio{k} l2l/plain {med['l2l' + k] / med['plain' + k]:.3f}", end="")
        if with_micro:
            print(f"   plain-micro/plain {med['plain-micro' + k] / med['plain' + k]:.3f}", end="")
        if ordinary:
            print(f"   l2l-ordinary/plain {med['l2l-ordinary' + k] / med['plain' + k]:.3f}", end="")
        print()
    if profile_ops:
        batch = make_batch(case, 99)
        op_table(lambda: plain.step(batch), f"{case.name} plain", 18)
        op_table(lambda: engine.step(batch), f"{case.name} l2l", 24)
    for e in engines.values():
        e.close()


def sweep_ab(case, *, reps: int) -> None:
    """The backward's per-block work (recompute + backward of each micro-batch, blocks in reverse) with
    the ordinary and the lean recompute, alternating; thread CPU time, medians and paired saving."""
    from ecru.l2l.recompute import llama_layer_graph

    model = build(case)
    layers, rows = list(model.model.layers), case.micro
    torch.manual_seed(1)
    n_micro = -(-case.batch // case.micro)
    inputs = [[torch.randn(rows, case.seq, case.hidden) for _ in range(n_micro)] for _ in layers]
    positions = torch.arange(case.seq).unsqueeze(0)
    context = {
        "attention_mask": None,
        "position_ids": positions,
        "position_embeddings": model.model.rotary_emb(inputs[0][0], position_ids=positions),
    }
    grads_out = [torch.randn(rows, case.seq, case.hidden) for _ in range(n_micro)]

    def backward_sweep(lean: bool) -> None:
        grads = list(grads_out)
        for layer, xs in zip(reversed(layers), reversed(inputs), strict=True):
            params = list(layer.parameters())
            for j, x in enumerate(xs):
                x = x.detach().requires_grad_()
                with torch.enable_grad():
                    y = llama_layer_graph(layer, x, context) if lean else layer(x, use_cache=False, **context)
                    torch.autograd.backward(y, grads[j], inputs=[x, *params])
                grads[j] = x.grad
            for p in params:
                p.grad = None

    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(reps + 1):
        for lean in (True, False) if rep % 2 == 0 else (False, True):
            start = time.thread_time()
            backward_sweep(lean)
            if rep > 0:
                times[lean].append(time.thread_time() - start)
    ordinary, lean = statistics.median(times[False]), statistics.median(times[True])
    saving = statistics.median(a - b for a, b in zip(times[False], times[True], strict=True))
    print(
        f"{case.name}: backward sweep ({len(layers)} blocks x {n_micro} micro-batches of {rows}x{case.seq}), "
        f"medians of {reps}: ordinary recompute {1e3 * ordinary:.1f} ms, lean {1e3 * lean:.1f} ms, "
        f"paired saving {1e3 * saving:.1f} ms ({100 * saving / ordinary:.1f}%)"
    )


def pph_append(pph, phases):
    for k, v in phases.items():
        pph[k].append(v)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--micro", action="store_true", help="also time plain training with micro-batches")
    parser.add_argument("--ops", action="store_true", help="also print torch.profiler op tables")
    parser.add_argument(
        "--ordinary", action="store_true", help="also time L2L with the ordinary (full) recompute"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="only time the backward's block work, ordinary vs lean recompute"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = QUICK if args.quick else CASES
    for name in args.only.split(",") if args.only else cases:
        if args.sweep:
            sweep_ab(cases[name], reps=args.reps)
            continue
        run(cases[name], reps=args.reps, profile_ops=args.ops, with_micro=args.micro, ordinary=args.ordinary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
