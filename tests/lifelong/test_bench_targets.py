"""bench/lifelong.py's target check on hand-made runs: paired differences, std, the 2-std rule."""

import pytest

from tests.bench_scripts import load_bench_script


@pytest.fixture(scope="module")
def bench():
    return load_bench_script("lifelong")


def run(seed, *, last=80.0, avg=80.0, diag=80.0, tr=0.0, drop=0.0, bwt=0.0, wall=10.0, params=100):
    metrics = dict(last=last, avg=avg, diag=diag, transfer_retention=tr, heldout_drop=drop, bwt=bwt)
    return {
        "seed": seed,
        "order": seed,
        "metrics": metrics,
        "cost": {"wall_s": wall, "trainable_params": params},
    }


def test_targets_pair_runs_by_seed_and_order(bench):
    methods = {
        "ecru": {
            "runs": [run(0, last=90, avg=85, wall=10, params=1), run(1, last=92, avg=84, wall=20, params=1)]
        },
        # listed in the other order: pairing is by (seed, order), not position
        "zscl": {"runs": [run(1, avg=85, wall=100, params=100), run(0, avg=85, wall=40, params=100)]},
        "independent": {"runs": [run(0, diag=91), run(1, diag=95)]},
        "seqft": {"runs": [run(0, drop=-6.0, tr=-1.0), run(1, drop=-8.0, tr=-1.0)]},
    }
    t = bench.check_targets(methods)
    assert t["ecru_avg_minus_zscl_avg"]["runs"] == [0.0, -1.0]
    assert t["ecru_avg_minus_zscl_avg"]["mean"] == -0.5 and t["ecru_avg_minus_zscl_avg"]["met"]
    assert t["ecru_wall_over_zscl_wall"]["runs"] == [0.25, 0.2] and t["ecru_wall_over_zscl_wall"]["met"]
    assert t["ecru_last_minus_independent_diag"]["runs"] == [-1.0, -3.0]
    assert (
        t["ecru_last_minus_independent_diag"]["mean"] == -2.0 and t["ecru_last_minus_independent_diag"]["met"]
    )
    assert t["ecru_trainable_share"]["mean"] == 0.01 and t["ecru_trainable_share"]["met"]
    # seqft drops 6 and 8 points (ecru 0): mean difference 7 > 2 x sample std 1.41 -> shown
    assert t["seqft_heldout_drop"]["met"] and not t["seqft_transfer_retention"]["met"]
    assert t["seqft_loses_5_points_on_one"]["met"]


def test_targets_not_met_and_the_two_std_rule(bench):
    methods = {
        "ecru": {"runs": [run(0, tr=-2.0, drop=0.0), run(1, tr=0.0, drop=0.0)]},
        # a 5.5-point mean loss whose paired difference to ecru varies by +-4.5: not shown
        "seqft": {"runs": [run(0, drop=-1.0), run(1, drop=-10.0)]},
    }
    t = bench.check_targets(methods)
    assert t["ecru_transfer_retention"]["mean"] == -1.0 and t["ecru_transfer_retention"]["met"]
    assert t["seqft_heldout_drop"]["mean"] == -5.5 and not t["seqft_heldout_drop"]["met"]
    assert not t["seqft_loses_5_points_on_one"]["met"]
    assert "ecru_avg_minus_zscl_avg" not in t  # zscl did not run
    assert bench.check_targets({"seqft": methods["seqft"]}) == {}


def test_two_std_rule_needs_two_paired_runs(bench):
    # one run has no spread to compare with: a 9-point loss is not "shown"
    one = {"ecru": {"runs": [run(0)]}, "seqft": {"runs": [run(0, drop=-9.0)]}}
    t = bench.check_targets(one)["seqft_heldout_drop"]
    assert t["mean"] == -9.0 and not t["met"] and "2 (seed, order) runs" in t["why_not"]
    # seqft's runs do not pair with ecru's: nothing to compare, nothing shown
    apart = {"ecru": {"runs": [run(0), run(1)]}, "seqft": {"runs": [run(2, drop=-9.0), run(3, drop=-9.0)]}}
    t = bench.check_targets(apart)
    assert "seqft_heldout_drop" not in t and not t["seqft_loses_5_points_on_one"]["met"]
    # seqft's own loss is averaged over the paired runs only
    extra = {"ecru": {"runs": [run(0), run(1)]},
             "seqft": {"runs": [run(0, drop=-6.0), run(1, drop=-8.0), run(2, drop=0.0)]}}  # fmt: skip
    t = bench.check_targets(extra)["seqft_heldout_drop"]
    assert t["runs"] == [-6.0, -8.0] and t["met"]


