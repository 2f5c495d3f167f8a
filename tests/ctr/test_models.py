"""CTR models: defaults, shapes, and the interaction terms against plain formulas."""

import pytest
import torch
from torch import nn
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


def test_sequence_fields_pool_the_present_ids_like_embedding_bag():
    torch.manual_seed(0)
    cfg = CTRConfig((5, 9, 4, 6), n_dense=0, mlp=(8,), sequence_fields=2, sequence_length=3)
    model = DeepFM(cfg)
    # columns: field 0, field 1, field 2 (3 slots), field 3 (3 slots); -1 = padding, repeats allowed
    cats = torch.tensor([[1, 2, 0, 3, -1, 5, 5, -1], [4, 8, -1, -1, -1, 0, 1, 2]])
    emb, first = model.tables(torch.zeros(2, 0), cats)
    assert emb.shape == (2, 4, 10)
    weight = model.tables.embedding.weight.detach()
    bag = nn.EmbeddingBag.from_pretrained(weight, mode="mean")
    offsets = {2: 5 + 9, 3: 5 + 9 + 4}
    for b, row in enumerate(cats.tolist()):
        for f, cols in ((2, row[2:5]), (3, row[5:8])):
            present = [offsets[f] + i for i in cols if i >= 0]
            want = bag(torch.tensor(present), torch.tensor([0]))[0] if present else torch.zeros(10)
            assert_close(emb[b, f], want)
        assert_close(emb[b, :2], weight[[row[0], 5 + row[1]]])
    assert torch.equal(first, torch.zeros(2))  # the first-order table starts at zero
    model(torch.zeros(2, 0), cats).sum().backward()
    pad = model.tables.pad
    assert model.tables.embedding.weight.grad[pad].abs().sum() == 0  # padding is no parameter
    ids = model.tables.global_ids(cats)
    assert ids[0, 4] == -1 and ids[1, 5] == 5 + 9 + 4  # padding stays -1 for CowClip's counts


@pytest.mark.parametrize("mode", ["full", "sparse"])
def test_training_with_a_multi_hot_field_learns(mode):
    from ecru.ctr import CTRData, TrainConfig, train

    gen = torch.Generator().manual_seed(0)
    n, length = 6000, 4
    single = torch.randint(0, 5, (n, 2), generator=gen)
    seq = torch.randint(0, 20, (n, length), generator=gen)
    seq[torch.rand(n, length, generator=gen) < 0.3] = -1
    clicked = ((seq == 3) | (seq == 7)).any(1).float()  # the label is whether 3 or 7 is in the sequence
    labels = torch.where(torch.rand(n, generator=gen) < 0.9, clicked, 1 - clicked)
    data = CTRData(torch.zeros(n, 0), torch.cat([single, seq], 1).int(), labels, (5, 5, 20), {}, 1, length)
    tr, te = data.split_random(0.2, seed=0)
    cfg = TrainConfig(
        batch_size=128, epochs=3, mode=mode, recipe="tempered", base_batch=16, mlp=(16,), progress=False
    )
    res = train(cfg, tr, te)
    assert res.auc > 0.8  # the Bayes rate is 0.9 accuracy; a model blind to the sequence scores 0.5


def test_dense_lookup_matches_nn_embedding_values_and_gradient():
    """The non-sparse lookup (index_select, for its faster backward) equals nn.Embedding's forward and
    gradient, repeated ids included."""
    torch.manual_seed(0)
    model = build_model("deepfm", CTRConfig(CARDS, n_dense=0, mlp=(4,)))
    table = model.tables.embedding
    cats = torch.tensor([[0, 8, 2], [0, 8, 1], [4, 0, 1]])
    ids = model.tables.global_ids(cats)
    out = model.tables._lookup(table, ids)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    ref_table = nn.Embedding.from_pretrained(table.weight.detach().clone(), freeze=False)
    ref = ref_table(ids)
    (ref * weights).sum().backward()
    assert_close(out, ref, rtol=0, atol=0)
    assert_close(table.weight.grad, ref_table.weight.grad, rtol=1e-6, atol=1e-7)
