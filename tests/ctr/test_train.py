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
    assert resumed.clip == full.clip and resumed.clip.rows > 0  # so do the clip's statistics (they restarted)
    untimed = [[{k: v for k, v in p.items() if k != "train_s"} for p in r.curve] for r in (resumed, full)]
    assert untimed[0] == untimed[1] and len(untimed[0]) == 2  # the AUC curve too (it lost its first epoch)
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


def _plain_loop(cfg: TrainConfig, tr, recipe) -> torch.nn.Module:
    """The faithful mode written out in plain PyTorch: per-tensor (foreach-free) Adams, L2 added to the table
    gradients as Adam's weight_decay adds it, the clip by the pure `cowclip` function, the dense warm-up."""
    import torch.nn.functional as F

    from ecru.cowclip import cowclip
    from ecru.ctr.training import make_model

    model = make_model(cfg, tr)  # the same seed: the same initial weights as train's
    emb, lin = model.embedding_tables()
    adam = dict(eps=recipe.eps, foreach=False)
    embed_opt = torch.optim.Adam([emb, lin], lr=recipe.embed_lr, **adam)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=recipe.dense_lr, **adam)
    warmup = max(1.0, recipe.warmup_epochs * (len(tr) // cfg.batch_size))
    sched = torch.optim.lr_scheduler.LambdaLR(dense_opt, lambda step: min(1.0, (step + 1) / warmup))
    for dense, cats, labels in tr.batches(cfg.batch_size, seed=cfg.seed * 1000, drop_last=True):
        model.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(model(dense, cats), labels).backward()
        with torch.no_grad():
            emb.grad = emb.grad + recipe.weight_decay * emb
            lin.grad = lin.grad + recipe.weight_decay * lin
            if recipe.clip:
                emb.grad = cowclip(emb.grad, emb, model.tables.global_ids(cats), r=recipe.r, zeta=recipe.zeta)
        embed_opt.step(), dense_opt.step(), sched.step()
    return model


@pytest.mark.parametrize("recipe", ["adam", "cowclip"])
def test_faithful_training_equals_a_plain_pytorch_loop(recipe):
    """`train` (fused Adams, L2 added in place) follows the plain loop: every parameter after an epoch."""
    from ecru.ctr.training import resolve_recipe

    tr, te = data(3000)
    cfg = TrainConfig(batch_size=128, recipe=recipe, embed_lr=1e-2, **SMALL)
    rec = resolve_recipe(cfg)
    assert rec.weight_decay > 0 and rec.clip == (recipe == "cowclip")
    mine = train(cfg, tr, te).model.state_dict()
    ref = _plain_loop(cfg, tr, rec).state_dict()
    assert mine.keys() == ref.keys()
    # float32: fused and per-tensor Adam round differently, and Adam's normalisation magnifies that where
    # a row's gradient is near eps (measured 2.8e-6 on 4 of 135,140 weights); atol = 1e-3 of one step (lr)
    for k in mine:
        torch.testing.assert_close(mine[k], ref[k], rtol=1e-4, atol=1e-3 * rec.embed_lr, msg=k)
    no_l2 = _plain_loop(cfg, tr, dataclasses.replace(rec, l2=0.0)).state_dict()
    assert not torch.allclose(mine["tables.embedding.weight"], no_l2["tables.embedding.weight"], atol=1e-4)


def test_curve_points_and_stopping_at_a_target_auc():
    tr, te = data(3000)
    cfg = TrainConfig(batch_size=128, epochs=2, eval_every=5, **SMALL)
    res = train(cfg, tr, te)
    per_epoch = len(tr) // 128  # 17: points every 5 steps and at each epoch's end
    assert [p["step"] for p in res.curve] == [5, 10, 15, 17, 20, 25, 30, 34] and per_epoch == 17
    assert res.curve[3]["auc"] == res.history[0]["auc"] and res.curve[-1]["auc"] == res.auc
    seconds = [p["train_s"] for p in res.curve]
    assert seconds == sorted(seconds) and seconds[-1] == pytest.approx(res.wall_s)
    assert train(dataclasses.replace(cfg, eval_every=0), tr, te).auc == res.auc  # evaluating changes nothing
    target = res.curve[5]["auc"] - 1e-9
    first = next(p for p in res.curve if p["auc"] >= target)
    stopped = train(dataclasses.replace(cfg, target_auc=target), tr, te)
    assert stopped.steps == first["step"] and stopped.curve[-1]["auc"] == first["auc"]
    assert sum(h["steps"] for h in stopped.history) == first["step"]  # stopped in the middle of an epoch
    for bad in (dict(eval_every=-1), dict(target_auc=1.5)):
        with pytest.raises(EcruError):
            TrainConfig(**bad)


def _multi_hot_data(n=1200):
    """Two single-hot fields and a multi-hot one (4 columns, 30% padding, ids repeated inside a sample)."""
    from ecru.ctr import CTRData

    gen = torch.Generator().manual_seed(0)
    single = torch.randint(0, 7, (n, 2), generator=gen)
    seq = torch.randint(0, 12, (n, 4), generator=gen)
    seq[torch.rand(n, 4, generator=gen) < 0.3] = -1
    labels = (torch.rand(n, generator=gen) < 0.3).float()
    return CTRData(
        torch.randn(n, 3, generator=gen), torch.cat([single, seq], 1).int(), labels, (7, 9, 12), {}, 1, 4
    )


def _per_site_clip(table, ids, recipe, weight_decay: float, mode: str) -> torch.Tensor:
    """CowClip's L2 and clip of one table as the step did them before the shared sort: a `torch.unique` of its
    own ids, the sparse gradient merged by a `torch.unique` of its rows and an index_add_ (the same summation
    order), sample counts by comparing every sample with every row, the pure `clip_scale`."""
    from ecru.cowclip.clip import clip_scale

    if mode == "full":
        grad = table.grad.add_(table, alpha=weight_decay)
        rows = torch.unique(ids[ids >= 0])
        values = grad[rows]
    else:
        grad = table.grad
        rows, inverse = torch.unique(grad._indices()[0], return_inverse=True)
        summed = grad._values().new_zeros(rows.numel(), grad.shape[1]).index_add_(0, inverse, grad._values())
        values = summed.add(table[rows], alpha=weight_decay)
    if recipe.clip and table.shape[1] > 1:
        counts = (ids[:, :, None] == rows).any(1).sum(0)  # samples containing each row
        values = values * clip_scale(values, table[rows], counts, r=recipe.r, zeta=recipe.zeta)[0][:, None]
    if mode == "full":
        grad[rows] = values
        return grad
    return torch.sparse_coo_tensor(rows[None], values, grad.shape, is_coalesced=True, check_invariants=True)


def _per_site_step(model, batch, opts, recipe, mode: str, loss_scale: float) -> None:
    """The training step with every consumer sorting the batch's ids itself (the optimizer's catch-up from
    the raw ids, `_per_site_clip`), against which the shared sort of `training._step` is checked."""
    import torch.nn.functional as F

    dense, cats, labels = batch
    embed_opt, dense_opt, sched = opts
    if mode == "sparse":
        embed_opt.catch_up(model.tables.global_ids(cats))
    loss = F.binary_cross_entropy_with_logits(model(dense, cats), labels)
    embed_opt.zero_grad(set_to_none=True), dense_opt.zero_grad(set_to_none=True)
    (loss * loss_scale).backward()
    ids = model.tables.global_ids(cats)
    with torch.no_grad():
        for table in model.embedding_tables():
            table.grad = _per_site_clip(table, ids, recipe, recipe.weight_decay * loss_scale, mode)
    embed_opt.step(), dense_opt.step(), sched.step()


@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("mode", ["full", "sparse"])
def test_the_shared_sort_step_equals_the_per_site_step(mode, multi_hot):
    """`training._step` sorts the batch's ids once (`UniqueIds`) for the catch-up, the coalesce and the counts;
    after 8 steps every parameter and every optimizer state equals the per-site step's, bit for bit. A summed
    loss and a small r make the clip fire on part of the rows, so the counts decide the result."""
    from ecru.ctr.training import _step, make_model, make_optimizers, resolve_recipe

    tr = _multi_hot_data() if multi_hot else data(1200)[0]
    cfg = TrainConfig(batch_size=128, recipe="cowclip", mode=mode, embed_lr=1e-2, **SMALL)
    recipe, loss_scale = dataclasses.replace(resolve_recipe(cfg), r=0.05), 128.0
    batches = list(tr.batches(cfg.batch_size, seed=0, drop_last=True))[:8]
    results = []
    for shared in (True, False):
        model = make_model(cfg, tr)
        embed_opt, dense_opt, sched, clipper = make_optimizers(
            model, recipe, mode=mode, steps_per_epoch=len(batches), loss_scale=loss_scale
        )
        for batch in batches:
            if shared:
                _step(model, model, batch, slice(None), (embed_opt, dense_opt, sched), clipper, loss_scale)
            else:
                _per_site_step(model, batch, (embed_opt, dense_opt, sched), recipe, mode, loss_scale)
        if shared:
            assert 0 < clipper.stats().clipped < clipper.stats().rows
        states = [opt.state_dict()["state"] for opt in (embed_opt, dense_opt)]
        results.append(
            {**model.state_dict(), **{f"{i}.{k}": s for i, st in enumerate(states) for k, s in st.items()}}
        )
    assert results[0].keys() == results[1].keys()
    for k, v in results[0].items():
        torch.testing.assert_close(v, results[1][k], atol=0, rtol=0, msg=k)
