"""Recipes against the spec's table (the CowClip paper's settings)."""

import math
from dataclasses import replace

import pytest

from ecru.cowclip import cowclip_recipe, scaled_recipe


@pytest.mark.parametrize(
    "batch,dense_lr,l2", [(1024, 8e-4, 1e-5), (8192, 8e-4 * math.sqrt(8), 8e-5), (131072, 90.5e-4, 128e-5)]
)
def test_criteo_table(batch, dense_lr, l2):
    r = cowclip_recipe(batch)
    assert r.embed_lr == 1e-4 and r.r == 1.0 and r.zeta == 1e-5 and r.clip and r.threshold == "code"
    assert r.dense_lr == pytest.approx(dense_lr, rel=1e-3)
    assert r.l2 == pytest.approx(l2) and r.weight_decay == pytest.approx(2 * l2)
    assert r.warmup_epochs == 1.0 and r.eps == 1e-7


@pytest.mark.parametrize(
    "batch,dense_lr,l2,zeta",
    [
        (1024, 1e-4, 1e-5, 1e-3),
        (2048, 1e-4 * math.sqrt(2), 2e-5, 1e-3),
        (4096, 2e-4, 4e-5, 1e-4),
        (65536, 8e-4, 64e-5, 1e-4),
        (131072, 16e-4, 96e-5, 1e-4),
    ],
)
def test_avazu_table(batch, dense_lr, l2, zeta):
    r = cowclip_recipe(batch, dataset="avazu")
    assert r.embed_lr == 1e-4 and r.zeta == zeta
    assert r.dense_lr == pytest.approx(dense_lr) and r.l2 == pytest.approx(l2)


def test_baseline_recipes():
    s = 32
    adam, sq, lin, tempered = (
        scaled_recipe(n, 1024 * s) for n in ("adam", "adam-sqrt", "linear", "tempered")
    )
    assert (adam.embed_lr, adam.dense_lr, adam.l2, adam.clip) == (1e-4, 8e-4, 1e-5, False)
    assert (sq.embed_lr, sq.clip) == (1e-4, False) and sq.dense_lr == pytest.approx(8e-4 * math.sqrt(s))
    assert lin.embed_lr == pytest.approx(1e-4 * s) and lin.dense_lr == pytest.approx(8e-4 * s)
    assert (
        tempered.l2 == pytest.approx(1e-5 * math.sqrt(s))
        and not tempered.clip
        and tempered.warmup_epochs == pytest.approx(1 / s)
    )
    assert tempered.embed_lr == pytest.approx(1e-4 * s) and tempered.dense_lr == pytest.approx(8e-4 * s**0.75)
    assert scaled_recipe("ecru", 1024 * s) == tempered  # the former name still selects it
    base = scaled_recipe("adam", 1024)
    assert all(scaled_recipe(n, 1024) == replace(base, name=n) for n in ("adam-sqrt", "linear", "tempered"))
    assert scaled_recipe("cowclip", 2048) == cowclip_recipe(2048)


def test_bad_arguments():
    with pytest.raises(ValueError, match="dataset"):
        cowclip_recipe(1024, dataset="mnist")
    with pytest.raises(ValueError, match="positive"):
        cowclip_recipe(0)
    with pytest.raises(ValueError, match="unknown recipe"):
        scaled_recipe("sgd", 1024)
