"""The synthetic generator: oracle AUC and logloss against Monte-Carlo estimates, shapes, metrics."""

import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from ecru.ctr import SyntheticConfig, auc, expected_oracle, generate, logloss
from ecru.ctr.synthetic import CRITEO_CARDINALITIES, zipf_ids


def test_oracle_auc_and_logloss_match_monte_carlo():
    data = generate(SyntheticConfig(n_rows=4000, scale=1e-3, seed=5))
    prob = data.info["prob"]
    exp_auc, exp_ll = expected_oracle(prob)
    gen = torch.Generator().manual_seed(0)
    draws = [torch.bernoulli(prob, generator=gen) for _ in range(400)]
    aucs = torch.tensor([auc(y, prob) for y in draws])
    lls = torch.tensor([logloss(y, prob) for y in draws])
    # Monte-Carlo standard errors ~ std / sqrt(400); allow 4 of them (plus the O(1/n) ratio-of-means bias)
    assert abs(aucs.mean() - exp_auc) < 4 * aucs.std() / 20 + 1e-4
    assert abs(lls.mean() - exp_ll) < 4 * lls.std() / 20
    assert 0.7 < exp_auc < 0.9


def test_shape_label_rate_and_zipf():
    cfg = SyntheticConfig(n_rows=20000, scale=1e-3, seed=1)
    data = generate(cfg)
    assert data.cats.shape == (20000, 26) and data.dense.shape == (20000, 13)
    assert data.cardinalities == tuple(max(2, round(c * 1e-3)) for c in CRITEO_CARDINALITIES)
    assert (data.cats < torch.tensor(data.cardinalities)).all() and (data.cats >= 0).all()
    assert abs(data.info["prob"].mean() - 0.25) < 1e-3 and abs(data.labels.mean() - 0.25) < 0.015
    ids = zipf_ids(200000, 1000, 1.1, torch.Generator().manual_seed(0))
    freq = torch.bincount(ids, minlength=1000).double()
    torch.testing.assert_close(
        freq[0] / freq[9], torch.tensor(10.0**1.1, dtype=torch.float64), rtol=0.1, atol=0
    )
    assert torch.equal(generate(cfg).labels, data.labels)  # seeded


def test_metrics_match_sklearn():
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (3000,), generator=gen).float()
    s = (torch.rand(3000, generator=gen) * 20).round() / 20  # many ties
    assert abs(auc(y, s) - roc_auc_score(y.numpy(), s.numpy())) < 1e-12
    p = torch.rand(3000, generator=gen).clamp(0.01, 0.99)
    assert abs(logloss(y, p) - log_loss(y.numpy(), p.double().numpy())) < 1e-9


def test_fewer_fields_take_criteos_first_cardinalities():
    data = generate(SyntheticConfig(n_rows=500, scale=1e-3, seed=2, fields=10))
    assert data.cats.shape == (500, 10)
    assert data.cardinalities == tuple(max(2, round(c * 1e-3)) for c in CRITEO_CARDINALITIES[:10])
    with pytest.raises(ValueError, match="fields"):
        SyntheticConfig(fields=27)
