"""bench/serve.py, the static batching benchmark: its repetition plan and summary (rotated orders, medians,
paired ratios to fcfs), its predictors, its cb-srpt as shipped, the simulator's view, and its command line
end to end on the tiny model (`bench_serve`: the script as a module)."""

import json
import shlex

import pytest

from ecru.errors import EcruError


def test_each_repetition_starts_one_policy_later(bench_serve):
    orders = bench_serve.rotated_orders(("fcfs", "sorted", "cb"), 4)
    assert orders == [
        ["fcfs", "sorted", "cb"],
        ["sorted", "cb", "fcfs"],
        ["cb", "fcfs", "sorted"],
        ["fcfs", "sorted", "cb"],
    ]


def test_summary_is_median_of_paired_ratios_not_ratio_of_medians(bench_serve):
    summarize_runs = bench_serve.summarize_runs
    fcfs = [{"samples_per_s": s, "wall_s": 10 / s} for s in (1.0, 2.0, 4.0)]
    policy = [{"samples_per_s": s, "wall_s": 10 / s} for s in (3.0, 2.2, 4.4)]
    out = summarize_runs(policy, fcfs)
    # paired ratios 3.0, 1.1, 1.1 -> median 1.1, where the ratio of the medians is 3.0 / 2.0 = 1.5
    assert out["speedup_vs_fcfs_runs"] == pytest.approx([3.0, 1.1, 1.1])
    assert out["speedup_vs_fcfs"] == pytest.approx(1.1)
    assert out["samples_per_s"] == 3.0 and out["wall_s"] == pytest.approx(10 / 3.0)
    assert out["samples_per_s_runs"] == [3.0, 2.2, 4.4]
    assert summarize_runs(fcfs, fcfs)["speedup_vs_fcfs"] == 1.0


def test_repeats_must_be_positive(bench_serve):
    with pytest.raises(EcruError, match="repeats"):
        bench_serve.BenchConfig(model="tiny", repeats=0)


def test_lora_readout_is_validated_and_shares_the_tuned_adapter(tmp_path, monkeypatch, bench_serve):
    from ecru.serve.engine.models import load_model
    from ecru.serve.predict.self_predict import SelfLoRAPredictor

    bench, BenchConfig = bench_serve, bench_serve.BenchConfig
    with pytest.raises(EcruError, match="lora-readout"):
        BenchConfig(model="tiny", lora_readout="mean")
    monkeypatch.setenv("ECRU_CACHE", str(tmp_path))
    prompts, labels = ["one question", "another question"], [40.0, 180.0]
    model, tok = load_model("tiny")
    greedy = bench._self_lora(model, tok, BenchConfig(model="tiny", lora_epochs=1), prompts, labels)
    assert greedy.config.readout == "greedy" and len(list((tmp_path / "serve").iterdir())) == 1

    def refit(*args, **kwargs):
        raise AssertionError("the adapter tuned for the greedy readout should be reused")

    monkeypatch.setattr(SelfLoRAPredictor, "fit", refit)
    model, tok = load_model("tiny")
    config = BenchConfig(model="tiny", lora_epochs=1, lora_readout="expected")
    expected = bench._self_lora(model, tok, config, prompts, labels)
    assert expected.config.readout == "expected" and len(expected.predict(["a third question"])) == 1


def test_every_predictor_the_cli_offers_is_one_the_benchmark_builds(monkeypatch, bench_serve):
    from ecru.serve.engine.models import load_model
    from ecru.serve.predict.predictors import EmbeddingPredictor

    bench, BenchConfig = bench_serve, bench_serve.BenchConfig
    flag = next(a for a in bench.build_parser()._actions if a.dest == "predictor")
    assert tuple(flag.choices) == bench.PREDICTORS
    monkeypatch.setattr(
        bench, "train_labels", lambda *a: (["a short one", "tell me a long story", "hi"], [5, 90, 2])
    )
    model, tok = load_model("tiny")
    built = bench.build_predictor(model, tok, BenchConfig(model="tiny", predictor="embed"), {})
    assert isinstance(built, EmbeddingPredictor) and len(built.predict(["a question"])) == 1


