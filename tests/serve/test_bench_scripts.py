"""bench/serve.py's simulator view of the policies it ran."""

from tests.bench_scripts import load_bench_script


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