def test_routing_shares_on_separated_clusters():
    import torch
    import torch.nn.functional as F

    routing = load_bench_script("lifelong_routing")
    torch.manual_seed(0)
    centers = F.normalize(torch.randn(3, 16, dtype=torch.float64), dim=-1) * 3

    def cluster(c, n):
        return F.normalize(centers[c] + 0.2 * torch.randn(n, 16, dtype=torch.float64), dim=-1)

    keys, own = [cluster(0, 40), cluster(1, 40)], [cluster(0, 20), cluster(1, 20)]
    s = routing.route_shares(keys, own, {"far": cluster(2, 30)}, k=3, percentile=0.0)
    assert s["own_to_own"] >= 90 and s["own_to_other"] == 0.0 and s["far_to_adapter"] <= 10
    assert (
        routing.route_shares(keys, own, {"far": cluster(2, 30)}, k=3, percentile=50.0)["own_to_own"]
        < s["own_to_own"]
    )


def test_targets_of_a_variant_under_the_same_keys(bench):
    methods = {
        "ecru": {"runs": [run(0, tr=0.0)]},
        "ecru-text": {"runs": [run(0, tr=-3.0)]},
        "zscl": {"runs": [run(0, avg=81.0)]},
    }
    assert bench.check_targets(methods)["ecru_transfer_retention"]["met"]
    text = bench.check_targets(methods, "ecru-text")
    assert not text["ecru_transfer_retention"]["met"] and text["ecru_avg_minus_zscl_avg"]["runs"] == [-1.0]


def test_cpu_ratio_over_the_runs_that_recorded_it(bench):
    ecru, zscl = [run(0), run(1)], [run(0), run(1)]
    ecru[1]["cost"]["cpu_s"], zscl[1]["cost"]["cpu_s"] = 30.0, 120.0  # run 0 predates cpu_s
    t = bench.check_targets({"ecru": {"runs": ecru}, "zscl": {"runs": zscl}})
    assert t["ecru_cpu_over_zscl_cpu"]["runs"] == [0.25] and t["ecru_cpu_over_zscl_cpu"]["met"]
    assert "ecru_cpu_over_zscl_cpu" not in bench.check_targets(
        {"ecru": {"runs": [run(0)]}, "zscl": {"runs": [run(0)]}}
    )


def test_ecru_heldout_target_takes_the_worst_task(bench):
    low = run(0, drop=-0.5)
    low["metrics"]["heldout_worst_drop"] = -3.0  # recovered by the last task, lost 3 points on the way
    t = bench.check_targets({"ecru": {"runs": [low]}})["ecru_heldout_drop"]
    assert t["mean"] == -3.0 and not t["met"]


def test_aggregate_leaves_unrecorded_costs_empty(bench):
    runs = [run(0), run(1)]
    for r, rss in zip(runs, (500.0, None), strict=True):
        r |= {"R": [[1.0]], "R0": [1.0], "R_ci": [[1.0]], "metrics_ci": r["metrics"], "heldout": [1.0, 1.0]}
        r["cost"]["peak_rss_mb"] = rss
    cost = bench.aggregate(runs)["cost"]
    assert cost["peak_rss_mb"] is None and cost["wall_s"] == 10.0


def test_targets_met_by_design_are_marked(bench):
    methods = {"ecru": {"runs": [run(0, tr=0.0, drop=0.0)]}}
    t = bench.check_targets(methods, by_construction=("ecru_transfer_retention",))
    assert t["ecru_transfer_retention"]["by_construction"] and "by_construction" not in t["ecru_heldout_drop"]
    assert bench.ecru_by_construction() == ("ecru_transfer_retention", "ecru_heldout_drop", "ecru_bwt")


def test_training_flags_build_the_train_config(bench):
    from ecru.errors import EcruError
    from ecru.lifelong.methods import TrainConfig

    args = bench.parse_args(["--json", "x.json", "--epochs", "5", "--lr", "1e-4", "--label-smoothing", "0",
                             "--scale", "50"])  # fmt: skip
    assert bench.train_config(args, 32, 3) == TrainConfig(
        epochs=5, batch_size=32, lr=1e-4, label_smoothing=0.0, scale=50.0, seed=3
    )
    defaults = bench.train_config(bench.parse_args(["--json", "x.json"]), 32, 0)
    assert defaults == TrainConfig(batch_size=32, seed=0)
    with pytest.raises(EcruError, match="label_smoothing"):
        bench.train_config(bench.parse_args(["--json", "x.json", "--label-smoothing", "1"]), 32, 0)
