"""AUC, group AUC and logloss against scikit-learn."""

import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from ecru.ctr import auc, group_auc, logloss


def test_auc_and_logloss_match_sklearn():
    gen = torch.Generator().manual_seed(0)
    y = (torch.rand(500, generator=gen) < 0.3).float()
    p = (torch.rand(500, generator=gen) * 0.5 + 0.4 * y).clamp(0.01, 0.99)
    p[:50] = 0.5  # ties count one half
    assert auc(y, p) == pytest.approx(roc_auc_score(y, p), abs=1e-12)
    assert logloss(y, p) == pytest.approx(log_loss(y, p), abs=1e-9)


def test_group_auc_weights_groups_by_rows_and_skips_one_class_groups():
    gen = torch.Generator().manual_seed(1)
    groups = torch.randint(0, 7, (400,), generator=gen)
    y = (torch.rand(400, generator=gen) < 0.4).float()
    y[groups == 6] = 1.0  # one class: left out
    p = torch.rand(400, generator=gen) + 0.3 * y * (groups % 3)
    total = weight = 0.0
    for g in range(7):
        m = groups == g
        if 0 < y[m].sum() < m.sum():
            total += int(m.sum()) * roc_auc_score(y[m], p[m])
            weight += int(m.sum())
    assert group_auc(y, p, groups) == pytest.approx(total / weight, abs=1e-12)
    with pytest.raises(ValueError, match="both"):
        group_auc(torch.ones(4), torch.rand(4), torch.arange(4))
