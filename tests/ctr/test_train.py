"""Training: learning happens, resume equals an uninterrupted run, 2 DDP ranks (gloo) equal 1 rank."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ecru.cowclip import Recipe
from ecru.ctr import SyntheticConfig, TrainConfig, generate, train
from ecru.errors import EcruError

SMALL = dict(mlp=(16, 16), embed_dim=4, progress=False, base_batch=128)


def data(n=6000, seed=0):
    return generate(SyntheticConfig(n_rows=n, scale=1e-3, seed=seed)).split_random(0.25, seed=0)


def test_training_learns_and_reports():
    tr, te = data()
    recipe = Recipe("cowclip", 128, embed_lr=3e-3, dense_lr=3e-3, l2=1e-5, clip=True)
    res = train(TrainConfig(batch_size=128, epochs=2, **SMALL), tr, te, recipe=recipe)
    assert res.steps == 2 * (len(tr) // 128) and len(res.history) == 2
    assert res.auc > 0.6 and res.losses[-1] < res.losses[0]
    assert res.clip.rows > 0 and 0 <= res.clip.clipped_fraction <= 1 and res.samples_per_s > 0


@pytest.mark.parametrize("mode", ["full", "sparse"])
def test_resume_equals_uninterrupted(tmp_path, mode):
    tr, te = data(3000)
    cfg = dict(batch_size=256, recipe="cowclip", mode=mode, **SMALL)
    full = train(TrainConfig(epochs=2, **cfg), tr, te)
    ckpt = str(tmp_path / "run.pt")
    train(TrainConfig(epochs=1, checkpoint=ckpt, **cfg), tr, te)
    resumed = train(TrainConfig(epochs=2, checkpoint=ckpt, resume=True, **cfg), tr, te)
    assert resumed.history == full.history
    with pytest.raises(EcruError, match="batch_size"):
        train(TrainConfig(epochs=3, checkpoint=ckpt, resume=True, **{**cfg, "batch_size": 128}), tr, te)


def _ddp_worker(rank: int, world: int, init: str, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    tr, te = data(2000)
    res = train(TrainConfig(batch_size=200, recipe="cowclip", mode=mode, **SMALL), tr, te)
    if rank == 0:
        torch.save({"auc": res.auc, "losses": res.losses}, out)
    dist.barrier()  # both ranks tear gloo down together: none exits while its peer is still connected
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["full", "sparse"])
def test_two_ranks_equal_one_rank(tmp_path, mode):
    out = str(tmp_path / "ddp.pt")
    init = f"file://{tmp_path / 'rendezvous'}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_ddp_worker, args=(2, init, mode, out), nprocs=2, join=True)
    ddp = torch.load(out)
    tr, te = data(2000)
    single = train(TrainConfig(batch_size=200, recipe="cowclip", mode=mode, **SMALL), tr, te)
    assert len(ddp["losses"]) == len(single.losses) == 7
    # same trajectory up to the float32 reduction order of the all-reduce
    torch.testing.assert_close(torch.tensor(ddp["losses"]), torch.tensor(single.losses), rtol=1e-5, atol=1e-6)
    assert abs(ddp["auc"] - single.auc) < 1e-4
