"""The benchmark's repetition plan and its summary: rotated orders, medians, paired ratios to fcfs."""

import pytest

from ecru.errors import EcruError
from ecru.serve.bench import BenchConfig, rotated_orders, summarize_runs


def test_each_repetition_starts_one_policy_later():
    orders = rotated_orders(("fcfs", "sorted", "cb"), 4)
    assert orders == [
        ["fcfs", "sorted", "cb"],
        ["sorted", "cb", "fcfs"],
        ["cb", "fcfs", "sorted"],
        ["fcfs", "sorted", "cb"],
    ]


def test_summary_is_median_of_paired_ratios_not_ratio_of_medians():
    fcfs = [{"samples_per_s": s, "wall_s": 10 / s} for s in (1.0, 2.0, 4.0)]
    policy = [{"samples_per_s": s, "wall_s": 10 / s} for s in (3.0, 2.2, 4.4)]
    out = summarize_runs(policy, fcfs)
    # paired ratios 3.0, 1.1, 1.1 -> median 1.1, where the ratio of the medians is 3.0 / 2.0 = 1.5
    assert out["speedup_vs_fcfs_runs"] == pytest.approx([3.0, 1.1, 1.1])
    assert out["speedup_vs_fcfs"] == pytest.approx(1.1)
    assert out["samples_per_s"] == 3.0 and out["wall_s"] == pytest.approx(10 / 3.0)
    assert out["samples_per_s_runs"] == [3.0, 2.2, 4.4]
    assert summarize_runs(fcfs, fcfs)["speedup_vs_fcfs"] == 1.0


def test_repeats_must_be_positive():
    with pytest.raises(EcruError, match="repeats"):
        BenchConfig(model="tiny", repeats=0)
