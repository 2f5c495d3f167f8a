import math

import pytest
import torch

from ecru.errors import EcruError
from ecru.lifelong import cl_metrics

# rows: after task 1, 2, 3; columns: task 1, 2, 3
R = [[80.0, 50.0, 40.0],
     [70.0, 90.0, 45.0],
     [60.0, 85.0, 95.0]]  # fmt: skip
R0 = [55.0, 48.0, 42.0]


def test_hand_computed_3x3():
    m = cl_metrics(R, R0)
    assert m["last"] == pytest.approx((60 + 85 + 95) / 3, abs=1e-12)
    assert m["avg"] == pytest.approx((80 + 50 + 40 + 70 + 90 + 45 + 60 + 85 + 95) / 9, abs=1e-12)
    # task 2 before learning: row 1 -> 50; task 3: rows 1, 2 -> (40 + 45) / 2
    assert m["transfer"] == pytest.approx((50 + (40 + 45) / 2) / 2, abs=1e-12)
    assert m["bwt"] == pytest.approx(((60 - 80) + (85 - 90)) / 2, abs=1e-12)
    assert m["fwt"] == pytest.approx(((50 - 48) + (45 - 42)) / 2, abs=1e-12)
    assert m["transfer_retention"] == pytest.approx(m["transfer"] - (48 + 42) / 2, abs=1e-12)


def test_units_follow_R_and_no_R0_keys():
    pct, frac = cl_metrics(R), cl_metrics(torch.tensor(R, dtype=torch.float64) / 100)
    assert set(pct) == {"last", "avg", "transfer", "bwt"}
    for k in pct:
        assert frac[k] == pytest.approx(pct[k] / 100, abs=1e-12)


def test_single_task_has_undefined_transfer():
    m = cl_metrics([[70.0]], [60.0])
    assert m["last"] == m["avg"] == 70.0
    assert all(math.isnan(m[k]) for k in ("transfer", "bwt", "fwt", "transfer_retention"))


@pytest.mark.parametrize("bad", [[[1.0, 2.0]], [1.0, 2.0], [[1.0, float("nan")], [1.0, 1.0]], [[]]])
def test_bad_matrix_raises(bad):
    with pytest.raises(EcruError, match="R"):
        cl_metrics(bad)


def test_bad_R0_raises():
    with pytest.raises(EcruError, match="R0"):
        cl_metrics(R, [1.0, 2.0])
