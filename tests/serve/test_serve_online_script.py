"""bench/serve_online.py's helpers: arrivals, resampling, re-prediction metrics, static and online tables."""

import os
import time

import pytest
import torch

from ecru.errors import EcruError
from ecru.serve.sched.scheduler import EngineConfig
from ecru.serve.sim.cost import CostModel, StepWork
from tests.bench_scripts import load_bench_script

from .conftest import RunsLong

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


def small_online_tables(bench, **kw) -> dict:
    """online_tables on 40 prompts of four lengths, perfect free probe predictions and re-predictions."""
    lengths = [3, 60, 8, 120] * 10
    idx = bench.resample(len(lengths), 200, seed=0)
    preds = {"constant": ([50.0] * 40, 0.0), "probe": (list(map(float, lengths)), 0.0)}
    traj = [[n - t for t in range(0, n, 16)] for n in lengths]
    base = EngineConfig(max_batch_size=4, max_new_tokens=128)
    return bench.online_tables(idx, [5] * 40, lengths, preds, traj, 0.0, base, UNIT, seed=0, **kw)


def test_online_tables_report_every_policy_at_every_load(bench):
    out = small_online_tables(bench)
    assert set(out["loads"]) == {"0.8", "1.2", "2.0"}
    for load in out["loads"].values():
        pols = load["policies"]
        assert {"fcfs", "cb", "cb-sjf", "cb-srpt", "oracle-srpt", "cb-sjf[at-arrival]", "cb-srpt[no-deadline]",
                "cb-srpt[recompute]", "cb-srpt[no-preempt]"} <= set(pols)  # fmt: skip
        for r in pols.values():
            assert {"mean_latency_s", "p99_latency_s", "tokens_per_s", "peak_kv_tokens"} <= set(r)
        # with perfect predictions and no prediction cost, shortest-first without preemption is oracle SJF
        assert pols["cb-sjf"]["mean_latency_s"] == pytest.approx(
            pols["oracle-srpt[no-preempt][no-deadline]"]["mean_latency_s"]
        )
        # perfect predictions: the shipped cb-srpt is the oracle's
        assert pols["cb-srpt"]["mean_latency_s"] == pytest.approx(pols["oracle-srpt"]["mean_latency_s"])
    assert out["shipped_predictor"] == "probe"  # no `embed` among these predictors: the first learned one


def test_online_tables_with_a_slack_add_the_fcfs_deadline_policies(bench):
    out = small_online_tables(bench, slack=0.2)
    pols = out["loads"]["1.2"]["policies"]
    assert {"cb-sjf[fcfs-slack]", "cb-srpt[fcfs-slack]", "cb-sjf[at-arrival][fcfs-slack]",
            "oracle-srpt[no-preempt][fcfs-slack]"} <= set(pols)  # fmt: skip
    # perfect free predictions: the deadline policy without preemption is the oracle's with the same deadline
    assert pols["cb-sjf[fcfs-slack]"]["mean_latency_s"] == pytest.approx(
        pols["oracle-srpt[no-preempt][fcfs-slack]"]["mean_latency_s"]
    )


def test_slack_curve_trades_mean_for_tail(bench):
    lengths = [3, 200, 5, 150, 4, 8] * 40
    idx = bench.resample(len(lengths), 1500, seed=1)
    base = EngineConfig(max_batch_size=2, max_new_tokens=256, refill_min=1)
    capacity = bench.saturated_capacity(idx, [5] * len(lengths), lengths, base, UNIT)
    arrivals = bench.poisson_arrivals(len(idx), 1.2 * capacity, seed=2)
    trace = bench.build_trace(idx, arrivals, [5] * len(lengths), lengths, list(map(float, lengths)), None)
    curve = bench.slack_curve(trace, base, UNIT, 0.0)
    tight, loose = curve[str(min(bench.SLACKS))], curve[str(max(bench.SLACKS))]
    assert loose["mean_latency_x_cb"] < tight["mean_latency_x_cb"] < 1
    assert loose["p99_latency_x_cb"] > tight["p99_latency_x_cb"]