def test_the_bench_runs_cb_srpt_as_it_ships(chat_model_dir, tmp_path, monkeypatch, bench_serve):
    """Plain cb-srpt in bench/serve.py is the engine's shipped configuration: the FCFS deadline, kept KV,
    the embedding predictor per request and re-predictions by the probe `ecru serve probe` fits, both fitted
    on the train prompts' greedy answers; greedy answers as cb's."""
    import math

    from ecru.serve.engine.models import ServedModel
    from ecru.serve.engine.sampling import SamplingParams
    from ecru.serve.predict.predictors import EmbeddingPredictor
    from ecru.serve.predict.remaining import RemainingProbe
    from ecru.serve.prompts import encode_chat
    from ecru.serve.sched.names import FCFS_SLACK
    from ecru.serve.sched.scheduler import EngineConfig

    BENCH_POLICIES, BenchConfig, ShippedSRPT = (
        bench_serve.BENCH_POLICIES,
        bench_serve.BenchConfig,
        bench_serve.ShippedSRPT,
    )
    assert "cb-srpt" in BENCH_POLICIES and "cb-srpt" in BenchConfig().policies
    labels = tmp_path / "labels.jsonl"
    train = [f"tell me about topic {i}" for i in range(12)]
    labels.write_text(
        "".join(json.dumps({"prompt": p, "lengths": [40], "max_new_tokens": 40}) + "\n" for p in train)
    )
    config = BenchConfig(model=str(chat_model_dir), prompts=str(labels), max_new_tokens=40, batch_size=2,
                         labels=str(labels), train_n=12)  # fmt: skip
    served = ServedModel.load(str(chat_model_dir), packed=False)
    srpt = ShippedSRPT.fit(served, config, progress=False)
    shipped = srpt._engine(config, "cb-srpt")
    assert (shipped.deadline, shipped.aging_per_step, shipped.preempt_mode) == (FCFS_SLACK, 0.0, "keep")
    assert srpt.held_out["remaining_probe"]["answers"] == 12 and srpt.length.key == srpt.probe.model

    calls = {"predict": 0, "repredict": 0}
    predict, repredict = EmbeddingPredictor.engine_predict, RemainingProbe.predict

    def counted_predict(self, prompt, params=None):
        calls["predict"] += 1
        return predict(self, prompt, params)

    def counted_repredict(self, states, t):
        calls["repredict"] += len(t)
        return repredict(self, states, t)

    monkeypatch.setattr(EmbeddingPredictor, "engine_predict", counted_predict)
    monkeypatch.setattr(RemainingProbe, "predict", counted_repredict)
    ids = encode_chat(served.tokenizer, ["what is rain", "hi", "count to five", "name a fruit", "why"])
    run = srpt.run(ids)
    assert calls["predict"] == len(ids) and calls["repredict"] > 0
    cb = served.engine(EngineConfig(max_batch_size=2, max_new_tokens=40, prefix_cache=0))
    assert run.tokens == [r.output for r in cb.generate(ids, SamplingParams(max_tokens=40))]
    assert run.wall_s >= max(run.finish_s) > 0 and math.isfinite(run.metrics()["mean_latency_s"])
    report = srpt.report(ids, [float(len(t)) for t in run.tokens])
    assert report["preemptions"] == srpt.preemptions and {"mae", "acc50"} <= set(
        report["length_predictor_test"]
    )


def test_bench_serve_simulates_every_policy_it_ran(bench_serve):
    true = [3.0, 12.0, 2.0, 7.0, 5.0, 9.0]
    policy = {"samples_per_s": 1.0, "effective_token_ratio": 0.5, "speedup_vs_fcfs": 1.0, "wall_s": 6.0}
    result = {
        "setup": {"prompt_lens": [4] * 6, "true_lengths": true, "predicted_lengths": true, "batch_size": 2,
                  "max_new_tokens": 10, "aging": 0.5},
        "predictor": {"predict_s": 0.0},
        "policies": {p: dict(policy) for p in ("fcfs", "oracle", "cb", "cb-ljf")},
    }  # fmt: skip
    sim = bench_serve.simulate_measured(result, cost_path=None)["policies"]
    assert set(sim) == {"fcfs", "oracle", "cb", "cb-ljf"}
    assert sim["fcfs"]["speedup"] == 1.0
    assert sim["cb"]["effective_token_ratio"] == sim["cb-ljf"]["effective_token_ratio"] == 1.0
    assert sim["oracle"]["effective_token_ratio"] > sim["fcfs"]["effective_token_ratio"]


