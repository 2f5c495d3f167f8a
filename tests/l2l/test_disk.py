"""The disk tier: parity with the RAM tier, O(a few blocks) in memory, atomic steps and resume."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from ecru.l2l import L2L, L2LConfig, L2LInputError
from ecru.models import tiny_llama

from .helpers import lm_batch

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
EXACT = {"atol": 0.0, "rtol": 0.0}


def _train(model, config, steps=3, *, blocks=None):
    engine = L2L.from_hf(model, optimizer=ADAMW, config=config)
    losses = [engine.step(lm_batch(seed=s), blocks=blocks) for s in range(steps)]
    return engine, losses


@pytest.mark.parametrize(("micro", "stash"), [(2, "device"), (5, "device"), (2, "disk")])
def test_disk_tier_equals_ram_tier_bit_for_bit(tmp_path, micro, stash):
    ref = tiny_llama(num_layers=4)
    ram, ram_losses = _train(copy.deepcopy(ref), L2LConfig(micro_batch_size=micro))
    disk, disk_losses = _train(
        copy.deepcopy(ref),
        L2LConfig(micro_batch_size=micro, store="disk", stash=stash, store_dir=str(tmp_path), fsync=False),
    )
    assert disk_losses == ram_losses
    expected, got = ram.state_dict(), disk.state_dict()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=lambda m, n=name: f"{n}: {m}", **EXACT)
    assert disk.store.resident_groups() == []  # after a step no block stays in memory
    assert disk.store.bytes_written > 0 and disk.store.bytes_read > 0
    # one safetensors file (weights and optimizer state) per group (4 blocks + stem/head), plus the
    # manifest, all inside the engine's own folder; nothing pickled
    store = tmp_path / "ecru-l2l" / "store"
    assert len(list(store.glob("g*.safetensors"))) == 5 and (store / "manifest.json").is_file()
    assert not list(store.glob("*.pt"))
    assert not list(tmp_path.glob("ecru-l2l/stash/*"))  # stashed activations are deleted once read back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ecru-l2l"]
    ram.close()
    disk.close()


def test_blocks_live_in_memory_only_while_used(tmp_path):
    model = tiny_llama(num_layers=6)
    engine = L2L.from_hf(
        model,
        optimizer=ADAMW,
        config=L2LConfig(micro_batch_size=2, store="disk", store_dir=str(tmp_path), fsync=False),
    )
    seen = []
    for block in engine.parts.blocks:
        block.register_forward_hook(lambda *_: seen.append(len(engine.store.resident_groups())))
    engine.step(lm_batch())
    assert max(seen) <= 3  # the executing block, the one read ahead, one being written behind
    assert all(p.numel() == 0 for p in model.model.layers[0].parameters())
    engine.close()


class FailingAdamW(torch.optim.AdamW):
    """AdamW that fails on the bottom block's update of one chosen step (a crash mid-step)."""

    fail_at: int | None = None
    calls = 0

    def step(self, closure=None):
        FailingAdamW.calls += 1
        if FailingAdamW.fail_at is not None and FailingAdamW.calls == FailingAdamW.fail_at:
            raise RuntimeError("simulated crash")
        return super().step(closure)


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)], nn.Linear(8, 2))


DATA = [
    (
        torch.randn(6, 8, generator=torch.Generator().manual_seed(s)),
        torch.randn(6, 2, generator=torch.Generator().manual_seed(100 + s)),
    )
    for s in range(3)
]


def _engine_over(folder, seed=0, **config):
    return L2L.from_sequential(
        _mlp(seed),
        loss_fn=nn.MSELoss(),
        optimizer=functools.partial(FailingAdamW, lr=1e-2),
        config=L2LConfig(micro_batch_size=2, **config),
    )


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_failed_step_is_rolled_back_and_the_engine_stays_usable(tmp_path, tier):
    """The 3rd of 5 block updates of step 2 fails, after 2 blocks were updated (and, on the disk tier,
    written): masters and optimizer states go back to the end of step 1, the same engine retries the
    step and ends bit for bit where an uninterrupted run ends."""
    disk = {"store": "disk", "store_dir": str(tmp_path / "b")} if tier == "disk" else {"rollback": True}
    FailingAdamW.fail_at, FailingAdamW.calls = None, 0
    straight = _engine_over(tmp_path / "a")
    for batch in DATA:
        straight.step(batch)
    expected = straight.state_dict()
    straight.close()

    engine = _engine_over(tmp_path / "b", **disk)
    engine.step(DATA[0])
    after_one = copy.deepcopy(engine.state_dict())
    moments = (
        [copy.deepcopy(g.optimizer.state_dict()) for g in engine.store.groups if g.optimizer]
        if tier == "ram"
        else None
    )
    FailingAdamW.fail_at = FailingAdamW.calls + 3
    with pytest.raises(RuntimeError, match="simulated crash"):
        engine.step(DATA[1])
    FailingAdamW.fail_at = None
    assert engine.steps == 1
    for name, value in engine.state_dict().items():
        torch.testing.assert_close(value, after_one[name], msg=name, **EXACT)
    if tier == "ram":
        for g, state in zip([g for g in engine.store.groups if g.optimizer], moments, strict=True):
            torch.testing.assert_close(g.optimizer.state_dict()["state"], state["state"], **EXACT)
    else:
        assert not list((tmp_path / "b" / "ecru-l2l" / "store").glob("g*-s000000002.*"))
    for batch in DATA[1:]:
        engine.step(batch)
    got = engine.state_dict()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=lambda m, n=name: f"{n}: {m}", **EXACT)
    engine.close()


