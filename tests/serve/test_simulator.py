"""Simulator accounting on small traces computed by hand, and through `ecru serve simulate`."""

import json
from dataclasses import astuple

import pytest
import torch

from ecru.cli import main
from ecru.serve import SMOLLM2_CPU, CostModel, PlanConfig, TraceRequest, simulate

# (output_len, predicted_len); prompt_len 10 everywhere. batch_size 2, max_new_tokens 10.
ROWS = [(3, 5), (12, 4), (2, 2), (7, 9), (5, 6)]
TRACE = [TraceRequest(10, o, p) for o, p in ROWS]
CONFIG = PlanConfig(batch_size=2, max_new_tokens=10)
USEFUL = 3 + 10 + 2 + 7 + 5  # B is truncated to the cap


@pytest.mark.parametrize(
    ("policy", "slots", "failures", "steps"),
    [
        # fcfs: [A,B] 10 steps, [C,D] 7, [E] 5
        ("fcfs", 2 * 10 + 2 * 7 + 1 * 5, 0, 22),
        # sorted by prediction C,B,A,E,D: [C,B] 10, [A,E] 5, [D] 7
        ("sorted", 2 * 10 + 2 * 5 + 1 * 7, 0, 22),
        # fcr: [C,B] cap 4 -> 4 steps, B fails; [A,E] cap 6 -> 5; [D] cap 9 -> 7; rerun [B] 10
        ("fcr", 2 * 4 + 2 * 5 + 1 * 7 + 1 * 10, 1, 26),
        # oracle sorts by true length C,A,E,D,B: [C,A] 3, [E,D] 7, [B] 10
        ("oracle", 2 * 3 + 2 * 7 + 1 * 10, 0, 20),
    ],
)
def test_hand_computed_accounting(policy, slots, failures, steps):
    r = simulate(TRACE, policy=policy, config=CONFIG)
    assert (r.padded_slots, r.failures, r.batch_steps, r.useful_tokens) == (slots, failures, steps, USEFUL)
    assert r.effective_token_ratio == USEFUL / slots
    assert r.failure_ratio == failures / 5


def test_fcr_reruns_in_failure_order_in_batches():
    # batch_size 2, cap 10; predictions 1 for all: every first-attempt batch is capped at 1
    trace = [TraceRequest(4, o, 1) for o in (1, 5, 8, 3, 1)]
    r = simulate(trace, policy="fcr", config=PlanConfig(batch_size=2, max_new_tokens=10))
    # first attempts [0,1] [2,3] [4]: 1 step each; failures 1,2,3 rerun as [1,2] (8 steps), [3] (3 steps)
    assert r.padded_slots == 2 + 2 + 1 + 2 * 8 + 1 * 3
    assert (r.failures, r.batches, r.rerun_batches) == (3, 5, 2)
    assert r.useful_tokens == 1 + 5 + 8 + 3 + 1


