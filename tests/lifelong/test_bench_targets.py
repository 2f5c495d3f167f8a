"""bench/lifelong.py's target check on hand-made runs: paired differences, std, the 2-std rule."""

import pytest

from ecru.errors import EcruError
from tests.bench_scripts import load_bench_script


@pytest.fixture(scope="module")
def bench():
    return load_bench_script("lifelong")


def run(seed, *, last=80.0, tr=0.0, change=0.0, cpu=10.0, params=100, stored=400.0):
    agnostic = dict(last=last, avg=last, transfer_retention=tr, heldout_change=change, bwt=0.0)
    return {
        "seed": seed,
        "order": seed,
        "agnostic": agnostic,
        "gated": {**agnostic, "by_construction": ["transfer_retention", "heldout_change"]},
        "metrics": agnostic,
        "cost": {"cpu_s": cpu, "wall_s": cpu, "trainable_params": params, "stored_bytes_per_task": stored},
    }


def test_targets_pair_runs_by_seed_and_order(bench):
    methods = {
        "routed-lora": {"runs": [run(s, last=95 + s, cpu=10, params=100, stored=800) for s in range(3)]},
        # listed in the other order: pairing is by (seed, order), not position
        "ncm": {"runs": [run(s, last=90 + 0.5 * s) for s in (2, 1, 0)]},
        "zscl": {"runs": [run(s, last=93, cpu=40) for s in range(3)]},
    }
    t = bench.check_targets(methods, full=True)
    assert t["agnostic_last_minus_ncm"]["runs"] == [5.0, 5.5, 6.0] and t["agnostic_last_minus_ncm"]["met"]
    assert t["agnostic_last_minus_zscl"]["runs"] == [2.0, 3.0, 4.0] and t["agnostic_last_minus_zscl"]["met"]
    assert t["cpu_over_zscl_cpu"]["runs"] == [0.25] * 3 and t["cpu_over_zscl_cpu"]["met"]
    assert (
        t["stored_bytes_per_task_over_adapter_bytes"]["mean"] == 2.0
        and t["stored_bytes_per_task_over_adapter_bytes"]["met"]
    )
    assert t["agnostic_transfer_retention"]["met"] and t["agnostic_heldout_change"]["met"]


def test_targets_need_the_full_configuration_three_runs_and_two_std(bench):
    ok = {
        "routed-lora": {"runs": [run(s, last=95) for s in range(3)]},
        "ncm": {"runs": [run(s, last=90) for s in range(3)]},
    }
    t = bench.check_targets(ok)  # not --full: never met, even though the mean meets it
    assert t["agnostic_last_minus_ncm"]["mean_meets"] and not t["agnostic_last_minus_ncm"]["met"]
    two = {n: {"runs": m["runs"][:2]} for n, m in ok.items()}
    t = bench.check_targets(two, full=True)
    assert not t["agnostic_last_minus_ncm"]["met"] and ">= 3" in t["agnostic_last_minus_ncm"]["why_not"]
    # a 4-point mean lead that varies by +-5 points: within 2 std, not shown
    noisy = {"routed-lora": {"runs": [run(0, last=99), run(1, last=89), run(2, last=94)]},
             "ncm": {"runs": [run(s, last=90) for s in range(3)]}}  # fmt: skip
    t = bench.check_targets(noisy, full=True)["agnostic_last_minus_ncm"]
    assert t["mean"] == 4.0 and t["mean_meets"] and not t["met"] and "2 sample std" in t["why_not"]
    bad = {"routed-lora": {"runs": [run(s, tr=-2.0, change=-0.5) for s in range(3)]}}
    t = bench.check_targets(bad, full=True)
    assert not t["agnostic_transfer_retention"]["met"] and t["agnostic_heldout_change"]["met"]
    assert "agnostic_last_minus_zscl" not in t  # zscl did not run
    assert bench.check_targets({"ncm": ok["ncm"]}) == {}


