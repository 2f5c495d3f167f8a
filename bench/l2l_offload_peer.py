"""Forward-only evaluation of a Llama larger than a memory budget: ecru's L2L disk tier against accelerate's
disk offload (`device_map="auto"`, `max_memory={"cpu": ...}`, `offload_folder`), the peer a user would pick.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/l2l_offload_peer.py --work /tmp/l2l_offload \
        --max-memory-mb 512 --rounds 2 --json bench/results/l2l_offload_peer.json

One model folder (`save_pretrained`, safetensors, fp32, random weights from a fixed seed; built once under
`--work` and reused), one batch of `--sequences` random token sequences, one thread. Each arm runs in its
own process, A B B A, and reports its load time (accelerate: `from_pretrained` placing what exceeds the
budget in `offload_folder`; ecru: the folder read block by block into the disk tier's store, the model never
whole in memory), its evaluation time (the batch's loss, no autograd), its peak RSS, and the loss. accelerate
keeps whatever fits the budget in RAM and streams the rest from disk; ecru streams every block through a few
block buffers whatever the budget. Both read the folder through the same page cache (warm after the first
run: the times are compute plus copies, not cold-disk reads). `tests/l2l/test_offload_peer.py` checks both
losses against the plain model at a tiny size.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from ecru.cliargs import ArgumentParser, positive_int, prepare_out_dir, prepare_out_file, run_main
from ecru.io import atomic_write_json

SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}
ARMS = ("accelerate", "ecru")
KEYS = ("load_s", "eval_s", "peak_rss_mb", "peak_anon_rss_mb")


def build_folder(folder: Path, *, layers: int, shape: dict, seed: int = 0) -> Path:
    """A random Llama of `layers` blocks saved as a Hugging Face folder (built once, then reused)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, attn_implementation="sdpa", **shape))
    model.save_pretrained(folder)
    return folder


def batch_of(vocab: int, *, sequences: int, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (sequences, tokens), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _folder_tensors(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file or a sharded index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        return {k: folder / "model.safetensors" for k in f.keys()}


def _read(where: dict[str, Path], names: list[str], strip: str = "") -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for path in sorted({where[n] for n in names}):
        with safe_open(path, "pt") as f:
            out.update({n[len(strip) :]: f.get_tensor(n) for n in names if where[n] == path})
    return out


class PeakMemory:
    """This process's peak RSS (`VmHWM`: unlike `ru_maxrss` it does not carry the parent's peak across
    fork and exec) and its peak anonymous RSS, sampled every 20 ms (`RssAnon`: memory the process owns, not
    file pages mapped from the page cache, which safetensors' and accelerate's memory maps count in RSS)."""

    def __init__(self) -> None:
        self.anon_mb, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.anon_mb = max(self.anon_mb, _status_mb("RssAnon"))

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {
            "peak_rss_mb": _status_mb("VmHWM"),
            "peak_anon_rss_mb": max(self.anon_mb, _status_mb("RssAnon")),
        }


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ecru_engine(folder: Path, store_dir: Path, *, micro_batch_size: int = 1):
    """An L2L engine on the disk tier over the folder's model, read one block at a time (never whole)."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from ecru.l2l import L2L, L2LConfig

    config = AutoConfig.from_pretrained(folder)
    layers, where = config.num_hidden_layers, _folder_tensors(folder)
    config.num_hidden_layers = 0
    stem = LlamaForCausalLM(config)
    stem.load_state_dict(_read(where, [n for n in where if not n.startswith("model.layers.")]), strict=False)
    stem.tie_weights()
    engine = L2L.from_hf(
        stem,
        optimizer=functools.partial(torch.optim.SGD, lr=0.0),  # forward only: an optimizer without state
        config=L2LConfig(micro_batch_size=micro_batch_size, store="disk", store_dir=str(store_dir)),
    )
    config.num_hidden_layers = layers
    for i in range(layers):
        prefix = f"model.layers.{i}."
        block = LlamaDecoderLayer(config, layer_idx=i)
        block.load_state_dict(_read(where, [n for n in where if n.startswith(prefix)], strip=prefix))
        engine.add_block(block)
    return engine


def ecru_loss(folder: Path, batch: dict, work: Path) -> tuple[float, float, float]:
    """(loss, load_s, eval_s) with ecru's L2L disk tier; the store lives in a fresh folder under `work`."""
    store = Path(tempfile.mkdtemp(prefix="ecru-store-", dir=work))
    try:
        t0 = time.perf_counter()
        engine = ecru_engine(folder, store, micro_batch_size=len(batch["input_ids"]))  # accelerate's shapes
        t1 = time.perf_counter()
        loss = engine.forward(batch).loss
        t2 = time.perf_counter()
        engine.close()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return float(loss), t1 - t0, t2 - t1


def accelerate_loss(
    folder: Path, batch: dict, work: Path, *, max_memory_mb: float
) -> tuple[float, float, float]:
    """(loss, load_s, eval_s) with accelerate's big-model inference: what exceeds the budget is offloaded
    to a fresh `offload_folder` under `work` and streamed back per module."""
    from transformers import AutoModelForCausalLM

    offload = Path(tempfile.mkdtemp(prefix="accelerate-offload-", dir=work))
    try:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=torch.float32,
            device_map="auto",
            max_memory={"cpu": max_memory_mb * 2**20},
            offload_folder=str(offload),
        )
        model.eval()
        t1 = time.perf_counter()
        with torch.no_grad():
            loss = model(**batch).loss
        t2 = time.perf_counter()
        offloaded = sum(1 for d in model.hf_device_map.values() if d == "disk")
    finally:
        shutil.rmtree(offload, ignore_errors=True)
    if not offloaded:
        raise SystemExit(f"accelerate kept the whole model within {max_memory_mb} MiB: lower --max-memory-mb")
    return float(loss), t1 - t0, t2 - t1


def run_arm(arm: str, args: argparse.Namespace) -> dict:
    """One arm in this process (the child of `main`): its numbers and this process's peak RSS."""
    torch.set_num_threads(1)
    memory = PeakMemory()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.folder).vocab_size
    batch = batch_of(vocab, sequences=args.sequences, tokens=args.tokens)
    if arm == "ecru":
        loss, load_s, eval_s = ecru_loss(args.folder, batch, args.work)
    else:
        loss, load_s, eval_s = accelerate_loss(
            args.folder, batch, args.work, max_memory_mb=args.max_memory_mb
        )
    return {"arm": arm, "loss": loss, "load_s": load_s, "eval_s": eval_s, **memory.stop()}


