"""L2L on a GPU: fp32 parity with plain CUDA training, plain vs L2L step time over depths and tokens per
block pass, a LoRA fine-tune with the frozen base read in place from a model folder, and a full
fine-tune of a real model folder (a few minutes on one GPU). One prepared command:

    python bench/l2l_gpu.py --json bench/results/l2l_gpu.json [--quick] [--model smollm2|tiny|FOLDER]

On a machine without CUDA it exits with a message; `--device cpu` runs every section at toy sizes
(`--model tiny`, the CPU smoke run the tests make).

Parity: a small random Llama, fp32 without TF32, 3 AdamW steps, L2L (prefetch 1, host stash) against
plain PyTorch training on the same GPU; max |difference| of the parameters is reported and must be
<= 1e-4. Timing: a random Llama of width 2048 (MLP 5632, 32K vocabulary) at depths 8 and 16, bf16
compute, micro-batches of T = 2K / 8K / 16K tokens per block pass, 4 micro-batches per step; plain
training is bf16 autocast with fused AdamW on the GPU (its model fits: it is the baseline L2L must
approach). Median of alternating repetitions; the spec predicts L2L compute-bound from ~10K tokens per
block pass on H100/H200 + PCIe5 unless the host optimizer binds first.
Model folder (`--model`, default the bundled SmolLM2-135M resolved as `ecru l2l train --model` resolves
it, written as a bf16 safetensors folder as released models are; or any Hugging Face folder):
  lora_in_place  peft LoRA r=8 on every attention and MLP projection, fp32 compute: plain PEFT (the base
                 loaded whole onto the device) against L2L's disk tier reading the frozen base in place
                 from the folder (`frozen_weights`, the model built empty: ecru.l2l.frozen); max
                 |difference| of the adapter weights after the steps (<= 1e-4), losses, step times, peak
                 device memory, and the bytes of the run's store beside those of the trainable state (fp32
                 adapter and two AdamW moments) and of the base: no copy of the base.
  real_model     full fine-tune of the folder, fp32 compute: plain training on the device against L2L
                 (RAM tier, host stash); max |difference| of all parameters (<= 1e-4), losses, step
                 times (their ratio), peak device memory.
"""

from __future__ import annotations

import argparse
import copy
import functools
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ecru.cliargs import ArgumentParser, prepare_out_dir, prepare_out_file, run_main
from ecru.io import atomic_write_json
from ecru.l2l.cli import MODELS


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


PARITY_SHAPE = {"hidden": 256, "inter": 688, "heads": 4, "vocab": 1024}


def parity(device: str, *, shape: dict = PARITY_SHAPE, seq: int = 128) -> dict:
    from ecru.l2l import L2L, L2LConfig

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    ref = llama(4, **shape)
    model = copy.deepcopy(ref)
    ref = ref.to(device)
    opt = adamw(ref.parameters())
    engine = L2L.from_hf(
        model,
        optimizer=functools.partial(adamw, fused=True),
        config=L2LConfig(device=device, micro_batch_size=2, stash="host"),
    )
    for s in range(3):
        b = batch(8, seq, shape["vocab"], s)
        opt.zero_grad()
        ref(**{k: v.to(device) for k, v in b.items()}).loss.backward()
        opt.step()
        engine.step(b)
    got = engine.state_dict()
    diff = max_diff(got, ref.state_dict())
    engine.close()
    return {"max_abs_param_diff": diff, "ok": diff <= 1e-4}


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max |got - want| over the tensors of `want` (compared on the CPU in fp32)."""
    return max(float((got[k].float().cpu() - v.float().cpu()).abs().max()) for k, v in want.items())


SHAPE = {"hidden": 2048, "inter": 5632, "heads": 16, "vocab": 32000}
TOY_SHAPE = {"hidden": 64, "inter": 128, "heads": 4, "vocab": 256}


def timing(depth: int, tokens: int, *, reps: int, device: str = "cuda", shape: dict = SHAPE) -> dict:
    from ecru.l2l import L2L, L2LConfig

    torch.backends.cuda.matmul.allow_tf32 = True
    seq = min(tokens, 4096)
    rows_per_micro = max(1, tokens // seq)
    b = batch(4 * rows_per_micro, seq, shape["vocab"], 0)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4, fused=True)

    plain = llama(depth, **shape).to(device)
    popt = adamw(plain.parameters())
    gb = {k: v.to(device) for k, v in b.items()}

    def plain_step():
        popt.zero_grad(set_to_none=True)
        for j in range(4):  # the same micro-batches, as gradient accumulation
            mb = {k: v[j * rows_per_micro : (j + 1) * rows_per_micro] for k, v in gb.items()}
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                (plain(**mb).loss / 4).backward()
        popt.step()

    engine = L2L.from_hf(
        llama(depth, **shape),
        optimizer=adamw,
        config=L2LConfig(
            device=device,
            compute_dtype="bfloat16",
            micro_batch_size=rows_per_micro,
            stash="device",
            prefetch=1,
        ),
    )
    times: dict[str, list[float]] = {"plain": [], "l2l": []}
    for r in range(reps + 1):  # the first round warms up both
        for mode, fn in (("plain", plain_step), ("l2l", lambda: engine.step(b))):
            seconds = timed(fn, device)
            if r:
                times[mode].append(seconds)
    engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "depth": depth,
        "tokens_per_block_pass": rows_per_micro * seq,
        "plain_s": med["plain"],
        "l2l_s": med["l2l"],
        "ratio": med["l2l"] / med["plain"],
    }


def timed(fn, device: str) -> float:
    """Seconds `fn()` takes, the device's queued work included."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def peak_device_mb(device: str) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def reset_peak(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---- a model folder: LoRA with the base read in place, and a full fine-tune -------------------------
