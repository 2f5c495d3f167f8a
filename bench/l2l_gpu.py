"""L2L on a GPU: fp32 parity with plain CUDA training, then plain vs L2L step time over depths and tokens
per block pass (a few minutes on one GPU). Ready for a task lent a GPU; on a CPU-only machine it exits
with a message.

    python bench/l2l_gpu.py --json bench/results/l2l_gpu.json [--quick]

Parity: a small random Llama, fp32 without TF32, 3 AdamW steps, L2L (prefetch 1, host stash) against
plain PyTorch training on the same GPU; max |difference| of the parameters is reported and must be
<= 1e-4. Timing: a random Llama of width 2048 (MLP 5632, 32K vocabulary) at depths 8 and 16, bf16
compute, micro-batches of T = 2K / 8K / 16K tokens per block pass, 4 micro-batches per step; plain
training is bf16 autocast with fused AdamW on the GPU (its model fits: it is the baseline L2L must
approach). Median of alternating repetitions; the spec predicts L2L compute-bound from ~10K tokens per
block pass on H100/H200 + PCIe5 unless the host optimizer binds first.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def llama(depth: int, *, hidden: int, inter: int, heads: int, vocab: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        num_hidden_layers=depth,
        vocab_size=vocab,
        max_position_embeddings=16384,
        attn_implementation="sdpa",
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def batch(rows: int, seq: int, vocab: int, seed: int) -> dict:
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def parity() -> dict:
    from ecru.l2l import L2L, L2LConfig

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    ref = llama(4, hidden=256, inter=688, heads=4, vocab=1024)
    model = copy.deepcopy(ref)
    ref = ref.cuda()
    opt = adamw(ref.parameters())
    engine = L2L.from_hf(
        model,
        optimizer=functools.partial(adamw, fused=True),
        config=L2LConfig(device="cuda", micro_batch_size=2, stash="host"),
    )
    for s in range(3):
        b = batch(8, 128, 1024, s)
        opt.zero_grad()
        ref(**{k: v.cuda() for k, v in b.items()}).loss.backward()
        opt.step()
        engine.step(b)
    got = engine.state_dict()
    diff = max(
        float((got[k].float().cpu() - v.float().cpu()).abs().max()) for k, v in ref.state_dict().items()
    )
    engine.close()
    return {"max_abs_param_diff": diff, "ok": diff <= 1e-4}


def timing(depth: int, tokens: int, *, reps: int) -> dict:
    from ecru.l2l import L2L, L2LConfig

    torch.backends.cuda.matmul.allow_tf32 = True
    shape = {"hidden": 2048, "inter": 5632, "heads": 16, "vocab": 32000}
    seq = min(tokens, 4096)
    rows_per_micro = max(1, tokens // seq)
    b = batch(4 * rows_per_micro, seq, shape["vocab"], 0)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4, fused=True)

    plain = llama(depth, **shape).cuda()
    popt = adamw(plain.parameters())
    gb = {k: v.cuda() for k, v in b.items()}

    def plain_step():
        popt.zero_grad(set_to_none=True)
        for j in range(4):  # the same micro-batches, as gradient accumulation
            mb = {k: v[j * rows_per_micro : (j + 1) * rows_per_micro] for k, v in gb.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                (plain(**mb).loss / 4).backward()
        popt.step()

    engine = L2L.from_hf(
        llama(depth, **shape),
        optimizer=adamw,
        config=L2LConfig(
            device="cuda",
            compute_dtype="bfloat16",
            micro_batch_size=rows_per_micro,
            stash="device",
            prefetch=1,
        ),
    )
    times: dict[str, list[float]] = {"plain": [], "l2l": []}
    for r in range(reps + 1):  # the first round warms up both
        for mode, fn in (("plain", plain_step), ("l2l", lambda: engine.step(b))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if r:
                times[mode].append(time.perf_counter() - t0)
    engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "depth": depth,
        "tokens_per_block_pass": rows_per_micro * seq,
        "plain_s": med["plain"],
        "l2l_s": med["l2l"],
        "ratio": med["l2l"] / med["plain"],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="depth 8 only, 2 repetitions")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/l2l_gpu.py needs a CUDA GPU; none here (run it on a machine with one)")
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "parity": parity(),
        "timing": [],
    }
    print("parity:", out["parity"], flush=True)
    depths, reps = ((8,), 2) if args.quick else ((8, 16), 3)
    for depth in depths:
        for tokens in (2048, 8192, 16384):
            res = timing(depth, tokens, reps=reps)
            out["timing"].append(res)
            print(
                f"depth {depth:3d} T {res['tokens_per_block_pass']:6d}: plain {res['plain_s']:.3f} s  "
                f"L2L {res['l2l_s']:.3f} s  ratio {res['ratio']:.2f}",
                flush=True,
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
