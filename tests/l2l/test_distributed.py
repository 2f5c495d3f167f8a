"""Data parallel L2L: 2 gloo ranks on their shards equal one process on the concatenated batch."""

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


def _shard(batch: dict, rank: int) -> dict:
    # uneven shards: rank 0 gets 3 rows, rank 1 gets 2 with fewer targets (the loss weighting must see it)
    rows = slice(0, 3) if rank == 0 else slice(3, 5)
    return {k: v[rows] for k, v in batch.items()}


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
        model = tiny_llama(num_layers=2, seed=rank)  # different inits: rank 0's weights are broadcast
        engine = L2L.from_hf(model, optimizer=SGD, config=L2LConfig(micro_batch_size=2))
        losses = [engine.step(_shard(lm_batch(seed=s), rank)) for s in range(2)]
        result = {"hf": engine.state_dict(), "losses": losses}
        engine.close()
        tiers = (
            ("seq", {}),
            ("seq-disk", {"store": "disk", "store_dir": f"{out}.store", "fsync": False}),
            ("seq-zero1", {"shard_optimizer": True}),
        )
        for key, tier in tiers:
            torch.manual_seed(rank)
            model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
            engine = L2L.from_sequential(
                model,
                loss_fn=nn.CrossEntropyLoss(),
                optimizer=SGD,
                config=L2LConfig(micro_batch_size=2, **tier),
            )
            for s in range(2):
                x, y = _seq_batch(s)
                rows = slice(0, 4) if rank == 0 else slice(4, 7)  # 4 + 3 samples: uneven mean weights
                engine.step((x[rows], y[rows]))
            result[key] = engine.state_dict()
            if key == "seq-zero1":  # momentum buffers only where this rank owns the block (round robin)
                result["owned"] = [
                    bool(g.optimizer.state) for g in engine.store.groups if g.optimizer is not None
                ]
            engine.close()
        torch.save(result, f"{out}.{rank}")
        dist.barrier()  # both ranks tear gloo down together: none exits while its peer is still connected
    finally:
        dist.destroy_process_group()


def _seq_batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(7, 6, generator=g), torch.randint(0, 3, (7,), generator=g)


def test_two_gloo_ranks_equal_one_process_on_the_concatenated_batch(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "result")
    mp.spawn(_rank, args=(str(tmp_path / "init"), out), nprocs=WORLD, join=True)
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(WORLD)]

    engine = L2L.from_hf(
        tiny_llama(num_layers=2, seed=0), optimizer=SGD, config=L2LConfig(micro_batch_size=2)
    )
    losses = [engine.step(lm_batch(seed=s)) for s in range(2)]
    expected = engine.state_dict()
    engine.close()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = SGD(ref.parameters())
    for s in range(2):
        x, y = _seq_batch(s)
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for res in results:  # identical weights on every rank, equal to one process on the whole batch
        assert_params_close_dict(expected, res["hf"])
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), atol=1e-6, rtol=1e-6)
        assert_params_close(ref, res["seq"])
        assert_params_close(ref, res["seq-disk"])  # the disk tier: one store per rank, same weights
        assert_params_close(ref, res["seq-zero1"])  # ZeRO-1: sharded optimizer states, same weights
    # the Sequential's blocks with parameters: Linear (owner rank 0), Linear (rank 1); Tanh has none
    assert [res["owned"] for res in results] == [[True, False], [False, True]]
    assert sorted(p.name for p in tmp_path.glob("result.store/ecru-l2l/rank*")) == ["rank0", "rank1"]


def assert_params_close_dict(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
