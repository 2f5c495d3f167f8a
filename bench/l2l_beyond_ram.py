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

`--mode lora-in-place`: a LoRA fine-tune of a Llama whose bf16 weights exceed this machine's RAM, from
the command line, with the frozen base read in place (ecru.l2l.frozen):

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/l2l_beyond_ram.py --mode lora-in-place \
        --store-dir /work/l2l_big --json bench/results/l2l_beyond_ram.json

writes a model folder (Llama 3 8B's layer shape, width 4096, MLP 14336, GQA 32/8, SmolLM2's 49152-token
vocabulary and tokenizer, `--layers` 60: 13.3B parameters, 26.6 GB of bf16 in one safetensors shard per
layer, each made and written alone: the model never exists in memory), runs `ecru l2l train --model
FOLDER --lora-r 8 --store disk --steps 2` in a child process and records its peak RSS and times, then
tries plain PEFT (transformers' `from_pretrained` in bf16 + `get_peft_model` + one step) in a child
under an address-space limit of the machine's RAM (`RLIMIT_AS`, which counts memory-mapped files too)
and records how it fails, beside the bytes it would need resident. The folder is deleted at the end
(`--keep` keeps it). Results go under "lora_in_place" in `--json`, other keys kept.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ecru.cliargs import (
    ArgumentParser,
    positive_float,
    positive_int,
    prepare_out_dir,
    prepare_out_file,
    run_main,
)
from ecru.io import atomic_write_text, merge_json, read_json_object

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
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--store-dir", type=Path, required=True, help="an empty folder on a disk with >= 50 GB free"
    )
    ap.add_argument("--mode", choices=("full", "lora-in-place"), default="full")
    ap.add_argument(
        "--layers", type=positive_int, default=None, help="full: 26 blocks (2.1B); lora-in-place: 60 (13.3B)"
    )
    ap.add_argument("--steps", type=positive_int, default=None, help="full: 3; lora-in-place: 2")
    ap.add_argument(
        "--tokens", type=positive_int, default=None, help="tokens per step (full: 128; lora-in-place: 16)"
    )
    ap.add_argument("--lr", type=positive_float, default=3e-4)
    ap.add_argument("--keep", action="store_true", help="lora-in-place: keep the model folder")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    prepare_out_dir(args.store_dir, flag="--store-dir")
    if args.json:
        prepare_out_file(args.json, flag="--json")
    if args.mode == "lora-in-place":
        if args.json:
            read_json_object(args.json)  # a file to merge into that cannot be read: refused before any work
        return lora_in_place(args)
    args.layers, args.steps, args.tokens = args.layers or 26, args.steps or 3, args.tokens or 128
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from ecru.l2l import L2L, L2LConfig

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
        atomic_write_text(args.json, json.dumps(out, indent=1))