def test_without_rollback_the_ram_tier_warns_keeps_the_updates_and_stays_usable():
    FailingAdamW.fail_at, FailingAdamW.calls = None, 0
    engine = _engine_over(None)
    engine.step(DATA[0])
    FailingAdamW.fail_at = FailingAdamW.calls + 3  # 2 updates done; a queued 3rd may still run
    with (
        pytest.warns(UserWarning, match="already updated [23] of 6"),
        pytest.raises(RuntimeError, match="simulated"),
    ):
        engine.step(DATA[1])
    FailingAdamW.fail_at = None
    assert engine.steps == 1
    engine.step(DATA[1])  # usable: no stale error, no leftover gradient
    assert engine.steps == 2 and all(p.grad is None for p in engine.model.parameters())
    engine.close()


def test_files_of_an_interrupted_process_are_ignored_on_resume(tmp_path):
    """A process killed mid-step leaves block files newer than the manifest: resume deletes them and
    starts from the last committed step (whatever the new model's initial weights)."""
    FailingAdamW.fail_at, FailingAdamW.calls = None, 0
    straight = _engine_over(tmp_path / "a")
    for batch in DATA:
        straight.step(batch)
    expected = straight.state_dict()
    straight.close()
    engine = _engine_over(tmp_path / "b", store="disk", store_dir=str(tmp_path / "b"))
    engine.step(DATA[0])
    engine.close()
    store = tmp_path / "b" / "ecru-l2l" / "store"
    for path in store.glob("g00001-s000000001.safetensors"):  # what a killed step 2 would have written
        path.with_name(path.name.replace("s000000001", "s000000002")).write_bytes(b"half written")
    resumed = _engine_over(tmp_path / "b", seed=7, store="disk", store_dir=str(tmp_path / "b"))
    assert resumed.steps == 1
    assert not list(store.glob("g*-s000000002.*"))
    for batch in DATA[1:]:
        resumed.step(batch)
    got = resumed.state_dict()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=lambda m, n=name: f"{n}: {m}", **EXACT)
    resumed.close()


def test_disk_tier_refuses_what_needs_the_whole_model(tmp_path):
    with pytest.raises(L2LInputError, match="store_dir"):
        L2LConfig(store="disk")
    with pytest.raises(L2LInputError, match="store_dir"):
        L2LConfig(stash="disk")
    with pytest.raises(L2LInputError, match="clipping"):
        L2LConfig(store="disk", store_dir=str(tmp_path), max_grad_norm=1.0)
    engine = L2L.from_hf(
        tiny_llama(num_layers=2),
        optimizer=ADAMW,
        config=L2LConfig(store="disk", store_dir=str(tmp_path / "s"), fsync=False),
    )
    engine.close()
    with pytest.raises(L2LInputError, match="different|sizes"):
        L2L.from_hf(
            tiny_llama(num_layers=3),
            optimizer=ADAMW,
            config=L2LConfig(store="disk", store_dir=str(tmp_path / "s")),
        )


