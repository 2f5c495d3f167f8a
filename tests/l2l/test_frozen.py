"""Frozen parameters and PEFT models: only trainable parameters get gradients, optimizer state and
updates, in every compute dtype; frozen ones stay bit-identical; LoRA through from_hf trains as plain
PEFT training does."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from ecru.l2l import L2L, L2LConfig
from ecru.models import tiny_llama

from .helpers import assert_params_close, lm_batch, reference_step, tiny_family

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
# Adam divides by sqrt(v): for an element whose gradient is near zero, the rounding difference of summing
# micro-batch gradients (~1e-9) becomes up to a few 1e-6 of its update (observed 2e-6 over 3 steps of
# lr 1e-2, which move parameters by ~3e-2)
ADAM_TOL = {"atol": 1e-5, "rtol": 1e-5}
FROZEN = ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn")


def _freeze_(model) -> list[str]:
    names = [n for n, _ in model.named_parameters() if n.startswith(FROZEN)]
    for name, p in model.named_parameters():
        p.requires_grad_(name not in names)
    return names


def _plain(ref, steps: int, *, micro_batches: int = 1):
    opt = ADAMW([p for p in ref.parameters() if p.requires_grad])
    return [reference_step(ref, opt, lm_batch(seed=s)) for s in range(steps)]


@pytest.mark.parametrize(
    "dtype,tol",
    [("float32", ADAM_TOL), ("bfloat16", None)],
)
@pytest.mark.parametrize("keep", [0, 1], ids=["recomputed", "kept-graph"])
def test_frozen_parameters_stay_bit_identical_and_get_no_optimizer_state(dtype, tol, keep):
    base = tiny_llama(num_layers=3, tie_word_embeddings=False)
    frozen = _freeze_(base)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    engine = L2L.from_hf(
        model,
        optimizer=ADAMW,
        config=L2LConfig(micro_batch_size=2, compute_dtype=dtype, keep_graph_blocks=keep),
    )
    losses = [engine.step(lm_batch(seed=s)) for s in range(3)]
    expected = _plain(ref, 3)
    assert losses == pytest.approx(expected, rel=1e-6 if dtype == "float32" else 2e-2)
    got, start = engine.state_dict(), base.state_dict()
    for name in frozen:
        assert torch.equal(got[name], start[name]), name  # bit-identical, in every dtype
    if tol is not None:  # bf16 rounding flips Adam's sign-like updates of tiny gradients: losses only
        assert_params_close(ref, got, **tol)
    trainable = [p for g in engine.store.groups for p in g.params if p.requires_grad]
    in_optimizer = [
        p
        for g in engine.store.groups
        if g.optimizer
        for grp in g.optimizer.param_groups
        for p in grp["params"]
    ]
    with_state = [p for g in engine.store.groups if g.optimizer for p in g.optimizer.state]
    assert {id(p) for p in in_optimizer} == {id(p) for p in with_state} == {id(p) for p in trainable}
    assert all(p.grad is None for p in model.parameters())
    assert (
        got["model.layers.0.mlp.gate_proj.weight"] - start["model.layers.0.mlp.gate_proj.weight"]
    ).abs().max() > 1e-3


def test_a_block_without_trainable_parameters_still_passes_gradients_down():
    """Block 1 wholly frozen, the stem too: block 0 and the head still train as in plain training."""
    base = tiny_llama(num_layers=3, tie_word_embeddings=False)
    for name, p in base.named_parameters():
        p.requires_grad_(not name.startswith(("model.layers.1.", "model.embed_tokens")))
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    engine = L2L.from_hf(model, optimizer=ADAMW, config=L2LConfig(micro_batch_size=2, stash="host"))
    losses = [engine.step(lm_batch(seed=s)) for s in range(2)]
    assert losses == pytest.approx(_plain(ref, 2), rel=1e-6)
    assert_params_close(ref, engine.state_dict(), **ADAM_TOL)
    assert engine.store.groups[2].optimizer is None  # block 1: nothing to optimize


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_peft_lora_through_from_hf_trains_as_plain_peft(family):
    peft = pytest.importorskip("peft")
    base = tiny_llama(num_layers=2) if family == "llama" else tiny_family("qwen2", num_layers=2)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0
    )
    torch.manual_seed(0)
    ref = peft.get_peft_model(copy.deepcopy(base), lora)
    for name, p in ref.named_parameters():  # LoRA B starts at zero: move it, or the base sees no gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    model = copy.deepcopy(ref)
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    engine = L2L.from_hf(model, optimizer=ADAMW, config=L2LConfig(micro_batch_size=2))
    trainable = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(len(g.optimizer.state) for g in engine.store.groups if g.optimizer) == 0
    losses = [engine.step(lm_batch(seed=s)) for s in range(3)]
    assert losses == pytest.approx(_plain(ref, 3), rel=1e-6)
    got = engine.state_dict()
    assert_params_close(ref, got, **ADAM_TOL)
    for name, value in start.items():
        if "lora_" not in name:
            assert torch.equal(got[name], value), name  # the frozen base, bit-identical
        else:
            assert not torch.equal(got[name], value), name  # every adapter trained
    n_state = sum(len(g.optimizer.state) for g in engine.store.groups if g.optimizer)
    assert n_state == len(trainable)


def test_peft_export_saves_the_trained_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_llama(num_layers=2), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    engine = L2L.from_hf(model, optimizer=ADAMW, config=L2LConfig(micro_batch_size=2))
    engine.step(lm_batch())
    engine.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    back = peft.PeftModel.from_pretrained(tiny_llama(num_layers=2), tmp_path / "adapter").state_dict()
    trained = engine.state_dict()
    lora = [k for k in trained if "lora_" in k]
    assert lora and all(torch.equal(back[k], trained[k]) for k in lora)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("keep", [0, 1], ids=["recomputed", "kept-graph"])
def test_a_bf16_frozen_base_stays_bf16_on_the_ram_tier_and_trains_as_its_fp32_upcast(dtype, keep):
    """Frozen weights keep their own dtype in host memory (no fp32 copy of a bf16 base); a block's are
    upcast while it computes, so training equals the same base given in fp32 (its exact upcast), bit for
    bit: losses and every trainable parameter after 3 steps."""
    base = tiny_llama(num_layers=3, tie_word_embeddings=False).to(torch.bfloat16)
    frozen = _freeze_(base)
    runs = []
    for model in (copy.deepcopy(base), copy.deepcopy(base).float()):
        config = L2LConfig(micro_batch_size=2, compute_dtype=dtype, keep_graph_blocks=keep)
        engine = L2L.from_hf(model, optimizer=ADAMW, config=config)
        held = {n: p.dtype for n, p in model.named_parameters() if n in frozen}
        losses = [engine.step(lm_batch(seed=s)) for s in range(3)]
        runs.append((losses, engine.state_dict(), held))
        engine.close()
    (losses, got, held), (want_losses, want, _) = runs
    assert set(held.values()) == {torch.bfloat16}  # no fp32 copy of the frozen base
    assert losses == want_losses
    for name, value in want.items():
        if name in frozen:
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name].float(), value), name
        else:
            assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name
    assert (
        got["model.layers.2.mlp.gate_proj.weight"].float()
        - base.state_dict()["model.layers.2.mlp.gate_proj.weight"].float()
    ).abs().max() > 1e-3  # it trained