def test_oof_predictions_never_see_their_own_label(bench):
    class OneHot:  # in-sample, ridge on one-hot features memorizes every label; out of fold it cannot
        lam, cap = 1e-6, 1000

        def features(self, prompts):
            return torch.eye(len(prompts))[list(prompts)]

    labels = [float(10 * i) for i in range(20)]
    pred = bench.oof_predictions(OneHot(), list(range(20)), labels)
    for i, p in enumerate(pred):  # a held-out one-hot has no weight: the other folds' mean label
        others = [y for j, y in enumerate(labels) if j % 5 != i % 5]
        assert p == pytest.approx(sum(others) / len(others), rel=1e-4)


def test_real_engine_serves_a_poisson_trace_alike_under_every_policy():
    real = load_bench_script("serve_online_real")
    from ecru.serve.engine.models import ServedModel
    from ecru.serve.engine.request_engine import EngineConfig
    from ecru.serve.prompts import encode_chat

    served = ServedModel.load("tiny")
    texts = ["hi", "tell me a story", "what time is it", "list five fruits", "why", "a b c"]
    ids = encode_chat(served.tokenizer, texts)

    arrivals = real.poisson_arrivals(len(texts), 50.0, seed=0)
    outputs = []
    for name, (policy, overrides, _) in real.policies(0.25).items():
        config = EngineConfig(
            policy=policy, max_new_tokens=8, max_batch_size=2, repredict_every=2, **overrides
        )
        probe = RunsLong()
        r = real.serve_real(served, ids, arrivals, lambda prompt: float(len(prompt)), probe, config, 8)
        assert 0 < r["mean_latency_s"] <= r["p99_latency_s"] <= r["max_latency_s"] < r["wall_s"] + 1e-9, name
        assert bool(probe.seen) == (policy == "cb-srpt")  # re-predicted while generating, only there
        work = sum((w for w, _ in r["steps"]), StepWork())  # every engine forward, in the steps it ran in
        assert (r["predict_s_per_request"] > 0) == (policy != "cb")  # timed as add_request pays it
        assert work.decode_steps == r["decode_steps"] and work.prefills == r["prefill_forwards"] > 0
        outputs.append(r["outputs"])
    assert len(outputs) == 4 and all(o == outputs[0] for o in outputs)  # greedy: admission changes no answer


def test_the_embedding_predictor_reads_the_ids_the_engine_is_given():
    real = load_bench_script("serve_online_real")
    from ecru.serve import EmbeddingPredictor
    from ecru.serve.engine.models import ServedModel
    from ecru.serve.prompts import encode_chat

    served = ServedModel.load("tiny")
    train, labels = ["hi", "tell me a story", "why", "list five fruits", "a b c"], [2.0, 8.0, 1.0, 6.0, 3.0]
    test = ["what time is it", "write a poem"]
    ids = encode_chat(served.tokenizer, test)
    predict_one = real.prompt_predictor("embed", served, train, labels, ids, test, 8)
    ref = EmbeddingPredictor(served.model, served.tokenizer, cap=8).fit(train, labels)
    # the engine's ids of a chat request are the text templated: the same features as the text's
    assert [predict_one(i) for i in ids] == pytest.approx(ref.predict(test), rel=1e-6)
    got, seconds = real.predict_one_by_one(predict_one, ids)
    assert got == [predict_one(i) for i in ids] and seconds > 0


def test_mirrored_runs_average_every_number_and_keep_each_run():
    real = load_bench_script("serve_online_real")
    runs = [{"mean_latency_s": 2.0, "decode_steps": 10, "outputs": [[1]], "latencies_s": [2.0]},
            {"mean_latency_s": 4.0, "decode_steps": 11, "outputs": [[1]], "latencies_s": [4.0]}]  # fmt: skip
    m = real.merged(runs)
    assert m["mean_latency_s"] == 3.0 and m["decode_steps"] == 10.5 and m["outputs"] == [[1]]
    assert [r["mean_latency_s"] for r in m["runs"]] == [2.0, 4.0] and "outputs" not in m["runs"][0]
    assert real.merged(runs[:1]) is runs[0]
    with pytest.raises(SystemExit):
        real.merged([runs[0], {**runs[1], "outputs": [[2]]}])


