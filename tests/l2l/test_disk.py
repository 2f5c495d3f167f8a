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
    # one weights file and one optimizer-state file per group (4 blocks + stem/head), plus the manifest,
    # all inside the engine's own folder
    store = tmp_path / "ecru-l2l" / "store"
    assert len(list(store.glob("g*.pt"))) == 2 * 5 and (store / "manifest.pt").is_file()
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


def test_interrupted_step_then_resume_equals_uninterrupted(tmp_path):
    factory = functools.partial(FailingAdamW, lr=1e-2)
    data = [
        (
            torch.randn(6, 8, generator=torch.Generator().manual_seed(s)),
            torch.randn(6, 2, generator=torch.Generator().manual_seed(100 + s)),
        )
        for s in range(3)
    ]

    def engine_over(folder, seed=0):
        return L2L.from_sequential(
            _mlp(seed),
            loss_fn=nn.MSELoss(),
            optimizer=factory,
            config=L2LConfig(micro_batch_size=2, store="disk", store_dir=str(folder)),
        )

    FailingAdamW.fail_at, FailingAdamW.calls = None, 0
    straight = engine_over(tmp_path / "a")
    for batch in data:
        straight.step(batch)
    expected = straight.state_dict()
    straight.close()

    crashing = engine_over(tmp_path / "b")
    crashing.step(data[0])
    FailingAdamW.fail_at = FailingAdamW.calls + 3  # the 3rd of 5 block updates of step 2: 2 are on disk
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashing.step(data[1])
    with pytest.raises(RuntimeError):
        crashing.close()
    newer = [p for p in (tmp_path / "b" / "ecru-l2l" / "store").glob("g*-s000000002.w.pt")]
    assert len(newer) >= 2  # the interrupted step did write updated blocks ...
    FailingAdamW.fail_at = None

    resumed = engine_over(tmp_path / "b", seed=7)  # ... but resume ignores them: other init, same result
    assert resumed.steps == 1
    assert not list((tmp_path / "b" / "ecru-l2l" / "store").glob("g*-s000000002.*"))
    for batch in data[1:]:
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