def _child(arm: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--arm", arm, "--folder", str(args.folder), "--work", str(args.work),
           "--max-memory-mb", str(args.max_memory_mb), "--sequences", str(args.sequences),
           "--tokens", str(args.tokens)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summarize(runs: list[dict], *, folder_bytes: int, max_memory_mb: int) -> dict:
    """Medians per arm, ecru over accelerate, and whether the losses agree."""
    med = {arm: {k: statistics.median(r[k] for r in runs if r["arm"] == arm) for k in KEYS} for arm in ARMS}
    losses = {arm: [r["loss"] for r in runs if r["arm"] == arm] for arm in ARMS}
    return {
        "median": med,
        "ecru_over_accelerate": {k: med["ecru"][k] / med["accelerate"][k] for k in med["ecru"]},
        "loss": {arm: losses[arm][0] for arm in ARMS},
        "loss_max_abs_diff": max(abs(a - b) for a in losses["ecru"] for b in losses["accelerate"]),
        "folder_mb": folder_bytes / 2**20,
        "folder_over_budget": folder_bytes / (max_memory_mb * 2**20),
    }


def parse(argv=None) -> argparse.Namespace:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--work", type=Path, required=True, help="a folder for the model, the store and the offload"
    )
    ap.add_argument(
        "--layers", type=positive_int, default=24, help="24 blocks of width 1024: 341M parameters, 1.4 GB"
    )
    ap.add_argument("--max-memory-mb", type=positive_int, default=512, help="accelerate's CPU budget (MiB)")
    ap.add_argument("--sequences", type=positive_int, default=4)
    ap.add_argument("--tokens", type=positive_int, default=128, help="tokens per sequence")
    ap.add_argument("--rounds", type=positive_int, default=1, help="A B B A rounds")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # a child process: one arm
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.arm:
        print(json.dumps(run_arm(args.arm, args)))
        return 0
    prepare_out_dir(args.work, flag="--work")
    if args.json:
        prepare_out_file(args.json, flag="--json")
    args.folder = build_folder(args.work / f"llama_{args.layers}", layers=args.layers, shape=SHAPE)
    folder_bytes = sum(p.stat().st_size for p in args.folder.glob("*.safetensors"))
    runs = []
    for arm in ["accelerate", "ecru", "ecru", "accelerate"] * args.rounds:
        runs.append(_child(arm, args))
        r = runs[-1]
        print(f"{arm:10s} loss {r['loss']:.6f}  load {r['load_s']:6.1f} s  eval {r['eval_s']:6.1f} s  "
              f"peak RSS {r['peak_rss_mb']:6.0f} MB (anonymous {r['peak_anon_rss_mb']:5.0f} MB)", flush=True)  # fmt: skip
    out = {
        "setup": {
            "shape": SHAPE,
            "layers": args.layers,
            "max_memory_mb": args.max_memory_mb,
            "sequences": args.sequences,
            "tokens": args.tokens,
            "threads": 1,
            "order": "A B B A",
            "command": " ".join(sys.argv),
        },  # fmt: skip
        "runs": runs,
        **summarize(runs, folder_bytes=folder_bytes, max_memory_mb=args.max_memory_mb),
    }
    ratio = out["ecru_over_accelerate"]
    print(f"folder {out['folder_mb']:.0f} MB = {out['folder_over_budget']:.1f}x the {args.max_memory_mb} MiB budget; "
          f"ecru / accelerate: eval {ratio['eval_s']:.2f}x, load {ratio['load_s']:.2f}x, peak RSS "
          f"{ratio['peak_rss_mb']:.2f}x (anonymous {ratio['peak_anon_rss_mb']:.2f}x); loss difference {out['loss_max_abs_diff']:.2e}")  # fmt: skip
    if args.json:
        atomic_write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
