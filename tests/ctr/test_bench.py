"""bench/ctr_scaling.py on a tiny setting: every recipe/mode/batch runs and the JSON has the issue's schema."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench_script

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


def test_time_to_auc_worker_curve_and_rows(bench, tmp_path, monkeypatch):
    """One --time-to-auc run in this process (torchrun's ranks run the same worker), and its table row."""
    from ecru.ctr import SyntheticConfig, generate

    monkeypatch.setattr(bench, "TIME_TO_AUC", _tiny_setting(bench, rows=6000))
    parts = generate(SyntheticConfig(n_rows=6000, scale=1e-3, seed=0)).split_random(0.25, seed=0)
    bench.save_arrays(tmp_path, dict(zip(("train", "test"), parts, strict=True)))
    out = tmp_path / "run.json"
    args = dict(arrays=str(tmp_path), out=str(out), batch=128, base_batch=128, epochs=2, recipe="tempered")
    assert bench.tta_worker(bench.argparse.Namespace(**args, target=None, seed=0)) == 0
    run = json.loads(out.read_text())
    assert run["eval_every_steps"] == 4 and run["steps"] == run["curve"][-1]["step"] == 2 * (4500 // 128)
    run |= {"process_wall_s": 1.0, "load_avg_1min_before": 0.0, "load_avg_1min_after": 0.0}
    target = run["curve"][3]["auc"]
    hit = bench.first_reaching(run["curve"], target)
    row = bench.tta_row(2, 128, "tempered", run, target)
    assert row["reached_target"] and row["steps_to_target"] == hit["step"] <= run["curve"][3]["step"]
    assert row["seconds_to_target"] == hit["train_s"] and row["samples_to_target"] == 128 * hit["step"]
    missed = bench.tta_row(1, 128, "tempered", run, 0.999)
    assert not missed["reached_target"] and missed["seconds_to_target"] is None