def test_resumed_reruns_prefill_what_failed_rows_had_and_run_only_the_rest():
    # as test_fcr_reruns_in_failure_order_in_batches: rows 1, 2, 3 fail at cap 1 with 1 token each; resumed,
    # [1, 2] prefills prompt 4 + 1 and runs max(5, 8) - 1 = 7 steps, [3] runs 3 - 1 = 2
    trace = [TraceRequest(4, o, 1) for o in (1, 5, 8, 3, 1)]
    config = PlanConfig(batch_size=2, max_new_tokens=10, resume=True)
    r = simulate(trace, policy="fcr", config=config)
    assert r.padded_slots == 2 + 2 + 1 + 2 * 7 + 1 * 2
    assert (r.failures, r.batches, r.rerun_batches, r.useful_tokens) == (3, 5, 2, 1 + 5 + 8 + 3 + 1)
    cost = CostModel(1.0, 0.0, 0.0, 0.0, 1.0)  # a decode step costs 1 s, a prefilled position 1 s
    timed = simulate(trace, policy="fcr", config=config, cost=cost)
    # first attempts: prefills of 2 x 4, 2 x 4, 1 x 4 (one step each); reruns: 2 x 5 + 6 steps, 1 x 5 + 1 step
    assert timed.time_s == pytest.approx(8 + 8 + 4 + (10 + 6) + (5 + 1))
    kept = PlanConfig(batch_size=2, max_new_tokens=10, resume=True, keep_kv=True)
    timed_kept = simulate(trace, policy="fcr", config=kept, cost=cost)
    # the same slots; the reruns' KV was kept: no prefill, each step a decode step (7 and 2)
    assert timed_kept.padded_slots == r.padded_slots
    assert timed_kept.time_s == pytest.approx(8 + 8 + 4 + 7 + 2)
    # the contexts: [1, 2] holds 4 + 1 - 1 = 4 positions, its 7 steps run at contexts 5..11, [3] at 5..6
    context = CostModel(0.0, 0.0, 1.0, 0.0, 0.0)  # a row-position of context costs 1 s per decode step
    ctx_kept = simulate(
        trace, policy="fcr", config=kept, cost=context
    ).time_s  # first attempts: prefills only
    assert ctx_kept == pytest.approx(2 * sum(range(5, 12)) + 1 * sum(range(5, 7)))


def test_a_resumed_row_stops_at_the_global_cap():
    # row 0 fails at cap 3 and would run 30: resumed it may generate only 10 - 3 = 7 more
    trace = [TraceRequest(4, 30, 3), TraceRequest(4, 2, 3)]
    r = simulate(trace, policy="fcr", config=PlanConfig(batch_size=2, max_new_tokens=10, resume=True))
    assert (r.failures, r.padded_slots, r.useful_tokens) == (1, 2 * 3 + 7, 10 + 2)


def test_rows_of_one_resumed_rerun_stop_at_their_own_budgets():
    # [0, 1] cap 1: row 1 fails with 1 token; [2, 3] cap 8: row 2 fails with 8. Their rerun (cap 10 - 1 = 9)
    # runs 5 steps: row 1 needs 6 - 1 = 5 more, row 2 may add only 10 - 8 = 2 although its answer runs to 30
    trace = [TraceRequest(4, 1, 1), TraceRequest(4, 6, 1), TraceRequest(4, 30, 8), TraceRequest(4, 1, 8)]
    r = simulate(trace, policy="fcr", config=PlanConfig(batch_size=2, max_new_tokens=10, resume=True))
    assert (r.failures, r.padded_slots, r.useful_tokens) == (2, 2 * 1 + 2 * 8 + 2 * 5, 1 + 6 + 10 + 1)


def test_prediction_at_or_above_global_cap_cannot_fail():
    trace = [TraceRequest(4, 30, 20), TraceRequest(4, 2, 1)]
    r = simulate(trace, policy="fcr", config=PlanConfig(batch_size=2, max_new_tokens=20))
    assert r.failures == 0 and r.padded_slots == 2 * 20 and r.useful_tokens == 20 + 2


def test_time_uses_cost_model_per_batch():
    cost = CostModel(1.0, 0.1, 0.01, 2.0, 0.5)
    trace = [TraceRequest(3, 4, 4), TraceRequest(5, 2, 2)]
    r = simulate(
        trace, policy="fcfs", config=PlanConfig(batch_size=2, max_new_tokens=10), cost=cost, predict_s=1.5
    )
    # one batch: prefill of 2 x 5, then 3 decode steps at contexts 6, 7, 8
    expected = 2.0 + 0.5 * 10 + sum(1.0 + 0.1 * 2 + 0.01 * 2 * c for c in (6, 7, 8))
    assert r.time_s == pytest.approx(1.5 + expected, rel=1e-12)
    assert cost.batch_time(2, 5, 4) == pytest.approx(expected, rel=1e-12)


def test_cost_model_roundtrip(tmp_path):
    SMOLLM2_CPU.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == SMOLLM2_CPU


def write_trace(path, rows):
    path.write_text(
        "".join(json.dumps({"prompt_len": 10, "output_len": o, "predicted_len": p}) + "\n" for o, p in rows)
    )