def model_folder(name: str, work: Path) -> Path:
    """`name` when it is a Hugging Face model folder, else the bundled model `name` (smollm2, tiny) as
    `ecru l2l train --model` resolves it, written under `work` in bf16 (the dtype models are released in)."""
    from ecru.io import atomic_folder
    from ecru.l2l.cli import load_model

    if (Path(name) / "config.json").is_file():
        return Path(name)
    model, tokenizer = load_model(name)
    folder = work / name
    with atomic_folder(folder) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return folder


def train(step, batches: list[dict], device: str) -> dict:
    """Run `step(batch)` (-> loss) over `batches`: losses, median step time after the first, peak device
    memory."""
    reset_peak(device)
    losses, times = [], []
    for b in batches:
        times.append(timed(lambda b=b: losses.append(float(step(b))), device))
    return {
        "losses": losses,
        "step_s": statistics.median(times[1:] or times),
        "peak_device_mb": peak_device_mb(device),
    }


def plain_step(model, opt, device: str):
    def step(b: dict) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(**{k: v.to(device) for k, v in b.items()}).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def with_lora(model):
    import peft

    from ecru.l2l.frozen import init_adapters_

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    init_adapters_(model, seed=0)  # the same adapter on a loaded base and on one built empty
    return model


def folder_batches(folder: Path, *, rows: int, seq: int, steps: int) -> list[dict]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(folder).vocab_size
    return [batch(rows, seq, vocab, seed) for seed in range(steps)]


def lora_in_place(folder: Path, work: Path, *, device: str, rows: int, seq: int, steps: int) -> dict:
    """Plain PEFT with the base on the device against L2L reading the frozen base from `folder`."""
    from transformers import AutoModelForCausalLM

    from ecru.l2l import L2L, L2LConfig
    from ecru.l2l.frozen import empty_model

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    batches = folder_batches(folder, rows=rows, seq=seq, steps=steps)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    plain = with_lora(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)).to(device)
    opt = adamw([p for p in plain.parameters() if p.requires_grad], fused=device != "cpu")
    out = {"plain_peft": train(plain_step(plain, opt, device), batches, device)}
    want = {n: p.detach().cpu() for n, p in plain.named_parameters() if p.requires_grad}
    del plain, opt
    store = work / "lora-store"
    config = L2LConfig(
        device=device, micro_batch_size=max(1, rows // 2), store="disk", store_dir=str(store),
        frozen_weights=str(folder),
    )  # fmt: skip
    engine = L2L.from_hf(
        with_lora(empty_model(folder)), optimizer=functools.partial(adamw, fused=True), config=config
    )
    out["l2l_in_place"] = train(engine.step, batches, device)
    got = engine.state_dict()
    engine.close()
    out["max_abs_adapter_diff"] = max_diff(got, want)
    out["store_mb"] = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) / 2**20
    out["base_mb"] = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    # trainable state only: fp32 adapter masters and AdamW's two moments (files, manifest: < 0.5 MiB more)
    out["trainable_state_mb"] = 3 * 4 * sum(v.numel() for v in want.values()) / 2**20
    out["ok"] = out["max_abs_adapter_diff"] <= 1e-4 and out["store_mb"] <= out["trainable_state_mb"] + 0.5
    return out


