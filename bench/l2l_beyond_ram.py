"""Train a Llama larger than this machine's RAM: >= 2B parameters from L2L's disk tier.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/l2l_beyond_ram.py --store-dir /work/l2l_2b \
        --steps 3 --json bench/results/l2l_beyond_ram.json

Plain fp32 training with AdamW needs >= 16 bytes/parameter (weights, gradients, m, v): > 34 GB for the
2.1B-parameter model here (width 2560, MLP 6912, 26 blocks, 32K tied vocabulary), more than the 23 GB
of this machine. The model is built block by block straight into the disk store (`add_block`: it never
exists whole in memory), then trains `--steps` steps on one fixed batch (the loss must go down).
Reported: peak RSS, step times, bytes read and written per step, the disk bandwidth measured in the
same run (a 1 GiB file written with fsync, then read after dropping it from the page cache), and the
step time over the disk-bandwidth floor (bytes read / read bandwidth + bytes written / write bandwidth).
Reads may hit the page cache and compute (one CPU thread) is not overlapped perfectly, so the ratio is a
measurement, not a guarantee.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import time
from pathlib import Path

import torch
from tqdm import tqdm

SHAPE = {
    "hidden_size": 2560,
    "intermediate_size": 6912,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "vocab_size": 32000,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}


def disk_bandwidth(folder: Path, nbytes: int = 1 << 30) -> dict:
    """Write `nbytes` with fsync, drop the file from the page cache, read it back: bytes/s each way."""
    path = folder / ".bandwidth-probe"
    chunk = os.urandom(1 << 24)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - t0)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    while os.read(fd, 1 << 24):
        pass
    read = nbytes / (time.perf_counter() - t0)
    os.close(fd)
    path.unlink()
    return {"write_gb_s": write / 1e9, "read_gb_s": read / 1e9}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--store-dir", type=Path, required=True, help="an empty folder on a disk with >= 50 GB free"
    )
    ap.add_argument("--layers", type=int, default=26, help="26 blocks: 2.1B parameters")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per step (one sequence)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from ecru.l2l import L2L, L2LConfig

    args.store_dir.mkdir(parents=True, exist_ok=True)
    bw = disk_bandwidth(args.store_dir)
    print(f"disk: write {bw['write_gb_s']:.2f} GB/s, read {bw['read_gb_s']:.2f} GB/s", flush=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=0, attn_implementation="sdpa", **SHAPE))
    engine = L2L.from_hf(
        model,
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, fused=True),
        config=L2LConfig(micro_batch_size=1, store="disk", store_dir=str(args.store_dir)),
    )
    full = LlamaConfig(num_hidden_layers=args.layers, attn_implementation="sdpa", **SHAPE)
    t0 = time.perf_counter()
    for i in tqdm(range(args.layers), desc="building blocks into the store"):
        engine.add_block(LlamaDecoderLayer(full, layer_idx=i))
    build_s = time.perf_counter() - t0
    params = sum(g.numel for g in engine.store.groups)
    print(f"{params / 1e9:.2f}B parameters built into {args.store_dir} in {build_s:.0f} s", flush=True)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, args.tokens), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    steps = []
    for s in range(args.steps):
        r0, w0 = engine.store.bytes_read, engine.store.bytes_written
        t0 = time.perf_counter()
        loss = engine.step(batch)
        dt = time.perf_counter() - t0
        read, written = engine.store.bytes_read - r0, engine.store.bytes_written - w0
        floor = read / (bw["read_gb_s"] * 1e9) + written / (bw["write_gb_s"] * 1e9)
        steps.append(
            {
                "loss": loss,
                "step_s": dt,
                "bytes_read": read,
                "bytes_written": written,
                "disk_floor_s": floor,
                "step_over_floor": dt / floor,
            }
        )
        print(
            f"step {s}: loss {loss:.4f}  {dt:.0f} s  read {read / 1e9:.1f} GB  written {written / 1e9:.1f} GB  "
            f"floor {floor:.0f} s  ratio {dt / floor:.2f}",
            flush=True,
        )
    engine.close()
    out = {
        "shape": SHAPE,
        "layers": args.layers,
        "params": params,
        "tokens_per_step": args.tokens,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "disk": bw,
        "build_s": build_s,
        "steps": steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "ram_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        "plain_needs_gb": params * 16 / 1e9,
        "loss_decreased": steps[-1]["loss"] < steps[0]["loss"] if steps else None,
    }
    print(
        f"peak RSS {out['peak_rss_mb']:.0f} MB for {params / 1e9:.2f}B parameters "
        f"(plain training would need >= {out['plain_needs_gb']:.0f} GB; RAM {out['ram_gb']:.0f} GB)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
