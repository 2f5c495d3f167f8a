"""ecru against DeepCTR-Torch on the same arrays, split and sizes: DeepFM, embedding dim 10, MLP 400-400-400,
batch 1024, one epoch, Adam at 1e-3, 1 thread each, alternating runs (A B B A ...), each in its own process.

Reports per run and as medians: test AUC and logloss (computed here, by `ecru.ctr.metrics`, on the
predictions each process writes), training samples/s and peak RSS of the process. JSON out.

samples/s is the same work on both sides: rows trained / wall time of the training loop, which shuffles and
batches the rows, runs forward, backward and the optimizer step (L2 on the embedding tables included) on
every batch. DeepCTR-Torch: its `fit` (DataLoader over the arrays, 176 batches, the last one partial).
ecru: the loop of `ecru.ctr.train` as it reports it (`TrainResult.samples_per_s`: 175 full batches, data
feeding included; the model's construction and the end-of-epoch test evaluation are outside it, as
DeepCTR-Torch's constructor and `predict` are outside `fit`). The wall time of ecru's whole `train` call
(model built, trained, test split evaluated) is kept as `call_samples_per_s`.

DeepCTR-Torch goes in its OWN virtual environment, never the project's:

    python -m venv /tmp/peers && /tmp/peers/bin/pip install torch==2.13.0 \
      && /tmp/peers/bin/pip install --no-deps deepctr-torch==0.3.0 \
      && /tmp/peers/bin/pip install scikit-learn tqdm numpy pandas

    python bench/ctr_peers.py --peer-python /tmp/peers/bin/python --rows 200000 --pairs 1 \
      --json bench/results/ctr_peers.json

The data: `ecru.ctr.synthetic` rows (Criteo-shaped: 13 counts, 26 categorical fields with a known teacher),
written once as .npy arrays both processes read.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # ecru.cliargs is plain Python: the DeepCTR-Torch venv imports it too
from ecru.cliargs import ArgumentParser, positive_float, positive_int, prepare_out_file, run_main  # noqa: E402
from ecru.errors import EcruError  # noqa: E402

THREADS = 1
MLP, DIM, BATCH, LR = (400, 400, 400), 10, 1024, 1e-3


def write_arrays(folder: Path, rows: int, scale: float, seed: int) -> dict:
    """The synthetic rows split 90/10 (seeded), as .npy files; returns the oracle AUC of the test rows."""
    from ecru.ctr.synthetic import SyntheticConfig, generate, realised_oracle

    data = generate(SyntheticConfig(n_rows=rows, scale=scale, seed=seed))
    train, test = data.split_random(0.1, seed=seed)
    for name, part in (("train", train), ("test", test)):
        np.save(folder / f"{name}_dense.npy", part.dense.numpy())
        np.save(folder / f"{name}_cats.npy", part.cats.numpy().astype(np.int64))
        np.save(folder / f"{name}_labels.npy", part.labels.numpy())
    np.save(folder / "cardinalities.npy", np.array(data.cardinalities, np.int64))
    oracle_auc, oracle_logloss = realised_oracle(test)
    return {
        "train_rows": len(train),
        "test_rows": len(test),
        "oracle_auc": oracle_auc,
        "oracle_logloss": oracle_logloss,
    }


def load(folder: Path, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.load(folder / f"{name}_{k}.npy") for k in ("dense", "cats", "labels"))


def run_ecru(folder: Path, seed: int, mode: str) -> tuple[float, int, np.ndarray, dict]:
    """(training-loop seconds, rows trained, test probabilities) of ecru's DeepFM, 1K settings with Adam."""
    import torch

    from ecru.ctr.data import CTRData
    from ecru.ctr.training import TrainConfig, predict_probs, train

    cards = tuple(int(c) for c in np.load(folder / "cardinalities.npy"))
    parts = [CTRData(*(torch.from_numpy(a) for a in load(folder, n)), cards) for n in ("train", "test")]
    parts = [CTRData(p.dense, p.cats.int(), p.labels, cards) for p in parts]
    cfg = TrainConfig(
        batch_size=BATCH,
        epochs=1,
        mode=mode,
        recipe="adam",
        mlp=MLP,
        embed_dim=DIM,
        embed_lr=LR,
        seed=seed,
        progress=False,
    )
    start = time.perf_counter()
    res = train(cfg, parts[0], parts[1])
    seconds = time.perf_counter() - start
    samples = res.steps * cfg.batch_size
    extra = {"call_seconds": seconds, "call_samples_per_s": samples / seconds}
    return res.wall_s, samples, predict_probs(res.model, parts[1]).numpy(), extra


def run_deepctr(folder: Path, seed: int, mode: str) -> tuple[float, int, np.ndarray, dict]:
    """(`fit` seconds, rows trained, test probabilities) of DeepCTR-Torch's DeepFM on the same arrays."""
    from deepctr_torch.inputs import DenseFeat, SparseFeat
    from deepctr_torch.models import DeepFM

    cards = np.load(folder / "cardinalities.npy")
    (dense, cats, labels), (tdense, tcats, _) = load(folder, "train"), load(folder, "test")
    columns = [SparseFeat(f"C{f}", int(c), embedding_dim=DIM) for f, c in enumerate(cards)]
    columns += [DenseFeat(f"I{j}", 1) for j in range(dense.shape[1])]

    def inputs(d, c):
        return {
            **{f"C{f}": c[:, f] for f in range(c.shape[1])},
            **{f"I{j}": d[:, j] for j in range(d.shape[1])},
        }

    model = DeepFM(columns, columns, task="binary", dnn_hidden_units=MLP, device="cpu", seed=seed)
    model.compile("adam", "binary_crossentropy")  # torch Adam at its default lr 1e-3
    start = time.perf_counter()
    model.fit(inputs(dense, cats), labels, batch_size=BATCH, epochs=1, verbose=0, shuffle=True)
    seconds = time.perf_counter() - start
    return seconds, len(labels), model.predict(inputs(tdense, tcats), batch_size=65536).reshape(-1), {}


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(THREADS)
    folder = Path(args.arrays)
    run = run_ecru if args.worker == "ecru" else run_deepctr
    seconds, samples, probs, extra = run(folder, args.seed, args.mode)
    np.save(folder / f"probs_{args.tag}.npy", probs.astype(np.float32))
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (folder / f"run_{args.tag}.json").write_text(
        json.dumps({"seconds": seconds, "samples": samples, "peak_rss_mb": rss_mb, **extra})
    )
    return 0