@pytest.mark.parametrize("policy", ["fcfs", "sorted", "fcr", "fcr+vbs", "cb", "cb-sjf", "cb-kv"])
def test_cli_simulate_writes_json(tmp_path, policy):
    write_trace(tmp_path / "t.jsonl", ROWS)
    code = main(
        [
            "serve",
            "simulate",
            "--trace",
            str(tmp_path / "t.jsonl"),
            "--policy",
            policy,
            "--batch-size",
            "2",
            "--max-new-tokens",
            "10",
            "--json",
            str(tmp_path / "o.json"),
        ]
    )
    out = json.loads((tmp_path / "o.json").read_text())
    assert code == 0 and out["useful_tokens"] == USEFUL
    assert out["effective_token_ratio"] == pytest.approx(USEFUL / out["padded_slots"])
    if policy == "fcr":
        assert out["padded_slots"] == 35 and out["failure_ratio"] == 0.2
    if policy in ("cb", "cb-sjf"):  # refill at 4 free rows never triggers with 2 rows: each pair runs alone
        assert out["padded_slots"] == USEFUL and out["batches"] == 3
    if policy == "cb-kv":  # the memory of 2 cap-length rows (padding counted), shared by the reservations
        from ecru.serve import EngineConfig, FCFSQueue, simulate_continuous

        config = EngineConfig("cb-kv", max_batch_size=2, max_new_tokens=10, kv_prompt_tokens=10)
        ref, _ = simulate_continuous(TRACE, queue=FCFSQueue(), config=config, reserve=[p for _, p in ROWS])
        assert (out["padded_slots"], out["batches"], out["failures"]) == (
            ref.padded_slots,
            ref.batches,
            ref.failures,
        )
        cb, _ = simulate_continuous(
            TRACE, queue=FCFSQueue(), config=EngineConfig(max_batch_size=2, max_new_tokens=10)
        )
        assert (ref.batch_steps, cb.batch_steps) == (11, 15)  # more rows decode together in the same memory


