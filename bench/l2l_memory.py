"""Host memory against depth: plain PyTorch training vs L2L on the disk tier (peak RSS from the OS).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/l2l_memory.py --quick --json bench/results/l2l_memory_quick.json

The same-width random Llama (width 768, MLP 2048, 512-token vocabulary so that the blocks, not the
embedding, dominate) trains at depths 4, 8, 16, 32, each depth and mode in a fresh subprocess that
reports its own peak resident set size (`resource.getrusage(RUSAGE_SELF).ru_maxrss`). Plain training
holds the model, its gradients and fused AdamW's two moments (16 B/param) plus activations; L2L builds
the model block by block straight into the disk store (`add_block`: the whole model never exists in
memory) and holds a few blocks at a time (the store calls glibc's malloc_trim after each eviction: without
it freed block buffers stayed in the heap and the first version of this run measured ratio_l2l 1.54). `ratio_*` = peak RSS at the deepest / at the shallowest depth.
Target: ratio_l2l <= 1.25 while ratio_plain >= 3. One compute thread; L2L adds its optimizer worker and
its I/O thread.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ecru.cliargs import ArgumentParser, positive_int, prepare_out_file, run_main
from ecru.io import atomic_write_text

WIDTH = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
DEPTHS = (4, 8, 16, 32)


def _config(depth: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=depth, attn_implementation="sdpa", **WIDTH)


def _batch(batch: int, seq: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, WIDTH["vocab_size"], (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def worker(
    mode: str, depth: int, *, batch: int, seq: int, micro: int, steps: int, store_dir: str | None
) -> dict:
    """One depth in one mode, in this (fresh) process; returns losses, step times and peak RSS."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4, fused=True)
    losses, times = [], []
    if mode == "plain":
        model = LlamaForCausalLM(_config(depth))
        opt = adamw(model.parameters())
        for s in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = model(**_batch(batch, seq, s)).loss
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        params = sum(p.numel() for p in model.parameters())
    else:
        from ecru.l2l import L2L, L2LConfig

        config = _config(0)
        model = LlamaForCausalLM(config)  # stem + head only; the blocks are built one by one into the store
        engine = L2L.from_hf(
            model,
            optimizer=adamw,
            config=L2LConfig(micro_batch_size=micro, store="disk", store_dir=store_dir),
        )
        full = _config(depth)
        for i in range(depth):
            engine.add_block(LlamaDecoderLayer(full, layer_idx=i))
        params = sum(g.numel for g in engine.store.groups)
        for s in range(steps):
            t0 = time.perf_counter()
            losses.append(engine.step(_batch(batch, seq, s)))
            times.append(time.perf_counter() - t0)
        engine.close()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {
        "mode": mode,
        "depth": depth,
        "params": params,
        "rss_mb": round(rss_mb, 1),
        "losses": losses,
        "step_s": [round(t, 3) for t in times],
    }


def run(depths, *, batch: int, seq: int, micro: int, steps: int) -> dict:
    out: dict = {
        "width": WIDTH,
        "depths": list(depths),
        "batch": batch,
        "seq": seq,
        "micro_batch": micro,
        "steps": steps,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "plain": {},
        "l2l": {},
    }
    for depth in depths:
        for mode in ("plain", "l2l"):
            with tempfile.TemporaryDirectory(
                prefix="ecru-l2l-mem-", dir=os.environ.get("ECRU_L2L_DISK")
            ) as tmp:
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    mode,
                    "--depth",
                    str(depth),
                    "--batch",
                    str(batch),
                    "--seq",
                    str(seq),
                    "--micro",
                    str(micro),
                    "--steps",
                    str(steps),
                    "--store-dir",
                    tmp,
                ]
                res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            out[mode][str(depth)] = res
            print(
                f"depth {depth:3d} {mode:5s}: {res['params'] / 1e6:7.1f}M params  peak RSS {res['rss_mb']:8.1f} MB"
                f"  step {res['step_s'][-1]:.2f} s  loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}",
                flush=True,
            )
    lo, hi = str(min(depths)), str(max(depths))
    for mode in ("plain", "l2l"):
        out[f"ratio_{mode}"] = round(out[mode][hi]["rss_mb"] / out[mode][lo]["rss_mb"], 3)
    out["target_met"] = out["ratio_l2l"] <= 1.25 and out["ratio_plain"] >= 3
    return out


def main(argv=None) -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="2 steps of 2 x 64 tokens per depth (~5-10 min on 2 cores)"
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--worker", choices=("plain", "l2l"), help=argparse.SUPPRESS)
    ap.add_argument("--depth", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=positive_int, default=None)
    ap.add_argument("--seq", type=positive_int, default=None)
    ap.add_argument("--micro", type=positive_int, default=None)
    ap.add_argument("--steps", type=positive_int, default=None)
    ap.add_argument("--store-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batch = args.batch or (2 if args.quick else 8)
    seq = args.seq or (64 if args.quick else 128)
    micro = args.micro or (1 if args.quick else 2)
    steps = args.steps or (2 if args.quick else 3)
    if args.worker:
        print(
            json.dumps(
                worker(
                    args.worker,
                    args.depth,
                    batch=batch,
                    seq=seq,
                    micro=micro,
                    steps=steps,
                    store_dir=args.store_dir,
                )
            )
        )
        return
    if args.json:
        prepare_out_file(args.json, flag="--json")
    t0 = time.perf_counter()
    out = run(DEPTHS, batch=batch, seq=seq, micro=micro, steps=steps)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"ratio_plain {out['ratio_plain']}  ratio_l2l {out['ratio_l2l']}  target met: {out['target_met']}")
    if args.json:
        atomic_write_text(args.json, json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(run_main(main))
