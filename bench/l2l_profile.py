"""Where one L2L step spends its time against one plain step (CPU, fp32): phase timers and op totals.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/l2l_profile.py --quick [--only deep-narrow] [--ops]

For each `bench/l2l.py` case it times, on one thread, alternating, medians of --reps steps:
  plain        forward, backward, optimizer step of ordinary training;
  plain-micro  (--micro) the same with gradient accumulation over L2L's micro-batches (the micro-batch
               effect alone, without anything L2L adds);
  l2l          the engine's phases (forward, head, block backward with its recompute, stem backward,
               waiting for the last updates), the store calls, and the optimizer time of its worker thread.
Phase timers count CPU seconds of the calling thread (`time.thread_time`), so other jobs on a shared
machine inflate them far less than wall time; wall, process CPU, system time and minor page faults of
whole steps are printed too. --ops adds torch.profiler op totals of one step of each.
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
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


def timed(phases: dict[str, float], name: str, fn):
    """`fn` timed in CPU seconds of the calling thread (robust to other load on the machine)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.thread_time() - start

    return wrapper


def instrument(engine) -> tuple[dict[str, float], dict[str, float]]:
    """Phase timers on the engine's methods (main thread) and on the store's optimizer work (worker)."""
    main: dict[str, float] = collections.defaultdict(float)
    worker: dict[str, float] = collections.defaultdict(float)
    for name in ("_forward", "_head", "_backward_block", "_backward_stem", "_finish_update"):
        setattr(engine, name, timed(main, name, getattr(engine, name)))
    call = engine._call

    def timed_call(module, binding, weights, args, *, kwargs=None, fresh_buffers=False):
        kind = "head" if module is engine.parts.head else "stem" if module is engine.parts.stem else "block"
        name = f"  {kind} recompute" if fresh_buffers else f"  {kind} forward"
        return timed(main, name, call)(
            module, binding, weights, args, kwargs=kwargs, fresh_buffers=fresh_buffers
        )

    engine._call = timed_call
    store = engine.store
    for name in ("add_grads", "update", "weights"):
        setattr(store, name, timed(main, "store." + name, getattr(store, name)))
    store._apply = timed(worker, "optimizer(_apply)", store._apply)
    return main, worker


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


def run(case, *, reps: int, profile_ops: bool, with_micro: bool) -> None:
    base = build(case)
    plain = make_runner("plain", copy.deepcopy(base), case, "cpu")
    micro = PlainMicro(copy.deepcopy(base), case.micro) if with_micro else None
    engine = make_runner("l2l", copy.deepcopy(base), case, "cpu")
    del base
    main, worker = instrument(engine)
    times = collections.defaultdict(list)
    pph = collections.defaultdict(list)
    for rep in range(reps + 1):
        batch = make_batch(case, rep)
        runs = [
            ("plain", lambda b=batch: pph_append(pph, plain_phases(plain, b))),
            ("l2l", lambda b=batch: engine.step(b)),
        ]
        if with_micro:
            runs.insert(1, ("plain-micro", lambda b=batch: micro.step(b)))
        for name, fn in runs if rep % 2 == 0 else runs[::-1]:
            if name == "l2l":
                main.clear()
                worker.clear()
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
                if name == "l2l":
                    for k, v in {**main, **{"worker." + k: v for k, v in worker.items()}}.items():
                        times["l2l." + k].append(v)
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
        print()
    if profile_ops:
        batch = make_batch(case, 99)
        op_table(lambda: plain.step(batch), f"{case.name} plain", 18)
        op_table(lambda: engine.step(batch), f"{case.name} l2l", 24)
    engine.close()


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
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = QUICK if args.quick else CASES
    for name in args.only.split(",") if args.only else cases:
        run(cases[name], reps=args.reps, profile_ops=args.ops, with_micro=args.micro)
    return 0


if __name__ == "__main__":
    sys.exit(main())