def test_cli_simulate_bad_trace_is_one_line_error(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text('{"prompt_len": 3}\n')
    assert main(["serve", "simulate", "--trace", str(tmp_path / "t.jsonl")]) == 2
    assert "output_len" in capsys.readouterr().err
    write_trace(tmp_path / "u.jsonl", [(3, None)])
    assert main(["serve", "simulate", "--trace", str(tmp_path / "u.jsonl"), "--policy", "sorted"]) == 2
    assert "predicted_len" in capsys.readouterr().err
    for name, data in (("bytes", b'{"prompt_len": 3, "output_len": 2}\n\xff\xfe\n'), ("list", b"[1, 2]\n")):
        (tmp_path / name).write_bytes(data)
        assert main(["serve", "simulate", "--trace", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"{name}:2: not valid UTF-8" in err if name == "bytes" else f"{name}:1: expected" in err


def test_measure_cost_model_on_tiny_model(model):
    from ecru.serve import measure_cost_model

    cost = measure_cost_model(
        model, batches=(1, 4), contexts=(8, 32), prompt_lens=(4, 16), reps=2, source="tiny"
    )
    assert cost.source == "tiny" and cost.step_time(4, 32) > 0 and cost.prefill_time(4, 16) > 0


def test_fit_cost_model_recovers_known_coefficients_and_keeps_them_non_negative():
    from ecru.serve import StepWork, fit_cost_model

    truth = CostModel(0.05, 0.002, 2e-5, 0.07, 0.003)
    work = [StepWork.of_forward(b, 1, ctx) for b in (1, 3, 16, 40) for ctx in (20, 90, 300)]
    work += [StepWork.of_forward(b, p, p) for b in (1, 5) for p in (12, 70)]
    work += [work[0] + work[-1], work[5] + work[6] + work[7]]  # steps running several forwards
    fitted = fit_cost_model(work, [truth.time(w) for w in work], source="synthetic")
    for got, want in zip(astuple(fitted)[:5], astuple(truth)[:5], strict=True):
        assert got == pytest.approx(want, rel=1e-9)
    # times falling with batch size: unconstrained least squares would give a negative per-row cost
    falling = [StepWork.of_forward(b, 1, 11) for b in (1, 2, 4)] + [StepWork.of_forward(1, 5, 5)]
    fitted = fit_cost_model(falling, [0.3, 0.2, 0.1, 0.5], source="falling")
    assert min(astuple(fitted)[:5]) >= 0 and fitted.step_per_row == 0.0
    with pytest.raises(ValueError, match="as many timings"):
        fit_cost_model(falling, [0.1], source="short")


def test_step_work_charges_a_forward_as_the_simulators_do():
    from ecru.serve import StepWork

    decode, prefill = (
        StepWork.of_forward(4, 1, 33),
        StepWork.of_forward(3, 7, 20),
    )  # 13 cached prefix positions
    assert decode == StepWork(decode_steps=1, decode_rows=4, decode_row_ctx=4 * 33)
    assert prefill == StepWork(prefills=1, prefill_tokens=3 * 20)
    assert SMOLLM2_CPU.time(decode + prefill) == pytest.approx(
        SMOLLM2_CPU.step_time(4, 33) + SMOLLM2_CPU.prefill_time(3, 20), rel=1e-12
    )


def test_recorded_forwards_of_a_static_batch_cost_what_the_simulator_charges(model, gen):
    from ecru.serve import StepWork, generate_static, record_forwards

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (9, 5, 7)]
    with record_forwards(model) as seen:
        result = generate_static(model, prompts, max_new_tokens=12, config=gen)
    steps = max(len(t) for t in result.tokens)
    assert steps > 1 and len(seen) == steps  # one prefill, then a decode step per further token
    assert SMOLLM2_CPU.time(sum(seen, StepWork())) == pytest.approx(
        SMOLLM2_CPU.batch_time(3, 9, steps), rel=1e-12
    )


def test_record_forwards_sees_every_engine_forward_and_only_within_the_block(model, prompts, gen):
    from ecru.serve import EngineConfig, RequestEngine, SamplingParams, StepWork, record_forwards

    engine = RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id,
                           config=EngineConfig(max_new_tokens=6, max_batch_size=3))  # fmt: skip
    with record_forwards(model) as seen:
        engine.generate(prompts[:5], SamplingParams(max_tokens=6))
    total = sum(seen, StepWork())
    assert total.decode_steps == engine.stats.decode_steps > 0
    assert total.prefills == engine.stats.prefill_forwards > 0
    # stats.tokens: one per decoded row per step, one per prompt prefilled
    assert total.decode_rows == engine.stats.tokens - 5
    n = len(seen)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))
    assert len(seen) == n  # the hook is gone after the block


def test_fcr_zero_prediction_runs_nothing_and_fails_every_nonempty_row():
    trace = [TraceRequest(4, 3, 0), TraceRequest(4, 0, 0), TraceRequest(4, 5, 6)]
    r = simulate(trace, policy="fcr", config=PlanConfig(batch_size=2, max_new_tokens=10))
    # [0,1] cap 0: 0 steps, row 0 fails (3 > 0), row 1 (length 0) completes; [2] cap 6: 5 steps; rerun [0]: 3
    assert (r.padded_slots, r.failures, r.useful_tokens) == (0 + 5 + 3, 1, 8)


def test_zero_cap_batch_costs_no_time_like_the_runner():
    # step 1 s, prefill 2 s, nothing per row or token: a batch of S >= 1 steps takes 2 + (S - 1) s
    cost = CostModel(1.0, 0.0, 0.0, 2.0, 0.0)
    trace = [TraceRequest(4, 3, 0), TraceRequest(4, 2, 0), TraceRequest(4, 5, 6)]
    r = simulate(trace, policy="fcr", config=PlanConfig(batch_size=2, max_new_tokens=10), cost=cost)
    # [0,1] cap 0: skipped (0 s), both fail; [2] cap 6: 5 steps, 6 s; rerun [0,1] at 10: 3 steps, 4 s
    assert (r.padded_slots, r.batch_steps, r.failures, r.batches, r.rerun_batches) == (11, 8, 2, 3, 1)
    assert r.time_s == pytest.approx(0 + 6 + 4, rel=1e-12)
    assert r.mean_latency_s == pytest.approx((10 + 10 + 6) / 3, rel=1e-12)
    assert cost.batch_time(2, 4, 0) == 0.0 and cost.batch_time(2, 4, 1) == 2.0


