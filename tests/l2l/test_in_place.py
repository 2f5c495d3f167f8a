"""A LoRA run on the disk tier reads its frozen base in place from the model folder (ecru.l2l.frozen):
the same numbers as the model loaded whole, a store holding trainable state only, bytes that grow with
the trainable size alone."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ecru.io import load_state
from ecru.l2l import L2L, L2LConfig, L2LInputError
from ecru.l2l.frozen import empty_model, init_adapters_
from ecru.models import tiny_llama
from tests.l2l.helpers import lm_batch

STEPS = 3
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _folder(tmp_path: Path, *, intermediate: int = 64, tie: bool = True) -> Path:
    """A tiny Llama saved in bf16, the dtype its base keeps when read in place."""
    folder = tmp_path / f"base-{intermediate}"
    model = tiny_llama(num_layers=3, intermediate_size=intermediate, tie_word_embeddings=tie)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def _lora(model, seed: int = 1):
    import peft

    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    init_adapters_(model, seed=seed)
    return model.train()


def _engine(model, tmp_path: Path, name: str, **config) -> L2L:
    opt = functools.partial(torch.optim.AdamW, lr=1e-2, fused=True)
    cfg = L2LConfig(micro_batch_size=2, store_dir=str(tmp_path / name), **config)
    return L2L.from_hf(model, optimizer=opt, config=cfg)


def _train(engine: L2L) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [engine.step(lm_batch(batch=4, vocab=128, seed=s)) for s in range(STEPS)]
    engine.store.materialize(frozen=False)
    adapter = {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}
    engine.close()
    return losses, adapter


def _whole(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def test_empty_model_with_lora_starts_where_the_loaded_one_does(tmp_path):
    folder = _folder(tmp_path)
    whole, empty = _lora(_whole(folder)), _lora(empty_model(folder))
    want = {n: p for n, p in whole.named_parameters() if p.requires_grad}
    got = {n: p for n, p in empty.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys() and want
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)
    assert all(p.is_meta for p in empty.parameters() if not p.requires_grad)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_in_place_trains_exactly_as_the_model_loaded_whole(tmp_path, dtype):
    """Losses and adapter after 3 steps equal the RAM tier's on the model loaded whole in fp32 (bf16
    upcast to fp32 is exact, so the tolerance is 0 in fp32; bf16 compute: the same roundings too)."""
    folder = _folder(tmp_path)
    ref = _train(_engine(_lora(_whole(folder)), tmp_path, "ram", compute_dtype=dtype))
    engine = _engine(
        _lora(empty_model(folder)),
        tmp_path,
        "disk",
        compute_dtype=dtype,
        store="disk",
        frozen_weights=str(folder),
    )
    got = _train(engine)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=0, atol=0)
    for n, p in ref[1].items():
        torch.testing.assert_close(got[1][n], p, rtol=0, atol=0)


def test_the_store_holds_trainable_state_only(tmp_path):
    folder = _folder(tmp_path)
    engine = _engine(_lora(empty_model(folder)), tmp_path, "disk", store="disk", frozen_weights=str(folder))
    engine.step(lm_batch(batch=4, vocab=128))
    groups = engine.store.groups
    files = sorted((tmp_path / "disk").rglob("g*.safetensors"))
    assert len(files) == len(groups)
    for path in files:
        g = int(path.name[1:6])
        saved = load_state(path)
        assert saved["w"].numel() == groups[g].grad_numel  # the trainable masters, nothing of the base
        with safe_open(path, framework="pt") as f:
            elements = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        assert elements <= 3 * groups[g].grad_numel + len(groups[g].params)  # masters, m, v, step counts
    frozen = sum(g.numel - g.grad_numel for g in groups)
    stored = sum(path.stat().st_size for path in files)
    trainable = sum(g.grad_numel for g in groups)
    assert stored < 3 * 4 * trainable + 4096 * len(files) and stored < frozen  # masters + m + v (+ headers)
    assert engine.store.frozen_bytes_read > 0
    engine.close()


def _bytes_per_step(tmp_path: Path, intermediate: int) -> tuple[int, int, int, int]:
    folder = _folder(tmp_path, intermediate=intermediate)
    engine = _engine(
        _lora(empty_model(folder)), tmp_path, f"disk-{intermediate}", store="disk", frozen_weights=str(folder)
    )
    engine.step(lm_batch(batch=4, vocab=128))
    store = engine.store
    before = (store.bytes_read, store.bytes_written, store.frozen_bytes_read)
    engine.step(lm_batch(batch=4, vocab=128, seed=1))
    after = (store.bytes_read, store.bytes_written, store.frozen_bytes_read)
    frozen = sum(g.numel - g.grad_numel for g in store.groups)
    engine.close()
    return after[0] - before[0], after[1] - before[1], after[2] - before[2], frozen


def test_store_bytes_grow_with_the_trainable_state_only(tmp_path):
    """An MLP 8x wider (more frozen weights, the same LoRA on q_proj/v_proj): the store reads and writes
    the same bytes per step; only the frozen bytes mapped from the folder grow (bf16, each block read in
    the forward and again in the backward)."""
    narrow, wide = _bytes_per_step(tmp_path, 64), _bytes_per_step(tmp_path, 512)
    assert narrow[:2] == wide[:2] and narrow[0] > 0
    assert wide[2] > 3 * narrow[2]
    assert wide[3] > 3 * narrow[3]


def test_a_meta_parameter_without_a_folder_is_refused(tmp_path):
    folder = _folder(tmp_path)
    with pytest.raises(L2LInputError, match="frozen_weights"):
        _engine(_lora(empty_model(folder)), tmp_path, "disk", store="disk")
    with pytest.raises(L2LInputError, match="needs store"):
        L2LConfig(frozen_weights=str(folder))


def _cli_folder(tmp_path: Path) -> Path:
    """A tiny Llama with the CLI's byte tokenizer, saved in bf16 with it."""
    from ecru.l2l.data import byte_tokenizer

    folder, tok = tmp_path / "base", byte_tokenizer()
    model = tiny_llama(vocab_size=len(tok), hidden_size=64, num_layers=3, intermediate_size=128, seed=0)
    model.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_cli_lora_on_the_disk_tier_reads_the_base_in_place(tmp_path):
    """`ecru l2l train --model FOLDER --lora-r 4 --store disk`: the losses of the RAM tier's run (whose
    model is loaded whole), an adapter that loads on the base, and a run folder far smaller than the base."""
    from peft import PeftModel

    from ecru.cli import main

    folder = _cli_folder(tmp_path)
    base = ["l2l", "train", "--model", str(folder), "--batch-size", "4", "--micro-batch-size", "2"]
    base += ["--steps", "2", "--lora-r", "4", "--lora-targets", "q_proj,v_proj", "--lr", "1e-2"]
    runs = {}
    for store in ("ram", "disk"):
        assert main([*base, "--store", store, "--out", str(tmp_path / store)]) == 0
        runs[store] = json.loads((tmp_path / store / "metrics.json").read_text())["losses"]
    assert runs["disk"] == runs["ram"]
    model = PeftModel.from_pretrained(_whole(folder), tmp_path / "disk" / "adapter")
    assert any("lora_B" in n and float(p.abs().max()) > 0 for n, p in model.named_parameters())
    size = sum(p.stat().st_size for p in (tmp_path / "disk").rglob("*.safetensors"))  # store + adapter
    base_size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert size < base_size / 4


def test_cli_in_place_lora_resumes_exactly(tmp_path):
    """2 steps, then --resume to 4, equals 4 steps straight through (losses and adapter bit for bit)."""
    from safetensors.torch import load_file

    from ecru.cli import main

    folder = _cli_folder(tmp_path)
    base = ["l2l", "train", "--model", str(folder), "--batch-size", "4", "--micro-batch-size", "2"]
    base += ["--lora-r", "4", "--lr", "1e-2", "--store", "disk"]
    assert main([*base, "--steps", "4", "--out", str(tmp_path / "straight")]) == 0
    assert main([*base, "--steps", "2", "--out", str(tmp_path / "split")]) == 0
    assert main([*base, "--steps", "4", "--resume", "--out", str(tmp_path / "split")]) == 0
    runs = [json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("straight", "split")]
    assert runs[0]["losses"] == runs[1]["losses"]
    assert runs[1]["tokens_this_run"] < runs[0]["tokens_this_run"]  # it went on from step 2
    a, b = (load_file(tmp_path / n / "adapter" / "adapter_model.safetensors") for n in ("straight", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
