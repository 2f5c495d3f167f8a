"""Training: learning happens, resume equals an uninterrupted run, 2 DDP ranks (gloo) equal 1 rank."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ecru.cowclip import Recipe
from ecru.ctr import SyntheticConfig, TrainConfig, generate, train
from ecru.errors import EcruError
from ecru.io import load_state

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
    untimed = [[{k: v for k, v in h.items() if k != "wall_s"} for h in r.history] for r in (resumed, full)]
    assert untimed[0] == untimed[1]
    assert resumed.steps == full.steps  # the totals cover the whole run, not only the resumed epoch
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


# how each recipe scales the embedding LR with s = batch / base batch (recipes.scaled_recipe's definitions)
EMBED_LR_FACTOR = {"adam": lambda s: 1.0, "adam-sqrt": lambda s: 1.0, "cowclip": lambda s: 1.0,
                   "linear": lambda s: s, "tempered": lambda s: s, "ecru": lambda s: s}  # fmt: skip


@pytest.mark.parametrize("dataset", ["criteo", "avazu"])
def test_embed_lr_rescales_every_recipe_at_the_base_batch(dataset):
    from dataclasses import replace

    from ecru.cowclip import RECIPES, scaled_recipe
    from ecru.ctr.training import resolve_recipe

    assert set(RECIPES) <= set(EMBED_LR_FACTOR)
    for name in EMBED_LR_FACTOR:
        for base, batch in ((1024, 1024), (1024, 8192), (1024, 131072), (128, 4096), (512, 256)):
            cfg = dict(batch_size=batch, base_batch=base, recipe=name, dataset=dataset)
            table = scaled_recipe(name, batch, base_batch=base, dataset=dataset)
            mine = resolve_recipe(TrainConfig(**cfg, embed_lr=3e-3))
            want = 3e-3 * EMBED_LR_FACTOR[name](batch / base)
            assert mine.embed_lr == pytest.approx(want, rel=1e-12), (name, base, batch)
            assert mine == replace(table, embed_lr=mine.embed_lr)  # only the embedding LR moves
            assert resolve_recipe(TrainConfig(**cfg)) == table  # no embed_lr: the table's
    assert resolve_recipe(TrainConfig(embed_lr=1e-3)).embed_lr == pytest.approx(1e-3)
    with pytest.raises(EcruError, match="embed_lr"):
        TrainConfig(embed_lr=0.0)


def test_early_stopping_stops_on_the_validation_auc_and_keeps_the_best_epoch(monkeypatch, tmp_path):
    import ecru.ctr.training as training

    tr, te = data(n=3000)
    tr, val = tr.split_random(0.2, seed=1)
    scripted = iter([0.60, 0.70, 0.65, 0.64, 0.9])  # the best is epoch 2; patience 2 stops after epoch 4
    snapshots = []

    def fake_metrics(cfg, model, epoch, test_data, val_data):
        assert val_data is val
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
        return {"epoch": epoch + 1, "auc": 0.5 + epoch / 100, "logloss": 0.4, "val_auc": next(scripted)}

    monkeypatch.setattr(training, "_epoch_metrics", fake_metrics)
    cfg = TrainConfig(batch_size=128, epochs=10, patience=2, checkpoint=str(tmp_path / "c.pt"), **SMALL)
    res = train(cfg, tr, te, val_data=val)
    assert [h["epoch"] for h in res.history] == [1, 2, 3, 4] and res.epochs == 4
    assert res.auc == pytest.approx(0.51)  # the test AUC of epoch 2, not of the last epoch
    for k, v in res.model.state_dict().items():
        assert torch.equal(v, snapshots[1][k])
    assert not all(torch.equal(v, snapshots[3][k]) for k, v in res.model.state_dict().items())
    assert load_state(tmp_path / "c.pt")["best_model"].keys() == snapshots[1].keys()
    again = train(dataclasses.replace(cfg, resume=True), tr, te, val_data=val)
    assert again.epochs == 4 and len(snapshots) == 4  # a finished, early-stopped run trains no more epochs
    with pytest.raises(EcruError, match="validation rows"):
        train(TrainConfig(batch_size=128, patience=1, **SMALL), tr, te)
    with pytest.raises(EcruError, match="patience"):
        TrainConfig(patience=0)