def real_model(folder: Path, *, device: str, rows: int, seq: int, steps: int) -> dict:
    """Full fine-tune of `folder`: plain training on the device against L2L (RAM tier, host stash)."""
    from transformers import AutoModelForCausalLM

    from ecru.l2l import L2L, L2LConfig

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    batches = folder_batches(folder, rows=rows, seq=seq, steps=steps)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-5, fused=device != "cpu")
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    out = {"plain": train(plain_step(plain, adamw(plain.parameters()), device), batches, device)}
    want = {k: v.cpu() for k, v in plain.state_dict().items()}
    del plain
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = L2LConfig(device=device, micro_batch_size=max(1, rows // 2), stash="host")
    engine = L2L.from_hf(model, optimizer=functools.partial(adamw, fused=True), config=config)
    out["l2l"] = train(engine.step, batches, device)
    got = engine.state_dict()
    engine.close()
    out["max_abs_param_diff"] = max_diff(got, want)
    out["ok"] = out["max_abs_param_diff"] <= 1e-4
    out["ratio"] = out["l2l"]["step_s"] / out["plain"]["step_s"]
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="depth 8 only, 2 repetitions")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--device", default="cuda", help="cuda (the benchmark) or cpu (every section at toy sizes)"
    )
    ap.add_argument(
        "--model", default=None, help="smollm2 (default on cuda), tiny (default on cpu) or a folder"
    )
    ap.add_argument(
        "--work", type=Path, default=None, help="folder for the model and store (default: a temp one)"
    )
    args = ap.parse_args(argv)
    try:
        toy = torch.device(args.device).type == "cpu"
    except RuntimeError:
        ap.error(f"argument --device: cuda, cuda:N or cpu, got {args.device!r}")
    if not toy and not torch.cuda.is_available():
        print(
            "bench/l2l_gpu.py needs a CUDA GPU; none here (--device cpu runs it at toy sizes)",
            file=sys.stderr,
        )
        return 1
    named = args.model in (None, *MODELS, "tiny-llama")
    if not named and not (Path(args.model).expanduser() / "config.json").is_file():
        ap.error(
            f"argument --model: {' or '.join(MODELS)} or a Hugging Face model folder, got {args.model!r}"
        )
    if args.json:
        prepare_out_file(args.json, flag="--json")
    if args.work:
        prepare_out_dir(args.work, flag="--work")
    work = Path(tempfile.mkdtemp(prefix="l2l-gpu-", dir=args.work))
    try:
        out = run_all(args, toy=toy, work=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        atomic_write_json(args.json, out)
    ok = [out["parity"]["ok"], out["lora_in_place"]["ok"], out["real_model"]["ok"]]
    return 0 if all(ok) else 1


def run_all(args: argparse.Namespace, *, toy: bool, work: Path) -> dict:
    device = args.device
    out = {
        "device": "cpu" if toy else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "parity": parity(device, shape=TOY_SHAPE, seq=16) if toy else parity(device),
        "timing": [],
    }
    print("parity:", out["parity"], flush=True)
    depths, tokens, reps = ((8,), (2048, 8192, 16384), 2) if args.quick else ((8, 16), (2048, 8192, 16384), 3)
    if toy:
        depths, tokens, reps = (2,), (64,), 1
    for depth in depths:
        for t in tokens:
            res = timing(depth, t, reps=reps, device=device, shape=TOY_SHAPE if toy else SHAPE)
            out["timing"].append(res)
            print(
                f"depth {depth:3d} T {res['tokens_per_block_pass']:6d}: plain {res['plain_s']:.3f} s  "
                f"L2L {res['l2l_s']:.3f} s  ratio {res['ratio']:.2f}",
                flush=True,
            )
    folder = model_folder(args.model or ("tiny" if toy else "smollm2"), work)
    sizes = {"rows": 2, "seq": 16, "steps": 2} if toy else {"rows": 4, "seq": 256, "steps": 4}
    out["model"] = str(args.model or folder.name)
    out["lora_in_place"] = lora_in_place(folder, work, device=device, **sizes)
    print("lora_in_place:", summary(out["lora_in_place"]), flush=True)
    out["real_model"] = real_model(folder, device=device, **sizes)
    print("real_model:", summary(out["real_model"]), flush=True)
    return out


def summary(result: dict) -> str:
    return ", ".join(
        f"{k} {v['step_s']:.3f} s/step"
        if isinstance(v, dict)
        else f"{k} {v:.4g}"
        if isinstance(v, float)
        else f"{k} {v}"
        for k, v in result.items()
    )


if __name__ == "__main__":
    sys.exit(run_main(main))