def test_bench_rejects_unknown_policy(capsys, bench_serve):
    assert bench_serve.main(["--model", "tiny", "--policies", "fcfs,lifo"]) == 2
    assert "lifo" in capsys.readouterr().err


def test_bench_runs_cb_ljf_when_asked(tmp_path, bench_serve):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say something about {i}"}) + "\n" for i in range(5)))
    out = tmp_path / "bench.json"
    args = "--model tiny --n 5 --max-new-tokens 6 --batch-size 2 --predictor oracle".split()
    args += ["--prompts", str(prompts), "--policies", "fcfs,cb,cb-ljf", "--json", str(out)]
    assert bench_serve.main(args) == 0
    result = json.loads(out.read_text())
    assert set(result["policies"]) == {"fcfs", "cb", "cb-ljf"}
    assert all(m["outputs_match_fcfs"] for m in result["policies"].values())
    assert result["command"] == "python bench/serve.py " + shlex.join(
        args
    )  # the arguments given, not the host process's


def test_bench_defaults_say_they_run_long(monkeypatch, capsys, bench_serve):
    monkeypatch.setattr(bench_serve, "run_bench", lambda config: (_ for _ in ()).throw(KeyboardInterrupt))
    assert bench_serve.main([]) == 130
    assert "note: " in capsys.readouterr().err


def test_instruction_prompts_are_the_workload_s_and_its_labels_are_the_default(tmp_path, bench_serve):
    from ecru.serve.prompts import load_prompts
    from ecru.serve.workload import build_mixed_workload

    REPO_INSTRUCTION_LABELS, REPO_LABELS = bench_serve.REPO_INSTRUCTION_LABELS, bench_serve.REPO_LABELS
    BenchConfig, labels_path = bench_serve.BenchConfig, bench_serve.labels_path

    def committed(name: str) -> set[str]:
        return {json.loads(line)["prompt"] for line in REPO_LABELS.with_name(name).read_text().splitlines()}

    # the instruction workload in its own order: its first 240 test prompts are the ones
    # bench/experiments/serve_workload.py --test 240 labelled (the labels file is in labelling order), and so
    # on
    got = load_prompts("instructions", n=240, split="test")
    assert got == [p.prompt for p in build_mixed_workload()["test"][:240]]
    assert set(got) == committed("serve_workload_labels_test.jsonl")
    assert set(load_prompts("instructions", n=1000, split="train")) == committed(REPO_INSTRUCTION_LABELS.name)
    assert not set(load_prompts("mixed", n=50)) & set(got)  # "mixed" stays the CLINC/Banking queries
    assert labels_path(BenchConfig(prompts="instructions")) == REPO_INSTRUCTION_LABELS
    assert labels_path(BenchConfig(prompts="mixed")) == REPO_LABELS
    mine = tmp_path / "mine.jsonl"
    assert labels_path(BenchConfig(prompts="instructions", labels=str(mine))) == mine


def test_a_misspelt_prompt_source_is_refused_before_any_model_loads(capsys, monkeypatch, bench_serve):
    import ecru.serve.engine.models

    monkeypatch.setattr(ecru.serve.engine.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert bench_serve.main(["--model", "tiny", "--prompts", "instrutions", "--n", "2"]) == 2
    err = capsys.readouterr().err
    assert "instrutions not found" in err and "instructions" in err and len(err.strip().splitlines()) == 1


def test_every_flag_has_help_and_numbers_are_validated(bench_serve, capsys):
    flags = [a for a in bench_serve.build_parser()._actions if a.option_strings and a.dest != "help"]
    assert all(a.help for a in flags) and not [a for a in flags if a.type in (int, float) and not a.choices]
    with pytest.raises(SystemExit) as info:
        bench_serve.main(["--n", "-10"])
    assert info.value.code == 2 and "--n" in capsys.readouterr().err