@pytest.mark.parametrize("policy", ["fcfs", "sorted", "fcr", "fcr+vbs", "oracle"])
def test_simulator_accounting_equals_the_real_runner(model, prompts, reference, gen, policy):
    from ecru.serve import run_policy

    true = [len(r) for r in reference]
    predicted = true if policy == "oracle" else [(0, 1, t, t + 4)[i % 4] for i, t in enumerate(true)]
    config = PlanConfig(batch_size=4, max_new_tokens=24, token_budget=100)
    run = run_policy(model, prompts, policy=policy, predicted=predicted, gen=gen, plan=config)
    trace = [TraceRequest(len(p), t, q) for p, t, q in zip(prompts, true, predicted, strict=True)]
    sim = simulate(trace, policy=policy, config=config)
    assert (sim.padded_slots, sim.failures, sim.useful_tokens) == (run.slots, run.failures, run.useful)


def test_scaled_cost_model_scales_time():
    trace = [TraceRequest(3, 4, 4), TraceRequest(5, 9, 2)]
    config = PlanConfig(batch_size=2, max_new_tokens=10)
    base = simulate(trace, policy="fcfs", config=config).time_s
    slow = simulate(trace, policy="fcfs", config=config, cost=SMOLLM2_CPU.scaled(2.5)).time_s
    assert slow == pytest.approx(2.5 * base, rel=1e-12)


def test_continuous_hand_computed():
    from ecru.serve import EngineConfig, FCFSQueue, simulate_continuous

    # 2 rows, refill when 1 is free; lengths 3, 1, 4, 2 (cap 10), all arriving at step 0.
    trace = [TraceRequest(5, n) for n in (3, 1, 4, 2)]
    config = EngineConfig(max_batch_size=2, max_new_tokens=10, refill_min=1)
    r, order = simulate_continuous(trace, queue=FCFSQueue(), config=config)
    # prefill [0,1]: 1 done at once; decode 1 row (step 1: 0 has 2); admit [2]; step 2: 0 done, 2 has 2;
    # admit [3]; step 3: 2 has 3, 3 done; step 4: 2 done
    assert order == [0, 1, 2, 3]
    assert (r.batches, r.batch_steps, r.padded_slots, r.useful_tokens) == (3, 4, 4 + 1 + 2 + 2 + 1, 10)
    assert r.effective_token_ratio == 1.0


def test_continuous_latency_counts_from_arrival():
    from ecru.serve import EngineConfig, FCFSQueue, simulate_continuous

    cost = CostModel(1.0, 0.0, 0.0, 0.0, 0.0)  # 1 s per decode step, prefill free
    trace = [TraceRequest(1, 3), TraceRequest(1, 2)]
    config = EngineConfig(max_batch_size=1, max_new_tokens=10, refill_min=1)
    r, _ = simulate_continuous(trace, queue=FCFSQueue(), config=config, cost=cost, arrivals=[0, 1])
    # request 0: 2 decode steps (finishes at 2 s); request 1 arrives at step 1 (1 s), runs 1 step after
    assert r.time_s == 3.0 and r.mean_latency_s == ((2 - 0) + (3 - 1)) / 2