def test_a_reused_baseline_is_reported_but_never_meets_a_target(bench, tmp_path):
    import json

    methods = {"routed-lora": {"runs": [run(s, last=95, cpu=10) for s in range(3)]},
               "zscl": {"runs": [run(s, last=90, cpu=40) for s in range(3)], "reused_from": "old.json"}}  # fmt: skip
    t = bench.check_targets(methods, full=True)
    for name in ("agnostic_last_minus_zscl", "cpu_over_zscl_cpu"):
        assert t[name]["mean_meets"] and not t[name]["met"] and "old.json" in t[name]["why_not"]
    stream, pairs = {"tasks": 10, "split": "test"}, [(0, 0), (1, 1)]
    old = tmp_path / "old.json"
    old.write_text(
        json.dumps({"config": {"stream": stream, "runs": pairs}, "methods": {"zscl": {"runs": []}}})
    )
    assert bench.reused(f"{old}:zscl", stream, pairs) == {"zscl": {"runs": [], "reused_from": str(old)}}
    assert bench.reused(None, stream, pairs) == {}
    for spec, why in ((f"{old}:lwf", "no results"), (f"{tmp_path}/nope.json:zscl", "cannot read")):
        with pytest.raises(EcruError, match=why):
            bench.reused(spec, stream, pairs)
    with pytest.raises(EcruError, match="another stream"):
        bench.reused(f"{old}:zscl", {**stream, "tasks": 3}, pairs)


def test_combine_joins_one_process_per_run_and_checks_targets_over_all(bench, tmp_path):
    import json

    def full(r):
        return r | {"R": [[1.0]], "R0": [1.0], "R_agnostic": [[1.0]], "R0_agnostic": [1.0],
                    "heldout": [1.0], "heldout_agnostic": [1.0]}  # fmt: skip

    config = {"stream": {"tasks": 10}, "epochs": 2, "batch_size": 32, "lr": 1e-4, "full": True}
    paths = []
    for s in range(3):  # one file per (seed, order) run, as three processes write them
        methods = {"routed-lora": bench.aggregate([full(run(s, last=95, cpu=10))]),
                   "zscl": bench.aggregate([full(run(s, last=90, cpu=40))])}  # fmt: skip
        paths.append(tmp_path / f"run{s}.json")
        paths[-1].write_text(json.dumps({"config": config | {"runs": [[s, s]]}, "methods": methods}))
    out = bench.combine(paths)
    assert out["config"]["runs"] == [(0, 0), (1, 1), (2, 2)]
    t = out["targets"]
    assert t["cpu_over_zscl_cpu"]["runs"] == [0.25] * 3 and t["cpu_over_zscl_cpu"]["met"]
    assert t["agnostic_last_minus_zscl"]["mean"] == 5.0
    with pytest.raises(EcruError, match="repeat"):
        bench.combine([paths[0], paths[0]])
    apart = []  # one run's methods measured in two processes: joined as one result
    for name in ("routed-lora", "zscl"):
        apart.append(tmp_path / f"{name}.json")
        only = {name: json.loads(paths[0].read_text())["methods"][name]}
        apart[-1].write_text(json.dumps({"config": config | {"runs": [[0, 0]]}, "methods": only}))
    joined = bench.combine(apart)
    assert list(joined["methods"]) == ["routed-lora", "zscl"] and joined["config"]["runs"] == [(0, 0)]
    assert joined["targets"]["agnostic_last_minus_zscl"]["mean"] == 5.0
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"config": config | {"lr": 2e-5}, "methods": {}}))
    with pytest.raises(EcruError, match="differs"):
        bench.combine([paths[0], other])
    with pytest.raises(EcruError, match="cannot read"):
        bench.combine([tmp_path / "nope.json"])
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(EcruError, match="not a result"):
        bench.combine([tmp_path / "list.json"])


def test_aggregate_keeps_both_protocols_and_leaves_unrecorded_costs_empty(bench):
    runs = [run(0, last=90.0), run(1, last=80.0)]
    for r, rss in zip(runs, (500.0, None), strict=True):
        r |= {"R": [[1.0]], "R0": [1.0], "R_agnostic": [[1.0]], "R0_agnostic": [1.0], "heldout": [1.0, 1.0],
              "heldout_agnostic": [1.0, 1.0]}  # fmt: skip
        r["cost"]["peak_rss_mb"] = rss
    agg = bench.aggregate(runs)
    assert agg["cost"]["peak_rss_mb"] is None and agg["cost"]["wall_s"] == 10.0
    assert agg["agnostic"]["last"] == 85.0 and agg["agnostic_std"]["last"] == 5.0
    assert agg["gated"]["by_construction"] == ["transfer_retention", "heldout_change"]


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