# ---- --mode lora-in-place --------------------------------------------------------------------------
BIG = {  # Llama 3 8B's layers, SmolLM2's vocabulary (its tokenizer is bundled)
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def _layer_tensors(i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer `i` of the BIG Llama in bf16, random (std 0.02) projections, unit norms."""
    h, m = BIG["hidden_size"], BIG["intermediate_size"]
    kv = h * BIG["num_key_value_heads"] // BIG["num_attention_heads"]
    shapes = {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (m, h),
        "mlp.up_proj.weight": (m, h),
        "mlp.down_proj.weight": (h, m),
    }
    out = {
        f"model.layers.{i}.{k}": torch.empty(v, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
        for k, v in shapes.items()
    }
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"model.layers.{i}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return out


def write_big_model(folder: Path, layers: int) -> dict:
    """A Llama model folder (config, SmolLM2 tokenizer, sharded bf16 safetensors + index) written one
    shard at a time; returns its size."""
    from transformers import LlamaConfig

    from ecru.io import atomic_write_json, save_tensors
    from ecru.models import load_smollm2

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(num_hidden_layers=layers, dtype="bfloat16", **BIG)
    atomic_write_json(folder / "config.json", config.to_dict())
    _, tokenizer = load_smollm2()
    tokenizer.save_pretrained(folder)
    gen, weight_map, total = torch.Generator().manual_seed(0), {}, 0
    shards = [("embed", None)] + [(f"layer{i:03d}", i) for i in range(layers)]
    for name, i in tqdm(shards, desc="writing shards"):
        if i is None:
            tensors = {
                "model.embed_tokens.weight": torch.empty(
                    BIG["vocab_size"], BIG["hidden_size"], dtype=torch.bfloat16
                ).normal_(0, 0.02, generator=gen),
                "model.norm.weight": torch.ones(BIG["hidden_size"], dtype=torch.bfloat16),
            }
        else:
            tensors = _layer_tensors(i, gen)
        file = f"model-{name}.safetensors"
        save_tensors(folder / file, tensors, {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    atomic_write_json(
        folder / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}
    )
    return {"bytes": total, "params": total // 2}


def run_cli_lora(folder: Path, work: Path, *, steps: int, tokens: int, rank: int = 8) -> dict:
    """`ecru l2l train --lora-r R --store disk` on `folder` in a child; its metrics and peak RSS."""
    data = work / "texts.txt"
    data.write_text("\n".join(f"a short training text number {i} about the weather" for i in range(32)))
    out = work / "run"
    cmd = [sys.executable, "-m", "ecru.cli", "l2l", "train", "--model", str(folder), "--data", str(data)]
    cmd += ["--out", str(out), "--overwrite", "--steps", str(steps), "--batch-size", "1"]
    cmd += ["--micro-batch-size", "1", "--max-length", str(tokens), "--lora-r", str(rank), "--store", "disk"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"ecru l2l train failed:\n{proc.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    stored = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {
        "command": " ".join(cmd[1:]),
        "wall_s_with_setup": wall,
        "train_wall_s": metrics["wall_s_this_run"],
        "s_per_step": metrics["wall_s_this_run"] / steps,
        "losses": metrics["losses"],
        "peak_rss_mb": metrics["peak_rss_mb"],
        "peak_rss_mb_children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "run_folder_bytes": stored,
        "parameters": metrics["parameters"],
    }


_PEFT_CHILD = """
import resource, sys, torch, peft
from transformers import AutoModelForCausalLM
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16))
ids = torch.randint(0, 49152, (1, 16))
model(input_ids=ids, labels=ids).loss.backward()
print("plain peft: one step done")
"""


def plain_peft(folder: Path, params: int, limit_bytes: int) -> dict:
    """Plain PEFT on `folder` in a child whose address space is limited to `limit_bytes` (RLIMIT_AS):
    what happens, beside what it needs resident (bf16 weights alone: 2 bytes per parameter)."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _PEFT_CHILD, str(folder), str(limit_bytes)], capture_output=True, text=True
    )
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    return {
        "limit": f"RLIMIT_AS {limit_bytes / 2**30:.1f} GiB (address space: memory-mapped files count too)",
        "returncode": proc.returncode,
        "completed": "one step done" in proc.stdout,
        "error": err[-1][:300] if err and proc.returncode != 0 else None,
        "wall_s": time.perf_counter() - t0,
        "needs_resident_gb_bf16_weights": params * 2 / 1e9,
        "needs_resident_gb_fp32_weights": params * 4 / 1e9,
    }


def lora_in_place(args) -> None:
    layers, steps, tokens = args.layers or 60, args.steps or 2, args.tokens or 16
    folder, work = args.store_dir / "model", args.store_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        t0 = time.perf_counter()
        size = write_big_model(folder, layers)
        write_s = time.perf_counter() - t0
        print(
            f"model folder: {size['bytes'] / 1e9:.1f} GB of bf16 weights ({size['params'] / 1e9:.2f}B) in {write_s:.0f} s"
        )
        ecru = run_cli_lora(folder, work, steps=steps, tokens=tokens)
        print(
            f"ecru l2l train --lora-r 8 --store disk: peak RSS {ecru['peak_rss_mb']:.0f} MB, {ecru['s_per_step']:.0f} s/step, losses {ecru['losses']}"
        )
        peft = plain_peft(folder, size["params"], ram)
        print(f"plain PEFT under {peft['limit']}: completed={peft['completed']}, error: {peft['error']}")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "shape": BIG,
        "layers": layers,
        "model_bytes_bf16": size["bytes"],
        "params": size["params"],
        "ram_bytes": ram,
        "tokens_per_step": tokens,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "write_model_s": write_s,
        "ecru": ecru,
        "target_peak_rss_mb": 6144,
        "target_holds": ecru["peak_rss_mb"] <= 6144 and size["bytes"] > ram,
        "plain_peft": peft,
    }
    if args.json:
        merge_json(args.json, "lora_in_place", result)


if __name__ == "__main__":
    sys.exit(run_main(main))