@pytest.mark.parametrize("policy", ["cb", "cb-sjf", "cb-ljf"])
@pytest.mark.parametrize("refill_min", [1, 3])
def test_continuous_simulator_equals_the_real_loop(model, prompts, reference, gen, policy, refill_min):
    from ecru.serve import EngineConfig, generate_continuous, make_queue, simulate_continuous

    true = [len(r) for r in reference]
    predicted = [(t * 7) % 13 for t in true]  # a poor predictor: the order still has to match
    config = EngineConfig(max_batch_size=4, max_new_tokens=24, refill_min=refill_min)
    arrivals = [2 * (i // 3) for i in range(len(prompts))]

    def queue():
        return make_queue(policy, predicted, aging=0.5)

    run = generate_continuous(model, prompts, queue=queue(), gen=gen, config=config, arrivals=arrivals)
    trace = [TraceRequest(len(p), t) for p, t in zip(prompts, true, strict=True)]
    sim, order = simulate_continuous(trace, queue=queue(), config=config, arrivals=arrivals)
    assert order == run.admitted_order
    assert (sim.batch_steps, sim.batches, sim.padded_slots) == (run.decode_steps, run.prefills, run.slots)


def test_longest_first_admission_shortens_the_drain():
    from ecru.serve import EngineConfig, make_queue, simulate_continuous

    # 2 rows; FCFS admits the 10-token answer last and it runs alone; longest-first starts it at once
    trace = [TraceRequest(1, n) for n in (2, 2, 2, 2, 10)]
    config = EngineConfig(max_batch_size=2, max_new_tokens=16, refill_min=1)
    fcfs, _ = simulate_continuous(trace, queue=make_queue("cb"), config=config)
    ljf, order = simulate_continuous(
        trace, queue=make_queue("cb-ljf", [t.output_len for t in trace]), config=config
    )
    assert order[0] == 4 and ljf.batch_steps < fcfs.batch_steps
    assert (fcfs.batch_steps, ljf.batch_steps) == (2 + 9, 9)


def test_kv_budget_admission_and_preemption_hand_computed():
    from ecru.serve import EngineConfig, FCFSQueue, simulate_continuous

    # budget 1 x (10 + 10) = 20 KV tokens over 4 rows, prompts of 2, each request reserves 2 answer tokens;
    # true lengths 6, 2, 3 (cap 10)
    trace = [TraceRequest(2, n) for n in (6, 2, 3)]
    config = EngineConfig("cb-kv", max_batch_size=1, max_new_tokens=10, refill_min=1, kv_prompt_tokens=10)
    assert (config.kv_budget, config.max_rows) == (20, 4)
    r, order = simulate_continuous(trace, queue=FCFSQueue(), config=config, reserve=[2, 2, 2])
    # all three fit (3 rows x (2 + 1) = 9 padded positions). Decode 1: 1 is done; 0 and 2 reach their 2
    # reserved tokens and grow to the cap: 2 rows x (3 cached + 8 steps) = 22 > 20, so the newest (2) is
    # preempted. 2 now reserves the cap and waits while 0 (3 + 8 = 11) runs alone 4 more steps; then 2
    # runs from scratch: prefill and 2 decode steps.
    assert order == [0, 1, 2, 2]
    assert (r.batches, r.batch_steps, r.failures) == (2, 1 + 4 + 2, 1)
    assert (r.padded_slots, r.useful_tokens) == (3 + 3 + 4 + 1 + 2, 6 + 2 + 3)
    # without a budget nothing is preempted: 3 rows, 5 decode steps
    free, _ = simulate_continuous(
        trace,
        queue=FCFSQueue(),
        config=EngineConfig(max_batch_size=4, max_new_tokens=10, refill_min=1),
        reserve=[2] * 3,
    )
    assert (free.failures, free.batch_steps, free.padded_slots) == (0, 5, 11)


def test_kv_budget_simulator_equals_the_real_loop(model, prompts, reference, gen):
    from ecru.serve import EngineConfig, FCFSQueue, generate_continuous, simulate_continuous

    true = [len(r) for r in reference]
    predicted = [max(1, (t * 7) % 13) for t in true]  # poor: many rows outgrow their reservation
    config = EngineConfig("cb-kv", 4, 24, 2, kv_prompt_tokens=max(len(p) for p in prompts))
    arrivals = [2 * (i // 3) for i in range(len(prompts))]
    run = generate_continuous(
        model, prompts, queue=FCFSQueue(), gen=gen, config=config, arrivals=arrivals, reserve=predicted
    )
    assert run.tokens == reference and run.preemptions > 0
    trace = [TraceRequest(len(p), t) for p, t in zip(prompts, true, strict=True)]
    sim, order = simulate_continuous(
        trace, queue=FCFSQueue(), config=config, arrivals=arrivals, reserve=predicted
    )
    assert order == run.admitted_order
    assert (sim.batch_steps, sim.batches, sim.padded_slots, sim.failures) == (
        run.decode_steps,
        run.prefills,
        run.slots,
        run.preemptions,
    )


def _accounting_from_the_spec(rows, policy, batch_size, cap):
    """The issue's accounting, written out plainly: (padded slots, useful tokens, failures)."""
    out = [o for o, _ in rows]
    order = list(range(len(rows)))
    if policy in ("sorted", "fcr"):
        order.sort(key=lambda i: rows[i][1])  # stable: ties keep trace order
    elif policy == "oracle":
        order.sort(key=lambda i: out[i])
    slots, failed = 0, []
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        batch_cap = min(cap, max(rows[i][1] for i in batch)) if policy == "fcr" else cap
        slots += len(batch) * min(batch_cap, max(out[i] for i in batch))
        failed += [i for i in batch if batch_cap < cap and out[i] > batch_cap]
    for b in range(0, len(failed), batch_size):
        batch = failed[b : b + batch_size]
        slots += len(batch) * min(cap, max(out[i] for i in batch))
    return slots, sum(min(o, cap) for o in out), len(failed)


@pytest.mark.parametrize("seed", range(40))
def test_random_traces_follow_the_spec_accounting(seed):
    import random

    rng = random.Random(seed)
    cap, batch_size = rng.choice([8, 16, 64]), rng.randint(1, 5)
    rows = [
        (rng.randint(0, 2 * cap), rng.choice([0, rng.randint(1, 2 * cap)])) for _ in range(rng.randint(1, 23))
    ]
    trace = [TraceRequest(rng.randint(1, 30), o, p) for o, p in rows]
    config = PlanConfig(batch_size=batch_size, max_new_tokens=cap)
    for policy in ("fcfs", "sorted", "fcr", "oracle"):
        r = simulate(trace, policy=policy, config=config)
        slots, useful, failures = _accounting_from_the_spec(rows, policy, batch_size, cap)
        assert (r.padded_slots, r.useful_tokens, r.failures) == (slots, useful, failures), policy
        if slots:
            assert r.effective_token_ratio == pytest.approx(useful / slots)
        assert r.failure_ratio == failures / len(rows)


def test_cli_simulate_resume_failures(tmp_path):
    write_trace(tmp_path / "t.jsonl", ROWS)
    args = ["serve", "simulate", "--trace", str(tmp_path / "t.jsonl"), "--policy", "fcr", "--batch-size", "2"]
    args += ["--max-new-tokens", "10", "--resume-failures", "--json", str(tmp_path / "o.json")]
    assert main(args) == 0
    out = json.loads((tmp_path / "o.json").read_text())
    # as fcr above (35 slots), but B resumes from its 4 tokens: 10 - 4 = 6 rerun steps instead of 10
    assert out["padded_slots"] == 31 and out["failure_ratio"] == 0.2 and out["useful_tokens"] == USEFUL
    assert main([*args, "--keep-kv"]) == 0  # the same slots; only the rerun's modelled time changes
    kept = json.loads((tmp_path / "o.json").read_text())
    assert kept["padded_slots"] == 31 and kept["keep_kv"] and kept["time_s"] < out["time_s"]


def test_cli_keep_kv_needs_resume_failures(tmp_path, capsys):
    write_trace(tmp_path / "t.jsonl", ROWS)
    args = ["serve", "simulate", "--trace", str(tmp_path / "t.jsonl"), "--policy", "fcr", "--keep-kv"]
    assert main([*args, "--json", str(tmp_path / "o.json")]) == 2
    assert "add --resume-failures" in capsys.readouterr().err and not (tmp_path / "o.json").exists()
