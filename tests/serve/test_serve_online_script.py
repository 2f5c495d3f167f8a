"""bench/serve_online.py's helpers: arrivals, resampling, re-prediction metrics, static and online tables."""

import pytest

from ecru.serve.cost import CostModel
from ecru.serve.online import OnlineConfig
from tests.bench_scripts import load_bench_script

UNIT = CostModel(1.0, 0.0, 0.0, 0.0, 0.0, source="unit")


@pytest.fixture(scope="module")
def bench():
    return load_bench_script("serve_online")


def test_poisson_arrivals_have_the_asked_rate(bench):
    arrivals = bench.poisson_arrivals(20000, 4.0, seed=0)
    assert arrivals == sorted(arrivals)
    assert len(arrivals) / arrivals[-1] == pytest.approx(4.0, rel=0.03)


def test_remaining_metrics_of_perfect_repredictions(bench):
    lengths = [40, 10, 100]
    traj = [[n - t for t in range(0, n, 16)] for n in lengths]
    m = bench.remaining_metrics(traj, lengths, every=16, cap=100)
    assert m["mae"] == 0 and m["acc50"] == 1 and m["spearman"] == pytest.approx(1.0)
    assert m["points"] == sum(len(t) - 1 for t in traj)  # t = 0 is the prompt-only point, left out
    assert m["cap_hit_auc_at_16"] == 1.0  # at t = 16 the 100-token answer (the cap) ranks above the 40


def test_static_table_oracle_beats_fcfs_and_charges_prediction(bench):
    lengths = [5, 200, 5, 200, 5, 200, 5, 200] * 8
    idx = list(range(len(lengths)))
    preds = {"perfect": (list(map(float, lengths)), 0.0), "slow": (list(map(float, lengths)), 100.0)}
    out = bench.static_table(idx, [10] * len(idx), lengths, preds, UNIT, 256, group=64)
    assert out["perfect"]["oracle"] > 1.5 and out["perfect"]["sorted"] == pytest.approx(
        out["perfect"]["oracle"]
    )
    assert out["slow"]["sorted"] < out["perfect"]["sorted"]  # 100 s per request charged


def test_online_tables_report_every_policy_at_every_load(bench):
    lengths = [3, 60, 8, 120] * 10
    idx = bench.resample(len(lengths), 200, seed=0)
    preds = {"constant": ([50.0] * 40, 0.0), "probe": (list(map(float, lengths)), 0.0)}
    traj = [[n - t for t in range(0, n, 16)] for n in lengths]
    base = OnlineConfig(max_batch_size=4, max_new_tokens=128, token_s=1.0)
    out = bench.online_tables(idx, [5] * 40, lengths, preds, traj, 0.0, base, UNIT, seed=0)
    assert set(out["loads"]) == {"0.8", "1.2", "2.0"}
    for load in out["loads"].values():
        pols = load["policies"]
        assert {"fcfs", "cb", "cb-sjf", "cb-srpt", "oracle-srpt", "cb-sjf[at-arrival]"} <= set(pols)
        for r in pols.values():
            assert {"mean_latency_s", "p99_latency_s", "tokens_per_s", "peak_kv_tokens"} <= set(r)
        # with perfect predictions and no prediction cost, shortest-first without preemption is oracle SJF
        assert pols["cb-sjf"]["mean_latency_s"] == pytest.approx(
            pols["oracle-srpt[no-preempt]"]["mean_latency_s"]
        )
