"""The columnar CTR reader against pyarrow's raw CSV parse of the same file, side by side.

Writes a synthetic Criteo-format file (`ecru ctr synth`'s rows, with a few malformed lines added), then times,
in alternating repetitions (median of each):
- raw:   `pyarrow.csv.read_csv` of the file (tab-separated, every column read as text, one thread): the
         parse alone (typed columns would stop at the malformed counts);
- ecru:  `ecru.ctr.load_ctr_file(path, "criteo")` (vocabularies, skipping the malformed lines) and with
         `hash_buckets` — the whole load: parse, checks, ids, log-transformed counts, tensors.
Both read with one thread (the reader streams blocks through `open_csv` on one thread).

    python bench/ctr_reader.py --rows 1000000 --json bench/results/ctr_reader.json     # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow
import pyarrow.csv as pacsv

from ecru.cliargs import ArgumentParser, positive_int, prepare_out_file, run_main
from ecru.ctr import ReaderConfig, SyntheticConfig, generate, load_ctr_file, write_criteo_tsv
from ecru.io import atomic_write_text

TARGET = 3.0  # the bound on load time / raw parse time
NAMES = [f"c{i}" for i in range(40)]


def write_file(path: Path, rows: int) -> int:
    """A Criteo TSV of `rows` synthetic rows plus 3 malformed lines; returns the malformed count."""
    write_criteo_tsv(generate(SyntheticConfig(n_rows=rows, scale=1e-2, seed=0)), path)
    with open(path, "a") as f:
        f.write("2\t" + "\t".join(["1"] * 13 + ["0aaf7e0c"] * 26) + "\n")  # bad label
        f.write("1\t2\t3\n")  # too few columns
        f.write("0\t" + "\t".join(["x"] * 13 + ["0aaf7e0c"] * 26) + "\n")  # counts not integers
    return 3


def raw_parse(path: Path) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    pacsv.read_csv(
        path,
        read_options=pacsv.ReadOptions(column_names=NAMES, use_threads=False),
        parse_options=pacsv.ParseOptions(delimiter="\t", invalid_row_handler=lambda row: "skip"),
        convert_options=pacsv.ConvertOptions(column_types=dict.fromkeys(NAMES, pyarrow.string())),
    )
    return time.perf_counter() - start, time.process_time() - cpu


def ecru_load(path: Path, cfg: ReaderConfig) -> tuple[tuple[float, float], int, int]:
    start, cpu = time.perf_counter(), time.process_time()
    data, skipped = load_ctr_file(path, "criteo", cfg=cfg)
    return (time.perf_counter() - start, time.process_time() - cpu), len(data), skipped


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=positive_int, default=1_000_000, help="synthetic rows in the file")
    p.add_argument("--reps", type=positive_int, default=5, help="alternating repetitions of each measurement")
    p.add_argument("--json", default="bench/results/ctr_reader.json", help="result file")
    args = p.parse_args(argv)
    prepare_out_file(args.json, flag="--json")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "criteo.tsv"
        bad = write_file(path, args.rows)
        size = path.stat().st_size
        configs = {
            "vocabulary": ReaderConfig(skip_malformed=True),
            "hashing": ReaderConfig(skip_malformed=True, hash_buckets=1 << 20),
        }
        times: dict[str, list[float]] = {"raw": [], **{k: [] for k in configs}}
        cpu: dict[str, list[float]] = {k: [] for k in times}
        peak = psutil.Process().memory_info().rss
        for rep in range(args.reps + 1):  # the first repetition warms the page cache and is dropped
            t_raw = raw_parse(path)
            runs = {k: ecru_load(path, cfg) for k, cfg in configs.items()}
            peak = max(peak, psutil.Process().memory_info().rss)
            for k, ((t, c), rows, skipped) in [("raw", (t_raw, args.rows, bad)), *runs.items()]:
                assert rows == args.rows and skipped == bad, (k, rows, skipped)
                if rep:
                    times[k].append(t), cpu[k].append(c)
            print(
                f"rep {rep}: raw {t_raw[0]:.2f}s "
                + " ".join(f"{k} {t[0]:.2f}s" for k, (t, _, _) in runs.items()),
                file=sys.stderr,
            )
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    ratios = {k: med[k] / med["raw"] for k in configs}
    cpu_ratios = {k: med_cpu[k] / med_cpu["raw"] for k in configs}
    result = {
        "command": " ".join(["python", "bench/ctr_reader.py", *(argv if argv is not None else sys.argv[1:])]),
        "rows": args.rows,
        "malformed_lines": bad,
        "file_bytes": size,
        "reps": args.reps,
        "median_s": med,
        "times_s": times,
        "ratio_to_raw_parse": ratios,
        "median_cpu_s": med_cpu,
        "cpu_s": cpu,
        "cpu_ratio_to_raw_parse": cpu_ratios,
        "note": "wall ratios on a 2-core machine shared with other jobs; CPU (process) time is less disturbed",
        "rows_per_s": {k: args.rows / v for k, v in med.items()},
        "mb_per_s": {k: size / 1e6 / v for k, v in med.items()},
        "target_ratio": TARGET,
        "targets": {
            **{f"{k}_within_{TARGET:g}x_wall": r <= TARGET for k, r in ratios.items()},
            **{f"{k}_within_{TARGET:g}x_cpu": r <= TARGET for k, r in cpu_ratios.items()},
        },
        "peak_rss_bytes": peak,
        "pyarrow": pyarrow.__version__,
        "platform": platform.platform(),
        "cpus": psutil.cpu_count(),
    }
    atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    print(
        f"{args.rows:,} rows ({size / 1e6:.0f} MB): raw parse {med['raw']:.2f}s, load_ctr_file "
        + ", ".join(f"{k} {med[k]:.2f}s ({ratios[k]:.2f}x wall, {cpu_ratios[k]:.2f}x CPU)" for k in configs)
        + f" -> {args.json}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
