"""Dynamic depth: a subset or reordering of blocks per step, and blocks appended to a running engine."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from ecru.l2l import L2L, L2LConfig, L2LInputError

from .helpers import assert_params_close

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def _blocks(seed: int, n: int = 4) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n)]


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)


def _plain_step(blocks, opts, order, x, y):
    for o in opts:
        o.zero_grad(set_to_none=True)
    h = x
    for i in order:
        h = blocks[i](h)
    nn.functional.mse_loss(h, y).backward()
    for i in order:  # a dropped block has no gradient: its optimizer (and Adam's step count) stays put
        opts[i].step()


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_layer_drop_and_reordering_match_plain_and_keep_optimizer_state(tmp_path, store):
    ref = _blocks(0)
    opts = [ADAMW(b.parameters()) for b in ref]
    seq = nn.Sequential(*copy.deepcopy(ref))
    config = L2LConfig(
        micro_batch_size=2, store=store, store_dir=str(tmp_path) if store == "disk" else None, fsync=False
    )
    engine = L2L.from_sequential(seq, loss_fn=nn.MSELoss(), optimizer=ADAMW, config=config)
    orders = [[0, 1, 2, 3], [0, 2, 3], [3, 1, 0, 2], [1], [0, 1, 2, 3]]
    for step, order in enumerate(orders):
        x, y = _data(step)
        _plain_step(ref, opts, order, x, y)
        engine.step((x, y), blocks=order)
    assert_params_close(nn.Sequential(*ref), engine.state_dict())
    # block 1 ran in 4 of the 5 steps: its AdamW step count says its state was kept across the drops
    if store == "ram":
        state = engine.store.groups[2].optimizer.state
        assert {int(s["step"]) for s in state.values()} == {4}
    engine.close()


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_progressive_stacking_appends_blocks_to_a_running_engine(tmp_path, store):
    ref = _blocks(1, n=4)
    opts = [ADAMW(b.parameters()) for b in ref]
    seq = nn.Sequential(*copy.deepcopy(ref[:2]))
    config = L2LConfig(
        micro_batch_size=3, store=store, store_dir=str(tmp_path) if store == "disk" else None, fsync=False
    )
    engine = L2L.from_sequential(seq, loss_fn=nn.MSELoss(), optimizer=ADAMW, config=config)
    for step in range(6):
        depth = 2 + step // 2  # 2, 2, 3, 3, 4, 4 blocks
        while len(engine.parts.blocks) < depth:
            assert engine.add_block(copy.deepcopy(ref[len(engine.parts.blocks)])) == depth - 1
        x, y = _data(step)
        _plain_step(ref, opts, list(range(depth)), x, y)
        engine.step((x, y))
    assert len(seq) == 4  # the model grew too: its state dict names every block
    assert_params_close(nn.Sequential(*ref), engine.state_dict())
    engine.close()


def test_bad_block_lists_and_shared_blocks_are_refused():
    seq = nn.Sequential(*_blocks(2, n=3))
    engine = L2L.from_sequential(seq, loss_fn=nn.MSELoss(), optimizer=ADAMW)
    x, y = _data(0)
    with pytest.raises(L2LInputError, match="indices"):
        engine.step((x, y), blocks=[0, 3])
    with pytest.raises(L2LInputError, match="repeats"):
        engine.step((x, y), blocks=[0, 1, 0])
    with pytest.raises(L2LInputError, match="shares"):
        engine.add_block(seq[0])
    engine.close()
