"""State dicts, full checkpoints (resume equals uninterrupted training) and Hugging Face export."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from ecru.errors import EcruError, MissingAssetError
from ecru.l2l import L2L, L2LConfig
from ecru.models import tiny_gpt2, tiny_llama

from .helpers import lm_batch

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
CONFIG = L2LConfig(micro_batch_size=2)


def test_state_dict_loads_strict_into_the_original_model_class():
    engine = L2L.from_hf(tiny_llama(), optimizer=ADAMW, config=CONFIG)
    engine.step(lm_batch())
    fresh = tiny_llama(seed=9)
    fresh.load_state_dict(engine.state_dict(), strict=True)
    batch = lm_batch(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(fresh(**batch).loss, engine.model(**batch).loss, atol=0, rtol=0)


def test_load_state_dict_refreshes_the_weights_the_engine_computes_with():
    engine = L2L.from_hf(
        tiny_llama(),
        optimizer=functools.partial(torch.optim.SGD, lr=0.0),
        config=L2LConfig(micro_batch_size=2, compute_dtype="bfloat16"),
    )
    other = tiny_llama(seed=5)
    engine.load_state_dict(other.state_dict())
    batch = lm_batch()
    with torch.no_grad():
        expected = other.to(torch.bfloat16)(**batch).loss.item()
    assert engine.step(batch) == pytest.approx(expected, rel=2e-2)


@pytest.mark.parametrize("make", [lambda: tiny_gpt2(num_layers=2, dropout=0.1).train(), lambda: tiny_llama()])
def test_resume_equals_uninterrupted_training(tmp_path, make):
    base = make()
    batches = [lm_batch(seed=s) for s in range(4)]
    torch.manual_seed(0)
    straight = L2L.from_hf(copy.deepcopy(base), optimizer=ADAMW, config=CONFIG)
    losses = [straight.step(b) for b in batches]

    torch.manual_seed(0)
    first = L2L.from_hf(copy.deepcopy(base), optimizer=ADAMW, config=CONFIG)
    resumed_losses = [first.step(b) for b in batches[:2]]
    first.save(tmp_path / "ckpt")
    torch.manual_seed(123)  # the checkpoint restores the random state
    second = L2L.resume(tmp_path / "ckpt", copy.deepcopy(base), optimizer=ADAMW)
    assert second.steps == 2 and second.config == CONFIG
    resumed_losses += [second.step(b) for b in batches[2:]]
    assert resumed_losses == losses
    for name, value in straight.state_dict().items():
        torch.testing.assert_close(second.state_dict()[name], value, atol=0, rtol=0)


def test_checkpoint_is_written_atomically(tmp_path):
    engine = L2L.from_hf(tiny_llama(), optimizer=ADAMW, config=CONFIG)
    engine.save(tmp_path)
    engine.step(lm_batch())
    engine.save(tmp_path)  # the new state, then the manifest naming it; the old state is deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l2l-state-s000000001.safetensors", "manifest.json"]
    with pytest.raises(MissingAssetError, match="no L2L checkpoint"):
        L2L.resume(tmp_path / "missing", tiny_llama(), optimizer=ADAMW)


def test_sequential_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    engine = L2L.from_sequential(seq, loss_fn=nn.MSELoss(reduction="sum"), optimizer=ADAMW, reduction="sum")
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    engine.step((x, y))
    engine.save(tmp_path)
    again = L2L.resume(tmp_path, copy.deepcopy(seq), optimizer=ADAMW, loss_fn=nn.MSELoss(reduction="sum"))
    assert again.parts.options == {"reduction": "sum"}
    assert again.step((x, y)) == engine.step((x, y))


def test_save_pretrained_exports_a_loadable_hf_model(tmp_path):
    from transformers import AutoModelForCausalLM

    engine = L2L.from_hf(tiny_llama(), optimizer=ADAMW, config=CONFIG)
    engine.step(lm_batch())
    engine.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, value in engine.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, atol=0, rtol=0)


def test_checkpoint_refuses_tampering_and_never_unpickles(tmp_path):
    engine = L2L.from_hf(tiny_llama(), optimizer=ADAMW, config=CONFIG)
    engine.step(lm_batch())
    engine.save(tmp_path / "ckpt", meta={"losses": [1.5]})
    engine.close()
    from ecru.l2l.checkpoint import read_meta

    assert read_meta(tmp_path / "ckpt") == {"losses": [1.5]}
    state = tmp_path / "ckpt" / "l2l-state-s000000001.safetensors"
    good = state.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    state.write_bytes(bytes(flipped))
    with pytest.raises(EcruError, match="checksum mismatch"):
        L2L.resume(tmp_path / "ckpt", tiny_llama(), optimizer=ADAMW)
    state.write_bytes(good[: len(good) // 3])  # truncated
    with pytest.raises(EcruError, match="checksum mismatch"):
        L2L.resume(tmp_path / "ckpt", tiny_llama(), optimizer=ADAMW)
    import pickle

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('pickle executed')",))

    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "l2l_checkpoint.pt").write_bytes(pickle.dumps({"format": "ecru-l2l/1", "x": Boom()}))
    with pytest.raises(MissingAssetError, match="not loaded for safety"):
        L2L.resume(planted, tiny_llama(), optimizer=ADAMW)
