"""Use after training and in real loops: forward-only evaluation, the model back on one device,
learning-rate schedules across blocks, save_pretrained in the model's dtype with its tokenizer."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch

from ecru.l2l import L2L, L2LConfig
from ecru.models import tiny_llama

from .helpers import assert_params_close, lm_batch, reference_step, tiny_family

SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_forward_equals_the_models_own_forward_and_changes_nothing(tmp_path, tier):
    model = tiny_family("mistral").train()  # train mode: forward must still evaluate without dropout
    disk = {"store": "disk", "store_dir": str(tmp_path), "fsync": False} if tier == "disk" else {}
    engine = L2L.from_hf(model, optimizer=SGD, config=L2LConfig(micro_batch_size=2, **disk))
    engine.step(lm_batch(seed=0))
    before = engine.state_dict()
    batch = lm_batch(seed=1)
    out = engine.forward(batch)
    assert engine.steps == 1 and model.training
    reference = tiny_family("mistral").eval()
    reference.load_state_dict(before)
    with torch.no_grad():
        want = reference(**batch)
    assert out.loss == pytest.approx(want.loss.item(), rel=1e-5)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(out.outputs[real], want.logits[real], atol=1e-5, rtol=1e-5)
    logits_only = engine.forward({k: v for k, v in batch.items() if k != "labels"})
    assert logits_only.loss is None and torch.equal(logits_only.outputs, out.outputs)
    for name, value in engine.state_dict().items():
        assert torch.equal(value, before[name]), name
    engine.close()


def test_model_on_hands_the_whole_model_back_for_generation(tmp_path):
    model = tiny_llama(num_layers=3)
    config = L2LConfig(micro_batch_size=2, store="disk", store_dir=str(tmp_path), fsync=False)
    engine = L2L.from_hf(model, optimizer=SGD, config=config)
    engine.step(lm_batch())
    trained = engine.state_dict()
    back = engine.model_on("cpu", dtype=torch.bfloat16)
    assert back is model
    assert {p.device.type for p in back.parameters()} == {"cpu"}
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}
    assert all(p.numel() > 0 for p in back.parameters())  # the disk tier read every block back
    torch.testing.assert_close(
        back.model.layers[2].mlp.up_proj.weight.float(),
        trained["model.layers.2.mlp.up_proj.weight"],
        atol=1e-2,
        rtol=1e-2,
    )
    out = back.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_lr_scheduler_on_every_block_equals_plain_training_with_the_schedule():
    warmup = lambda step: (step + 1) / 3  # noqa: E731
    ref = tiny_llama(num_layers=3)
    engine = L2L.from_hf(copy.deepcopy(ref), optimizer=SGD, config=L2LConfig(micro_batch_size=2))
    engine.lr_scheduler(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup))
    opt = SGD(ref.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    for step in range(3):
        batch = lm_batch(seed=step)
        assert engine.step(batch) == pytest.approx(reference_step(ref, opt, batch), rel=1e-6)
        sched.step()
    assert_params_close(ref, engine.state_dict())
    assert [g.optimizer.param_groups[0]["lr"] for g in engine.store.groups] == pytest.approx(
        [0.5 * 4 / 3] * 4
    )


def test_lr_scheduler_resumes_with_the_disk_store(tmp_path):
    warmup = lambda step: (step + 1) / 4  # noqa: E731
    config = L2LConfig(micro_batch_size=2, store="disk", store_dir=str(tmp_path), fsync=False)
    engine = L2L.from_hf(tiny_llama(num_layers=2), optimizer=SGD, config=config)
    engine.lr_scheduler(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup))
    for s in range(2):
        engine.step(lm_batch(seed=s))
    engine.close()
    resumed = L2L.from_hf(tiny_llama(num_layers=2), optimizer=SGD, config=config)
    with warnings.catch_warnings():  # the fast-forward is silent: no "scheduler before optimizer" warning
        warnings.filterwarnings("error", message=r"Detected call of `lr_scheduler.step\(\)` before")
        resumed.lr_scheduler(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup))
    assert [g.optimizer.param_groups[0]["lr"] for g in resumed.store.groups] == pytest.approx(
        [0.5 * 3 / 4] * 3
    )
    resumed.close()


def test_save_pretrained_in_the_models_dtype_with_config_and_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = tiny_llama(num_layers=2).to(torch.bfloat16)
    engine = L2L.from_hf(model, optimizer=SGD, config=L2LConfig(micro_batch_size=2, compute_dtype="bfloat16"))
    engine.step(lm_batch())
    masters = engine.state_dict()
    assert masters["model.norm.weight"].dtype == torch.float32  # trained in fp32 masters ...
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    )
    engine.save_pretrained(tmp_path / "hf", tokenizer=tok)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}  # ... exported as it came in
    for name, value in back.state_dict().items():
        assert torch.equal(value, masters[name].to(torch.bfloat16)), name
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and (tmp_path / "hf" / "config.json").is_file()
