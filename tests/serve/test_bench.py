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


def test_lora_readout_is_validated_and_shares_the_tuned_adapter(tmp_path, monkeypatch):
    from ecru.serve import bench
    from ecru.serve.models import load_model
    from ecru.serve.self_predict import SelfLoRAPredictor

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


def test_every_predictor_the_cli_offers_is_one_the_benchmark_builds(monkeypatch):
    import argparse

    from ecru.serve import bench, cli
    from ecru.serve.models import load_model
    from ecru.serve.predictors import EmbeddingPredictor

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    flag = next(a for a in sub._actions if a.dest == "predictor")
    assert tuple(flag.choices) == bench.PREDICTORS
    monkeypatch.setattr(
        bench, "train_labels", lambda *a: (["a short one", "tell me a long story", "hi"], [5, 90, 2])
    )
    model, tok = load_model("tiny")
    built = bench.build_predictor(model, tok, BenchConfig(model="tiny", predictor="embed"), {})
    assert isinstance(built, EmbeddingPredictor) and len(built.predict(["a question"])) == 1


def test_the_bench_runs_cb_srpt_as_it_ships(chat_model_dir, tmp_path, monkeypatch):
    """Plain cb-srpt in `ecru serve bench` is the engine's shipped configuration: the FCFS deadline, kept KV,
    the embedding predictor per request and re-predictions by the probe `ecru serve probe` fits, both fitted
    on the train prompts' greedy answers; greedy answers as cb's."""
    import json
    import math

    from ecru.serve.bench import BENCH_POLICIES, ShippedSRPT
    from ecru.serve.models import ServedModel
    from ecru.serve.names import FCFS_SLACK
    from ecru.serve.predictors import EmbeddingPredictor
    from ecru.serve.prompts import encode_chat
    from ecru.serve.remaining import RemainingProbe
    from ecru.serve.sampling import SamplingParams
    from ecru.serve.scheduler import EngineConfig

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