@pytest.mark.gpu
def test_disk_tier_on_cuda_equals_ram_tier_on_cuda(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = tiny_llama(num_layers=4)
    ram, ram_losses = _train(copy.deepcopy(ref), L2LConfig(device="cuda", micro_batch_size=2, stash="host"))
    disk, disk_losses = _train(
        copy.deepcopy(ref),
        L2LConfig(device="cuda", micro_batch_size=2, stash="disk", store="disk", store_dir=str(tmp_path)),
    )
    assert disk_losses == pytest.approx(ram_losses, rel=1e-6)
    expected, got = ram.state_dict(), disk.state_dict()
    for name in expected:
        torch.testing.assert_close(got[name].cpu(), expected[name].cpu(), atol=1e-6, rtol=1e-5)
    ram.close()
    disk.close()


def test_store_dir_is_locked_and_the_users_files_are_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "g00001-s000000000.w.pt").write_text("a user file that looks like a block file")
    (tmp_path / "stash").mkdir()
    (tmp_path / "stash" / "b00000-m00000.pt").write_text("and one like a stash file")
    config = L2LConfig(micro_batch_size=2, store="disk", stash="disk", store_dir=str(tmp_path), fsync=False)
    engine = L2L.from_hf(tiny_llama(num_layers=2), optimizer=ADAMW, config=config)
    with pytest.raises(L2LInputError, match="in use by another ecru process"):
        L2L.from_hf(tiny_llama(num_layers=2), optimizer=ADAMW, config=config)
    engine.step(lm_batch())
    engine.close()
    again = L2L.from_hf(tiny_llama(num_layers=2), optimizer=ADAMW, config=config)  # released on close
    assert again.steps == 1
    again.close()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "g00001-s000000000.w.pt").is_file() and (
        tmp_path / "stash" / "b00000-m00000.pt"
    ).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ecru-l2l",
        "g00001-s000000000.w.pt",
        "notes.txt",
        "stash",
    ]


def test_disk_stash_writes_only_each_micro_batchs_own_bytes(tmp_path, monkeypatch):
    """Micro-batches are views into the batch tensors: saving a view writes its whole storage."""
    from ecru.l2l import stash as stash_module

    sizes = []
    real_save = torch.save
    monkeypatch.setattr(
        stash_module.torch,
        "save",
        lambda t, f, *a, **k: (sizes.append(t.untyped_storage().nbytes()), real_save(t, f)),
    )
    config = L2LConfig(micro_batch_size=1, stash="disk", store_dir=str(tmp_path))
    engine = L2L.from_sequential(
        nn.Sequential(nn.Identity(), nn.Linear(8, 2)), loss_fn=nn.MSELoss(), optimizer=ADAMW, config=config
    )
    engine.step((torch.randn(64, 8), torch.randn(64, 2)))  # block 0 (Identity) stashes views of the batch
    assert sizes and max(sizes) == 8 * 4  # one row of 8 floats, not the 64-row batch
    engine.close()


def test_fsync_syncs_the_folder_after_each_rename(tmp_path, monkeypatch):
    synced = []
    from ecru import io

    monkeypatch.setattr(io, "fsync_dir", lambda path: synced.append(path))
    config = L2LConfig(store="disk", store_dir=str(tmp_path), fsync=True)
    engine = L2L.from_hf(tiny_llama(num_layers=2), optimizer=ADAMW, config=config)
    synced.clear()
    engine.step(lm_batch())
    engine.close()
    # per step: 2 blocks + the resident group, one file each, and the manifest
    assert len(synced) == 3 + 1 and set(synced) == {tmp_path / "ecru-l2l" / "store"}


def test_learning_rates_are_saved_and_restored_with_the_store(tmp_path):
    config = L2LConfig(store="disk", store_dir=str(tmp_path), fsync=False)
    engine = L2L.from_hf(tiny_llama(num_layers=2), optimizer=ADAMW, config=config)
    for i, g in enumerate(engine.store.groups):  # what a schedule does: per block, changed in flight
        g.optimizer.param_groups[0]["lr"] = 1e-3 * (i + 1)
    engine.step(lm_batch())
    engine.close()
    resumed = L2L.from_hf(tiny_llama(num_layers=2), optimizer=ADAMW, config=config)
    assert [g.optimizer.param_groups[0]["lr"] for g in resumed.store.groups] == pytest.approx(
        [1e-3, 2e-3, 3e-3]
    )
    resumed.close()


def test_a_tampered_or_pickled_store_is_refused_in_one_line(tmp_path):
    """Bit flips in a committed block file are caught by the manifest's checksums when the store is opened;
    a planted pickle is never loaded (nothing in the store is unpickled)."""
    config = L2LConfig(store="disk", store_dir=str(tmp_path), fsync=False)
    engine = L2L.from_hf(tiny_llama(num_layers=2), optimizer=ADAMW, config=config)
    engine.step(lm_batch())
    engine.close()
    store = tmp_path / "ecru-l2l" / "store"
    block = sorted(store.glob("g00001-*.safetensors"))[0]
    data = bytearray(block.read_bytes())
    data[-5] ^= 0xFF
    block.write_bytes(bytes(data))
    with pytest.raises(L2LInputError, match="checksum mismatch in .*g00001"):
        L2L.from_hf(tiny_llama(num_layers=2), optimizer=ADAMW, config=config)
    (store / "manifest.json").unlink()
    import pickle

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('pickle executed')",))

    (store / "manifest.pt").write_bytes(pickle.dumps(Boom()))
    fresh = L2L.from_hf(
        tiny_llama(num_layers=2), optimizer=ADAMW, config=config
    )  # a new store, no unpickling
    assert fresh.steps == 0
    fresh.close()