def test_order_takes_cb_and_any_other_policies_each_once(tmp_path):
    real = load_bench_script("serve_online_real")
    out = str(tmp_path / "r.json")
    args, _ = real.parse(["--json", out, "--order", "cb,cb-srpt[fcfs-slack]", "--mirror"])
    assert args.order == ["cb", "cb-srpt[fcfs-slack]"] and args.mirror
    assert real.parse(["--json", out])[0].order == list(real.policies(0.15))
    for bad in ("cb-sjf", "cb,cb", "cb,fifo"):
        with pytest.raises(SystemExit):
            real.parse(["--json", out, "--order", bad])


def test_read_split_gives_greedy_lengths_and_the_longest_of_samples(bench, tmp_path):
    path = tmp_path / "labels.jsonl"
    path.write_text(
        '{"prompt": "a", "lengths": [30, 80, 20, 300]}\n{"prompt": "b", "lengths": [9, 4, 7, 5]}\n'
    )
    assert bench.read_split(path, 10, 256) == (["a", "b"], [30, 9], [30, 9])
    assert bench.read_split(path, 10, 256, samples=4) == (["a", "b"], [30, 9], [256, 9])  # capped at 256
    with pytest.raises(EcruError, match="fewer than 4 answer lengths"):
        path.write_text('{"prompt": "a", "lengths": [30]}\n')
        bench.read_split(path, 10, 256, samples=4)


def test_concurrent_runs_each_item_in_its_own_process_in_order(tmp_path):
    real = load_bench_script("serve_online_real")
    got = real.concurrently(lambda x: (x * 2, os.getpid()), [3, 1, 2])
    assert [g[0] for g in got] == [6, 2, 4]
    assert len({g[1] for g in got}) == 3 and os.getpid() not in {g[1] for g in got}
    with pytest.raises(SystemExit, match="ZeroDivisionError"):
        real.concurrently(lambda x: 1 / x, [1, 0])
    slow = real.concurrently(lambda x: time.sleep(x) or x, [0.3, 0.0])  # results in order, not as they come
    assert slow == [0.3, 0.0]
    out = str(tmp_path / "r.json")
    both = ["--json", out, "--concurrent", "--order", "cb,cb-srpt[fcfs-slack]"]
    assert real.parse([*both, "--rate-from", "engine"])[0].concurrent
    for bad in (["--rate-from", "engine", "--mirror"], []):  # mirrored, or loaded against the simulator
        with pytest.raises(SystemExit):
            real.parse(both + bad)


def test_summary_lists_each_rounds_ratios_and_their_median():
    real = load_bench_script("serve_online_real")

    def side(mean: float, p99: float) -> dict:
        return {"mean_latency_x_cb": mean, "p99_latency_x_cb": p99}

    rounds = [{"real": {"x": side(m, p)}, "simulated_engine_cost": {"x": side(m + 0.1, p + 0.1)},
               "simulated_own_cost": {"x": side(m + 0.2, p)}}
              for m, p in ((0.7, 1.3), (0.9, 1.1), (0.8, 1.2))]  # fmt: skip
    s = real.summary(rounds, ["x"])["x"]
    assert s["real_mean_x_cb"] == [0.7, 0.9, 0.8] and s["real_mean_x_cb_median"] == 0.8
    assert s["real_p99_x_cb_median"] == 1.2
    assert s["simulated_engine_cost_mean_x_cb_median"] == pytest.approx(0.9)
    assert s["simulated_own_cost_mean_x_cb_median"] == pytest.approx(1.0)


def test_requests_are_distinct_prompts_while_they_last_then_drawn_again():
    real = load_bench_script("serve_online_real")
    import random

    few = real.draw_prompts(240, 120, seed=0)
    assert few == random.Random(0).sample(range(240), 120)  # as the committed runs of 120 and 240 drew them
    many = real.draw_prompts(240, 1000, seed=0)
    assert len(many) == 1000 and set(many[:240]) == set(range(240)) and set(many[240:]) <= set(range(240))
