"""bench/experiments/serve_predictors.py's cap study helpers: mixture median, out-of-fold CV, prefixes."""

import json

import numpy as np
import pytest

from tests.bench_scripts import load_bench_script, load_experiment_script


@pytest.fixture(scope="module")
def study():
    return load_experiment_script("serve_predictors")


def test_mixture_median_by_hand(study):
    noncap = np.array([10.0, 20.0, 30.0, 40.0, 50.0])
    # p >= 0.5: the cap; p = 0: the plain median; p = 0.2: the 0.625 quantile of the non-cap lengths
    out = study.mixture_median(np.array([0.5, 0.9, 0.0, 0.2]), noncap, 256)
    assert out.tolist() == pytest.approx([256, 256, 30.0, 35.0])


def test_cross_validation_separates_an_informative_feature(study):
    rng = np.random.default_rng(0)
    lengths = np.where(rng.random(80) < 0.3, 64.0, rng.integers(5, 40, 80).astype(float))
    informative = (lengths >= 64) + 0.3 * rng.standard_normal(80)
    p, pred, const = study.cross_validate(informative[:, None], lengths, cap=64, seed=0)
    from sklearn.metrics import roc_auc_score

    assert roc_auc_score(lengths >= 64, p) > 0.95
    assert np.abs(pred - lengths).mean() < np.abs(const - lengths).mean()
    known = np.where(np.arange(80) < 5, 3.0, 0.0)  # five answers seen to end inside the prefix
    _, pred, _ = study.cross_validate(informative[:, None], lengths, cap=64, seed=0, known=known)
    assert pred[:5].tolist() == [3.0] * 5


def test_cap_features_on_the_tiny_model(study):
    from ecru.serve.models import load_model

    model, tok = load_model("tiny")
    f = study.cap_features(model, tok, ["hi", "tell me a story", "what time is it"], batch_size=2)
    k = max(study.PREFIX_TOKENS)
    assert f["h_last"].shape == (3, model.config.hidden_size) and f[f"h{k}"].shape == (
        3,
        model.config.hidden_size,
    )
    assert f["entropy"].shape == (3,) and np.all(f["entropy"] >= 0)
    assert np.all((f[f"len{k}"] == 0) | (f[f"ended{k}"] == 1))


@pytest.fixture(scope="module")
def bounds():
    return load_experiment_script("serve_bounds")


def test_calibrated_predictions_keep_the_marginal_and_the_correlation(bounds):
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, 400).astype(float)
    perfect = bounds.calibrated_predictions(lengths, 1.0, rng)
    assert np.array_equal(np.sort(perfect), np.sort(lengths))
    assert np.array_equal(perfect, lengths)  # rho 1: each request predicted its own length
    for rho in (0.0, 0.5, 0.9):
        pred = bounds.calibrated_predictions(lengths, rho, np.random.default_rng(1))
        assert np.array_equal(np.sort(pred), np.sort(lengths))
        assert abs(spearmanr(pred, lengths).statistic - rho) < 0.1


def test_serve_bounds_on_a_small_trace(bounds, tmp_path):
    import json

    rng = np.random.default_rng(0)
    lengths = np.where(rng.random(48) < 0.3, 64, rng.integers(2, 40, 48))
    (tmp_path / "t.jsonl").write_text(
        "".join(json.dumps({"prompt_len": 20, "output_len": int(n)}) + "\n" for n in lengths)
    )
    out = tmp_path / "b.json"
    bounds.main(
        ["--trace", str(tmp_path / "t.jsonl"), "--max-new-tokens", "64", "--batch-size", "8",
         "--cost-model", "unit", "--rhos", "0,1", "--seeds", "2", "--json", str(out)]
    )  # fmt: skip
    r = json.loads(out.read_text())
    perfect, b = r["sweep"]["1.0"], r["bounds"]
    # perfect predictions: sorted and fcr are the oracle schedule; shortest-first is the best cb-sjf
    assert perfect["sorted_x_fcfs"] == pytest.approx(b["oracle_x_fcfs"])
    assert perfect["fcr_x_fcfs"] == pytest.approx(b["oracle_x_fcfs"])
    assert b["oracle_x_fcfs"] > 1.2 and b["cb_x_fcfs"] > 1.2
    assert b["spt_latency_x_cb"] < 1.0
    assert r["sweep"]["0.0"]["cb_sjf_latency_x_cb"] >= b["spt_latency_x_cb"]
    assert out.with_suffix(".png").is_file()


def test_online_study_light_and_heavy_load(bounds):
    from ecru.serve import CostModel

    rng = np.random.default_rng(0)
    lengths = np.where(rng.random(96) < 0.3, 64, rng.integers(2, 40, 96)).astype(float)
    unit = CostModel(1.0, 0.0, 0.0, 0.0, 0.0, source="unit")
    out = bounds.online_study([20] * 96, lengths, loads=[0.1, 3.0], rhos=[1.0, 0.0], seeds=2, batch_size=8,
                              cap=64, cost=unit, agings=[0.0])["0.0"]  # fmt: skip
    # nearly empty system: nobody waits, the order of admission cannot matter
    assert out["0.1"]["1.0"] == pytest.approx(1.0, abs=0.02)
    # a growing queue: shortest-first with perfect lengths cuts the mean latency; a blind order does not
    assert out["3.0"]["1.0"] < 0.85 and out["3.0"]["1.0"] < out["3.0"]["0.0"]


