"""CTR models: defaults, shapes, and the interaction terms against plain formulas."""

import pytest
import torch
from torch.testing import assert_close

from ecru.ctr import DCN, MODELS, CTRConfig, DCNv2, DeepFM, WideDeep, build_model
from ecru.ctr.models import fm_logit

CARDS = (5, 9, 3)


def test_defaults_are_the_papers():
    cfg = CTRConfig(CARDS)
    assert (cfg.embed_dim, cfg.mlp, cfg.cross_layers, cfg.init_std, cfg.n_dense) == (
        10,
        (400, 400, 400),
        3,
        0.01,
        13,
    )
    m = DCN(cfg)
    assert len(m.cross) == 3 and m.tables.embedding.weight.shape == (17, 10)
    assert m.tables.linear.weight.abs().sum() == 0
    assert abs(m.tables.embedding.weight.std().item() - 0.01) < 0.005


@pytest.mark.parametrize("name", MODELS)
def test_forward_backward_shapes(name):
    torch.manual_seed(0)
    model = build_model(name, CTRConfig(CARDS, n_dense=2, mlp=(8, 4)))
    cats = torch.tensor([[0, 8, 2], [4, 0, 1]])
    out = model(torch.randn(2, 2), cats)
    assert out.shape == (2,)
    out.sum().backward()
    emb, lin = model.embedding_tables()
    assert emb.grad.shape == (17, 10) and lin.grad.shape == (17, 1)
    assert {id(p) for p in model.dense_parameters()}.isdisjoint({id(emb), id(lin)})
    assert len(model.dense_parameters()) + 2 == len(list(model.parameters()))


def test_fm_term_is_sum_over_field_pairs():
    emb = torch.randn(4, 5, 3, dtype=torch.float64)
    ref = sum((emb[:, f] * emb[:, g]).sum(-1) for f in range(5) for g in range(f + 1, 5))
    torch.testing.assert_close(fm_logit(emb), ref, rtol=1e-12, atol=1e-12)


def test_deepfm_is_wide_deep_plus_fm():
    torch.manual_seed(0)
    cfg = CTRConfig(CARDS, n_dense=2, mlp=(8,))
    deepfm, wdl = DeepFM(cfg), WideDeep(cfg)
    wdl.load_state_dict(deepfm.state_dict())
    dense, cats = torch.randn(3, 2), torch.tensor([[0, 1, 2], [1, 2, 0], [4, 8, 2]])
    emb = deepfm.tables.embedding(deepfm.tables.global_ids(cats))
    torch.testing.assert_close(deepfm(dense, cats), wdl(dense, cats) + fm_logit(emb))


def test_cross_layers_follow_the_papers():
    torch.manual_seed(0)
    cfg = CTRConfig(CARDS, n_dense=2, mlp=(4,), cross_layers=2, embed_dim=2)
    for cls, full in ((DCN, False), (DCNv2, True)):
        model = cls(cfg)
        x0 = torch.randn(3, model.n_in)
        x = x0
        for layer in model.cross:
            w, b = layer.proj.weight, (layer.proj.bias if full else layer.bias)
            x = x0 * (x @ w.T + b) + x if full else x0 * (x @ w.T) + b + x
        torch.testing.assert_close(model.cross[1](x0, model.cross[0](x0, x0)), x)


def test_bad_config():
    with pytest.raises(ValueError, match="cardinalities"):
        CTRConfig(())
    with pytest.raises(ValueError, match="unknown model"):
        build_model("xgboost", CTRConfig(CARDS))


@pytest.mark.parametrize("name", MODELS)
def test_base_rate_start(name):
    torch.manual_seed(0)
    cfg = CTRConfig((7, 5, 9), n_dense=3, embed_dim=4, mlp=(8,), base_rate=0.25)
    model = build_model(name, cfg)
    dense, cats = torch.randn(64, 3) * 3, torch.randint(0, 5, (64, 3))
    probs = torch.sigmoid(model(dense, cats))
    assert_close(probs, torch.full_like(probs, 0.25), atol=1e-3, rtol=0)  # only the tiny FM term remains
    default = build_model(name, CTRConfig((7, 5, 9), n_dense=3, embed_dim=4, mlp=(8,)))
    assert (torch.sigmoid(default(dense, cats)) - 0.25).abs().max() > 1e-2  # PyTorch's init does not
    with pytest.raises(ValueError, match="base_rate"):
        CTRConfig((3,), base_rate=1.0)