def one_run(system: str, python: str, folder: Path, tag: str, seed: int, mode: str) -> dict:
    env_cmd = [
        python,
        __file__,
        "--worker",
        system,
        "--arrays",
        str(folder),
        "--tag",
        tag,
        "--seed",
        str(seed),
        "--mode",
        mode,
    ]
    done = subprocess.run(env_cmd, capture_output=True, text=True, env=_env())
    if done.returncode:
        raise SystemExit(f"{system} run failed:\n{done.stderr[-3000:]}")
    import torch

    from ecru.ctr.metrics import auc, logloss

    probs = torch.from_numpy(np.load(folder / f"probs_{tag}.npy"))
    labels = torch.from_numpy(np.load(folder / "test_labels.npy"))
    run = json.loads((folder / f"run_{tag}.json").read_text())
    return {
        "system": system,
        "auc": auc(labels, probs),
        "logloss": logloss(labels, probs.clamp(1e-7, 1 - 1e-7)),
        "samples_per_s": run["samples"] / run["seconds"],
        **run,
    }


def _env() -> dict:
    threads = str(THREADS)
    return {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "OMP_WAIT_POLICY": "PASSIVE",
    }


def summarise(runs: list[dict]) -> dict:
    out = {}
    for system in ("ecru", "deepctr-torch"):
        mine = [r for r in runs if r["system"] == system]
        out[system] = {
            k: statistics.median(r[k] for r in mine)
            for k in ("auc", "logloss", "samples_per_s", "peak_rss_mb", "call_samples_per_s")
            if all(k in r for r in mine)
        }
    out["speedup"] = out["ecru"]["samples_per_s"] / out["deepctr-torch"]["samples_per_s"]
    out["auc_gap"] = out["ecru"]["auc"] - out["deepctr-torch"]["auc"]
    out["targets"] = {
        "speedup >= 1.3": out["speedup"] >= 1.3,
        "|auc gap| <= 0.002": abs(out["auc_gap"]) <= 0.002,
    }
    return out


def main() -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer-python", default="/tmp/peers/bin/python", help="python of the DeepCTR-Torch venv")
    p.add_argument(
        "--rows", type=positive_int, default=200_000, help="synthetic rows (90%% train, 10%% test)"
    )
    p.add_argument(
        "--scale", type=positive_float, default=1e-2, help="cardinalities x this (ecru.ctr.synthetic)"
    )
    p.add_argument(
        "--pairs", type=positive_int, default=1, help="A B B A blocks (each runs both systems twice)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mode",
        choices=("full", "sparse"),
        default="full",
        help="ecru's embedding update: full (full-table Adam + L2, as DeepCTR-Torch's) or sparse (row-sparse)",
    )
    p.add_argument("--json", default="bench/results/ctr_peers.json")
    p.add_argument("--worker", choices=("ecru", "deepctr"), help=argparse.SUPPRESS)
    p.add_argument("--arrays", help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    out = prepare_out_file(args.json, flag="--json")
    if not os.access(args.peer_python, os.X_OK):
        raise EcruError(
            f"--peer-python {args.peer_python}: not an executable; make the venv as the docstring says"
        )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        facts = write_arrays(folder, args.rows, args.scale, args.seed)
        pythons = {"ecru": sys.executable, "deepctr-torch": args.peer_python}
        order = [s for _ in range(args.pairs) for s in ("ecru", "deepctr-torch", "deepctr-torch", "ecru")]
        runs = []
        for i, system in enumerate(order):
            worker_name = "ecru" if system == "ecru" else "deepctr"
            run = one_run(worker_name, pythons[system], folder, f"{i}", args.seed, args.mode)
            runs.append({**run, "system": system})
            call = (
                f" (whole train call {run['call_samples_per_s']:,.0f}/s)"
                if "call_samples_per_s" in run
                else ""
            )
            print(
                f"{system:14s} AUC {run['auc']:.4f} logloss {run['logloss']:.4f} {run['samples_per_s']:,.0f} "
                f"samples/s{call} peak RSS {run['peak_rss_mb']:,.0f} MB",
                flush=True,
            )
    result = {
        "setting": {
            "rows": args.rows,
            "scale": args.scale,
            "model": "deepfm",
            "dim": DIM,
            "mlp": MLP,
            "batch": BATCH,
            "lr": LR,
            "epochs": 1,
            "ecru_mode": args.mode,
            "threads": THREADS,
            "order": order,
        },
        **facts,
        "runs": runs,
        "summary": summarise(runs),
    }
    from ecru.io import atomic_write_text

    atomic_write_text(out, json.dumps(result, indent=1))
    s = result["summary"]
    print(
        f"ecru / DeepCTR-Torch samples/s: {s['speedup']:.2f}x; AUC gap {s['auc_gap']:+.4f}; oracle AUC "
        f"{facts['oracle_auc']:.4f} -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