def test_bench_serve_simulates_every_policy_it_ran():
    serve = load_bench_script("serve")
    true = [3.0, 12.0, 2.0, 7.0, 5.0, 9.0]
    policy = {"samples_per_s": 1.0, "effective_token_ratio": 0.5, "speedup_vs_fcfs": 1.0, "wall_s": 6.0}
    result = {
        "setup": {"prompt_lens": [4] * 6, "true_lengths": true, "predicted_lengths": true, "batch_size": 2,
                  "max_new_tokens": 10, "aging": 0.5},
        "predictor": {"predict_s": 0.0},
        "policies": {p: dict(policy) for p in ("fcfs", "oracle", "cb", "cb-ljf")},
    }  # fmt: skip
    sim = serve.simulate_measured(result, cost_path=None)["policies"]
    assert set(sim) == {"fcfs", "oracle", "cb", "cb-ljf"}
    assert sim["fcfs"]["speedup"] == 1.0
    assert sim["cb"]["effective_token_ratio"] == sim["cb-ljf"]["effective_token_ratio"] == 1.0
    assert sim["oracle"]["effective_token_ratio"] > sim["fcfs"]["effective_token_ratio"]


def test_serve_kv_replays_a_bench_setup(tmp_path):
    kv = load_experiment_script("serve_kv")
    # 6 short answers and 2 at the cap, prompts of 4 tokens, batch 2, cap 32
    setup = {"prompt_lens": [4] * 8, "true_lengths": [3, 4, 32, 5, 3, 32, 4, 6], "batch_size": 2,
             "max_new_tokens": 32, "predicted_lengths": [4.0] * 8, "n": 8}  # fmt: skip
    from ecru.serve import CostModel

    rows = kv.replay(setup, kv.reservation_rules(setup, [8]), CostModel(1.0, 0.0, 0.0, 0.0, 0.0))
    assert set(rows) == {"cb", "cb, 4 rows", "cb-kv predictor", "cb-kv true lengths", "cb-kv constant 8",
                         "cb-kv cap 32"}  # fmt: skip
    assert rows["cb-kv true lengths"]["preemptions"] == 0 and rows["cb-kv cap 32"]["preemptions"] == 0
    # exact reservations fit more rows into the same memory than cb's batch of 2: fewer decode steps
    assert rows["cb-kv true lengths"]["x_fcfs"] > rows["cb"]["x_fcfs"]
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"setup": setup}))
    kv.main(["--bench", str(bench), "--constants", "8", "--json", str(tmp_path / "kv.json")])
    from ecru.serve import SMOLLM2_CPU  # the script's default cost model

    written = json.loads((tmp_path / "kv.json").read_text())["rows"]
    assert written == kv.replay(setup, kv.reservation_rules(setup, [8]), SMOLLM2_CPU)


def test_label_summary_and_greedy_agreement_by_hand(tmp_path):
    labels = load_experiment_script("serve_labels")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rows = [("p1", [10, 30, 8, 12]), ("p2", [64, 64, 20, 5]), ("p3", [20, 10, 40, 64])]
    a.write_text(
        "".join(json.dumps({"prompt": p, "lengths": ls, "max_new_tokens": 64}) + "\n" for p, ls in rows)
    )
    b.write_text("".join(json.dumps({"prompt": p, "lengths": [g], "max_new_tokens": 64}) + "\n"
                         for p, g in (("p1", 10), ("p3", 21), ("p4", 7))))  # fmt: skip
    s = labels.summary(a)
    assert (s["prompts"], s["samples"], s["median_greedy"], s["median_label"]) == (3, 4, 20, 64)
    assert s["greedy_at_cap"] == pytest.approx(1 / 3) and s["label_at_cap"] == pytest.approx(2 / 3)
    assert labels.greedy_agreement(a, b) == {"shared_prompts": 2, "greedy_equal": 1}


def test_serve_self_predict_scores_both_readouts_of_one_adapter():
    from ecru.serve.self_predict import SelfLoRAConfig

    bench = load_experiment_script("serve_self_predict")

    class Stub:  # the greedy readout ties two prompts, the expected one ranks them
        config = SelfLoRAConfig()

        def predict(self, prompts):
            if self.config.readout == "greedy":
                return [50.0, 150.0, 150.0, 200.0]
            return [40.0, 60.0, 140.0, 160.0]

    out = bench.scores(
        Stub(), ["a", "b", "c", "d"], [10, 20, 30, 40], ["one-word", "email", "email", "story"]
    )
    assert set(out) == {"greedy", "expected"}
    assert out["expected"]["spearman"] == pytest.approx(1.0) and out["greedy"]["spearman"] < 1.0
    assert out["expected"]["spearman_held_out_forms"] == pytest.approx(1.0)  # "email" is a test-only form
    assert out["greedy"]["spearman_held_out_forms"] is None  # one number for both: no ranking
    assert out["expected"]["mae"] == pytest.approx((30 + 40 + 110 + 120) / 4)


def test_serve_self_predict_chooses_per_readout_among_the_asked_lrs():
    bench = load_experiment_script("serve_self_predict")
    point = lambda g, e: {"greedy": {"spearman": g}, "expected": {"spearman": e}}  # noqa: E731
    validation = {
        "0.0005": {"1": point(0.70, 0.74), "2": point(None, 0.77)},  # greedy: one number for all at epoch 2
        "0.0002": {"1": point(0.66, 0.71), "2": point(0.64, 0.75)},
        "0.001": {"1": point(0.90, 0.90)},  # not among --lrs: ignored
    }
    chosen = bench.best_per_readout(validation, [5e-4, 2e-4])
    assert chosen["greedy"] == {"lr": 5e-4, "epochs": 1, "validation_spearman": 0.70}
    assert chosen["expected"] == {"lr": 5e-4, "epochs": 2, "validation_spearman": 0.77}
    assert bench.show({"spearman": None, "mae": 3.14159}) == "spearman -, mae 3.142"
