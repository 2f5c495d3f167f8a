"""bench/ctr_scaling.py on a tiny setting: every recipe/mode/batch runs and the JSON has the issue's schema."""

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from ecru.cowclip import scaled_recipe
from tests.bench_scripts import EXPERIMENTS, load_bench_script, load_experiment_script

BENCH = Path(__file__).resolve().parents[2] / "bench" / "ctr_scaling.py"
KEYS = {
    "recipe",
    "mode",
    "batch_size",
    "epochs",
    "steps",
    "auc",
    "logloss",
    "oracle_auc",
    "oracle_logloss",
    "samples_per_s",
    "wall_s",
    "clipped_fraction",
    "threads",
}


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("ctr_scaling", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ctr_scaling", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def decisive(monkeypatch):
    """The study bench/experiments/ctr_decisive.py."""
    spec = importlib.util.spec_from_file_location("ctr_decisive", EXPERIMENTS / "ctr_decisive.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ctr_decisive", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _tiny_setting(bench, *, rows: int):
    return bench.Setting(
        rows=rows,
        test_fraction=0.25,
        scale=1e-3,
        zipf=1.1,
        mlp=(8,),
        epochs=1,
        batches=(128, 512),
        timing_steps=3,
    )


def test_quick_schema_on_a_tiny_setting(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "QUICK", _tiny_setting(bench, rows=6000))
    out = tmp_path / "r.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert all(KEYS <= set(r) for r in runs)
    got = {(r["recipe"], r["mode"], r["batch_size"]) for r in runs}
    for b in (128, 512):
        assert {("adam", "full", b), ("adam-sqrt", "full", b), ("linear", "full", b)} <= got
        assert {(n, m, b) for n in ("cowclip", "tempered") for m in ("full", "sparse")} <= got
    same = [r for r in runs if r.get("same_run_as")]
    assert {r["recipe"] for r in same if r["batch_size"] == 128} == {"adam-sqrt", "linear", "tempered"}
    assert all(r["batch_size"] == 128 for r in same)  # at s = 1 every rule is the 1K recipe
    assert set(result["targets"]) >= {
        "tempered_gap_to_1k",
        "sparse_vs_full_speedup_1k",
        "clip_fired_at_large_batch",
    }
    assert out.with_suffix(".png").stat().st_size > 0


def test_partial_plan(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "QUICK", _tiny_setting(bench, rows=4000))
    out = tmp_path / "p.json"
    assert (
        bench.main(["--recipes", "cowclip,tempered", "--no-sparse", "--epochs", "2", "--json", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    got = [(r["recipe"], r["mode"], r["batch_size"], r["epochs"]) for r in result["runs"]]
    assert got == [
        ("adam", "full", 128, 2),
        ("cowclip", "full", 128, 2),
        ("tempered", "full", 128, 2),
        ("cowclip", "full", 512, 2),
        ("tempered", "full", 512, 2),
    ]
    assert result["timing_1k"] is None and "tempered_full_512_gap_to_1k" in result["targets"]


def test_sparse_only_plan(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "FULL", _tiny_setting(bench, rows=4000))
    out = tmp_path / "s.json"
    argv = ["--full", "--sparse-only", "--recipes", "linear,tempered", "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    got = [(r["recipe"], r["mode"], r["batch_size"]) for r in result["runs"]]
    assert got == [("adam", "sparse", 128), ("linear", "sparse", 512), ("tempered", "sparse", 512)]
    assert result["timing_1k"] is None and "tempered_sparse_512_gap_to_1k" in result["targets"]
    ref = result["runs"][0]
    best_gap = max(h["auc"] for h in ref["history"]) - max(h["auc"] for h in result["runs"][2]["history"])
    assert result["targets"]["tempered_sparse_512_best_epoch_gap_to_1k_best"] == pytest.approx(best_gap)
    # --summarize re-derives the targets from the recorded runs and stores the note; it trains nothing
    result["targets"] = {}
    out.write_text(json.dumps(result))
    monkeypatch.setattr(bench, "train", None)
    assert bench.main(["--summarize", str(out), "--note", "why"]) == 0
    again = json.loads(out.read_text())
    assert again["note"] == "why" and again["runs"] == result["runs"]
    assert again["targets"]["tempered_sparse_512_gap_to_1k"] == pytest.approx(
        ref["auc"] - result["runs"][2]["auc"]
    )
    with pytest.raises(SystemExit):  # the two mode filters exclude each other
        bench.main(["--no-sparse", "--sparse-only", "--json", str(out)])


def test_recipe_search_on_a_tiny_setting(bench, tmp_path, monkeypatch):
    # `from ctr_scaling import QUICK` in the study: the fixture's module
    search = load_experiment_script("ctr_recipe_search")
    monkeypatch.setattr(search, "QUICK", _tiny_setting(bench, rows=4000))
    out = tmp_path / "search.json"
    assert search.main(["--seeds", "0,1", "--batch", "512", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["seeds"] == [0, 1] and len(result["runs"]) == 2 * (1 + len(result["gaps_to_1k"]))
    auc = {(r["seed"], r["label"]): r["auc"] for r in result["runs"]}
    for label, row in result["gaps_to_1k"].items():
        assert row["gaps"] == pytest.approx([auc[(s, "1k")] - auc[(s, label)] for s in (0, 1)])
        assert row["max_gap"] == max(row["gaps"])
    best = result["best_by_max_gap"]
    assert result["gaps_to_1k"][best]["max_gap"] == min(r["max_gap"] for r in result["gaps_to_1k"].values())
    # the candidate labelled as the tempered rule is the library's tempered recipe
    rule = next(r for r in result["runs"] if r["label"] == "e1-d.75-l.5-w1/s")["settings"]
    assert rule == pytest.approx(asdict(scaled_recipe("tempered", 512, base_batch=128)))


def test_decisive_on_a_tiny_setting(decisive, tmp_path, monkeypatch):
    tiny = decisive.Setting(
        rows=3000, test_fraction=0.25, scale=1e-3, mlp=(8,), epochs=1, base=64, large=512, seeds=(0, 1)
    )
    monkeypatch.setattr(decisive, "QUICK", tiny)
    out = tmp_path / "d.json"
    assert decisive.main(["--quick", "--variants", "cowclip,no-clip,summed-loss", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    order = [(r["seed"], r["variant"]) for r in result["runs"]]
    assert order == [(0, "reference"), (0, "cowclip"), (0, "no-clip"), (1, "reference"), (1, "cowclip")] + [
        (1, "no-clip"),
        (0, "summed-loss"),
        (1, "summed-loss"),
    ]
    # a no-clip run is copied only where the CowClip run clipped nothing (that an inert clip is bit-identical
    # to no clip is tests/cowclip/test_wrapper.py's test_nothing_clipped_equals_plain_adam_...)
    for r in result["runs"]:
        if r.get("identical_by_construction"):
            cow = next(c for c in result["runs"] if c["variant"] == "cowclip" and c["seed"] == r["seed"])
            assert cow["clipped_fraction"] == 0.0
    summary = result["summary"]
    ref = {r["seed"]: r["auc"] for r in result["runs"] if r["variant"] == "reference"}
    gaps = [ref[r["seed"]] - r["auc"] for r in result["runs"] if r["variant"] == "no-clip"]
    assert summary["no-clip"]["gap_to_reference_mean"] == pytest.approx(sum(gaps) / 2)
    assert summary["cowclip"]["steps"] == 2250 // 512 and "2 seeds" in result["verdict"]
    # the summed loss makes the clip fire where the mean loss leaves it inert
    assert summary["summed-loss"]["clipped_fraction_mean"] > summary["cowclip"]["clipped_fraction_mean"]
    assert out.with_suffix(".png").stat().st_size > 0
    # a second process on one seed (resuming from a copy holding that seed's reference), then merged back
    main = {**result, "runs": [r for r in result["runs"] if r["variant"] != "summed-loss"]}
    out.write_text(json.dumps(main))
    knobs = tmp_path / "k.json"
    knobs.write_text(json.dumps(main))
    argv = ["--quick", "--resume", "--seeds", "1", "--variants", "summed-loss", "--json", str(knobs)]
    assert decisive.main(argv) == 0
    ran = json.loads(knobs.read_text())["runs"]
    assert [(r["seed"], r["variant"]) for r in ran][-1] == (1, "summed-loss") and len(ran) == len(
        main["runs"]
    ) + 1
    assert decisive.main(["--quick", "--json", str(out), "--merge", str(knobs)]) == 0
    merged = json.loads(out.read_text())
    assert merged["summary"]["summed-loss"]["seeds"] == [1]
    assert merged["summary"]["summed-loss"]["gaps"] == pytest.approx(summary["summed-loss"]["gaps"][1:])


def test_decisive_accepts_result_files_recording_the_dropped_knob_seeds(decisive):
    recorded = json.loads(json.dumps(asdict(decisive.CPU)))
    assert "knob_seeds" not in recorded and decisive.same_setting(recorded, decisive.CPU)
    # written while Setting had knob_seeds: all of the seeds (or None, meaning them) is the same setting
    for knobs in (recorded["seeds"], None):
        assert decisive.same_setting({**recorded, "knob_seeds": knobs}, decisive.CPU)
    assert not decisive.same_setting({**recorded, "knob_seeds": [0]}, decisive.CPU)  # knobs on fewer seeds
    assert not decisive.same_setting({**recorded, "rows": 1}, decisive.CPU)
    assert not decisive.same_setting(recorded, decisive.QUICK)


def test_peers_summary_takes_medians_and_checks_the_targets():
    """bench/ctr_peers.py's summary (the peer itself runs in its own venv: not part of the test run)."""
    peers = load_bench_script("ctr_peers")
    run = {"logloss": 0.5, "peak_rss_mb": 100.0}
    runs = [
        {**run, "system": "ecru", "auc": 0.780, "samples_per_s": 130.0},
        {**run, "system": "deepctr-torch", "auc": 0.781, "samples_per_s": 100.0},
        {**run, "system": "deepctr-torch", "auc": 0.781, "samples_per_s": 100.0},
        {**run, "system": "ecru", "auc": 0.780, "samples_per_s": 150.0},
    ]
    summary = peers.summarise(runs)
    assert summary["ecru"]["samples_per_s"] == 140.0 and abs(summary["speedup"] - 1.4) < 1e-12
    assert abs(summary["auc_gap"] + 0.001) < 1e-12
    assert summary["targets"] == {"speedup >= 1.3": True, "|auc gap| <= 0.002": True}
