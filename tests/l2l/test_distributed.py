"""Data parallel L2L: 2 gloo ranks on their shards equal one process on the concatenated batch, with
stash="disk" in one shared store_dir, a rank whose shard has no target token, the disk tier, and ZeRO-1
whose checkpoint holds the whole optimizer state."""

from __future__ import annotations

import datetime
import functools
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ecru.l2l import L2L, L2LConfig
from ecru.models import tiny_llama

from .helpers import assert_params_close, lm_batch

SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
WORLD = 2


def _whole(step: int) -> dict:
    """The minibatch; rows 3-4 (rank 1's shard) carry no target token at step 0."""
    batch = lm_batch(seed=step)
    if step == 0:
        batch["labels"][3:] = -100
    return batch


def _shard(batch: dict, rank: int) -> dict:
    rows = slice(0, 3) if rank == 0 else slice(3, 5)  # uneven shards: the loss weighting must see it
    return {k: v[rows] for k, v in batch.items()}


def _seq_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _seq_batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(7, 6, generator=g), torch.randint(0, 3, (7,), generator=g)


def _seq_train(engine: L2L, rank: int, steps) -> None:
    for s in steps:
        x, y = _seq_batch(s)
        rows = slice(0, 4) if rank == 0 else slice(4, 7)  # 4 + 3 samples: uneven mean weights
        engine.step((x[rows], y[rows]))


def _rank(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        shared = {"store_dir": f"{out}.shared", "fsync": False}
        model = tiny_llama(num_layers=2, seed=rank)  # different inits: rank 0's weights are broadcast
        config = L2LConfig(micro_batch_size=2, stash="disk", **shared)
        engine = L2L.from_hf(model, optimizer=SGD, config=config)
        losses = [engine.step(_shard(_whole(s), rank)) for s in range(2)]
        result = {"hf": engine.state_dict(), "losses": losses}
        engine.close()
        for key, tier in (
            ("seq-disk", {"store": "disk", **shared}),
            ("seq-zero1", {"shard_optimizer": True}),
        ):
            engine = L2L.from_sequential(
                _seq_model(rank),
                loss_fn=nn.CrossEntropyLoss(),
                optimizer=SGD,
                config=L2LConfig(micro_batch_size=2, **tier),
            )
            _seq_train(engine, rank, range(2))
            result[key] = engine.state_dict()
            if key == "seq-zero1":  # momentum buffers only where this rank owns the block (round robin)
                result["owned"] = [bool(g.optimizer.state) for g in engine.store.groups if g.optimizer]
                engine.save(f"{out}.zero1.{rank}")  # a collective: the owners send their states
            engine.close()
        torch.save(result, f"{out}.{rank}")
        dist.barrier()  # both ranks tear gloo down together: none exits while its peer is still connected
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_one_process_on_the_concatenated_batch(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "result")
    mp.spawn(_rank, args=(str(tmp_path / "init"), out), nprocs=WORLD, join=True)
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(WORLD)]

    engine = L2L.from_hf(
        tiny_llama(num_layers=2, seed=0), optimizer=SGD, config=L2LConfig(micro_batch_size=2)
    )
    losses = [engine.step(_whole(s)) for s in range(2)]
    expected = engine.state_dict()
    engine.close()
    ref = _seq_model(0)
    opt = SGD(ref.parameters())
    states = []
    for s in range(3):
        x, y = _seq_batch(s)
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        states.append({k: v.clone() for k, v in ref.state_dict().items()})
    ref.load_state_dict(states[1])  # after the 2 steps the ranks ran
    for res in results:  # identical weights on every rank, equal to one process on the whole batch
        assert_params_close_dict(expected, res["hf"])
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), atol=1e-6, rtol=1e-6)
        assert_params_close(ref, res["seq-disk"])  # the disk tier: one store per rank, same weights
        assert_params_close(ref, res["seq-zero1"])  # ZeRO-1: sharded optimizer states, same weights
    # the Sequential's blocks with parameters: Linear (owner rank 0), Linear (rank 1); Tanh has none
    assert [res["owned"] for res in results] == [[True, False], [False, True]]
    # one shared store_dir: each rank works in its own subfolder, nothing else is created there
    shared = tmp_path / "result.shared"
    assert sorted(p.name for p in shared.iterdir()) == ["ecru-l2l"]
    assert sorted(p.name for p in (shared / "ecru-l2l").iterdir()) == ["rank0", "rank1"]
    assert not list(shared.glob("ecru-l2l/rank*/stash/*"))

    # each rank's ZeRO-1 checkpoint holds every block's momentum: one process resumes from it exactly
    for rank in range(WORLD):
        resumed = L2L.resume(
            f"{out}.zero1.{rank}",
            _seq_model(5),
            optimizer=SGD,
            config=L2LConfig(micro_batch_size=2),
            loss_fn=nn.CrossEntropyLoss(),
        )
        assert all(g.optimizer.state for g in resumed.store.groups if g.optimizer)
        resumed.step(_seq_batch(2))
        ref.load_state_dict(states[2])  # the 3rd step needs the momentum of both blocks
        assert_params_close(ref, resumed.state_dict())
        resumed.close()


def assert_params_close_dict(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
