"""Every policy serves the same greedy outputs in input order; FCR failures are counted and rerun."""

import pytest

from ecru.serve import (
    POLICIES,
    EngineConfig,
    FCFSQueue,
    PlanConfig,
    TraceRequest,
    generate_continuous,
    make_queue,
    plan_batches,
    run_policy,
    simulate,
)
from ecru.serve.sched.policies import continuous_config

PLAN = PlanConfig(batch_size=4, max_new_tokens=24)  # conftest's MAX_NEW


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_equals_unscheduled_greedy(model, prompts, reference, gen, policy):
    true = [len(r) for r in reference]
    predicted = [max(1, t - 3 + 5 * (i % 3)) for i, t in enumerate(true)]  # noisy: some under-predicted
    predicted = true if policy == "oracle" else predicted
    run = run_policy(model, prompts, policy=policy, predicted=predicted, gen=gen, plan=PLAN, refill_min=2)
    assert run.tokens == reference
    assert run.useful == sum(true)
    assert run.slots >= run.useful


def test_static_slots_match_hand_count(model, prompts, reference, gen):
    true = [len(r) for r in reference]
    run = run_policy(model, prompts, policy="fcfs", predicted=None, gen=gen, plan=PLAN)
    assert run.slots == sum(4 * max(true[i : i + 4]) for i in range(0, len(true), 4))
    oracle = run_policy(model, prompts, policy="oracle", predicted=true, gen=gen, plan=PLAN)
    ordered = sorted(true)
    assert oracle.slots == sum(4 * max(ordered[i : i + 4]) for i in range(0, len(true), 4))
    assert oracle.slots <= run.slots


def test_fcr_reruns_underpredicted_rows_and_counts_wasted_attempt(model, prompts, reference, gen):
    true = [len(r) for r in reference]
    predicted = [1.0] * len(true)  # every batch capped at 1 token: rows longer than 1 fail
    run = run_policy(model, prompts, policy="fcr", predicted=predicted, gen=gen, plan=PLAN)
    failed = [i for i, t in enumerate(true) if t > 1]
    assert run.failures == len(failed)
    first = len(true)  # each first-attempt batch runs exactly 1 step
    chunks = [failed[k : k + 4] for k in range(0, len(failed), 4)]  # rerun in the order they failed
    reruns = sum(len(c) * max(true[i] for i in c) for c in chunks)
    assert run.slots == first + reruns
    assert run.tokens == reference


@pytest.mark.parametrize("keep_kv", [False, True])
@pytest.mark.parametrize("policy", ["fcr", "fcr+vbs", "fcr+vbs+bins"])
def test_resumed_fcr_reruns_serve_the_same_outputs_and_compute_fewer_slots(
    model, prompts, reference, gen, policy, keep_kv
):
    true = [len(r) for r in reference]
    predicted = [max(1, t // 3) for t in true]  # every row longer than 2 fails
    plan = PlanConfig(batch_size=4, max_new_tokens=24, bin_width=4)  # bins narrow enough to fail
    restart = run_policy(model, prompts, policy=policy, predicted=predicted, gen=gen, plan=plan)
    resume = PlanConfig(batch_size=4, max_new_tokens=24, bin_width=4, resume=True, keep_kv=keep_kv)
    run = run_policy(model, prompts, policy=policy, predicted=predicted, gen=gen, plan=resume)
    assert run.tokens == reference and restart.tokens == reference
    assert run.failures == restart.failures > 0
    assert run.slots < restart.slots


def test_kept_kv_reruns_prefill_nothing(model, prompts, reference, gen, monkeypatch):
    import ecru.serve.engine.policy_runs as runner

    prefilled = []  # the rows every generate_static call prefills
    real = runner.generate_static
    monkeypatch.setattr(
        runner, "generate_static", lambda m, seqs, **kw: prefilled.append(len(seqs)) or real(m, seqs, **kw)
    )
    predicted = [max(1, len(t) // 3) for t in reference]
    for keep_kv in (False, True):
        prefilled.clear()
        plan = PlanConfig(batch_size=4, max_new_tokens=24, resume=True, keep_kv=keep_kv)
        run = run_policy(model, prompts, policy="fcr", predicted=predicted, gen=gen, plan=plan)
        assert run.tokens == reference and run.failures > 0
        # recomputed: the failed rows are prefilled a second time; kept: only the first attempts prefill
        assert sum(prefilled) == len(prompts) + (0 if keep_kv else run.failures)


@pytest.mark.parametrize(
    "name", ["batch_size", "max_new_tokens", "token_budget", "max_batch_size", "bin_width"]
)
def test_plan_sizes_must_be_positive(name):
    with pytest.raises(ValueError, match=f"{name} must be >= 1, got 0"):
        PlanConfig(**{name: 0})


def test_keep_kv_needs_resume():
    with pytest.raises(ValueError, match="resume=True"):
        PlanConfig(keep_kv=True)


@pytest.mark.parametrize("keep_kv", [False, True])
def test_a_resumed_rerun_cuts_each_row_at_its_own_budget(model, prompts, reference, gen, keep_kv):
    # rows cut at cap 2 and rows cut at cap 20 share a rerun batch: there rows that had 2 tokens may run up
    # to 22 more while rows that had 20 must stop after 4
    predicted = [2.0 if i % 2 else 20.0 for i in range(len(prompts))]
    plan = PlanConfig(batch_size=4, max_new_tokens=24, resume=True, keep_kv=keep_kv)
    first = plan_batches("fcr", predicted=predicted, prompt_lens=[len(p) for p in prompts], config=plan)
    failed = [(r, b.cap) for b in first for r in b.rows if len(reference[r]) > b.cap]
    reruns = [failed[k : k + 4] for k in range(0, len(failed), 4)]
    assert any(len({cap for _, cap in chunk}) > 1 for chunk in reruns)  # the case under test occurs
    run = run_policy(model, prompts, policy="fcr", predicted=predicted, gen=gen, plan=plan)
    assert run.failures == len(failed)
    assert run.tokens == reference and all(len(t) <= 24 for t in run.tokens)


@pytest.mark.parametrize("resume", ["restart", "resume", "keep"])
@pytest.mark.parametrize("policy", ["fcr", "fcr+vbs", "fcr+vbs+bins"])
def test_the_simulator_counts_the_runners_slots(model, prompts, reference, gen, policy, resume):
    true = [len(r) for r in reference]  # at the cap (24) a row's true length is unknown: 24 stands for >= 24
    for predicted in ([max(1, t // 3) for t in true], [2.0 if i % 2 else 20.0 for i in range(len(true))]):
        plan = PlanConfig(
            batch_size=4, max_new_tokens=24, bin_width=4, resume=resume != "restart", keep_kv=resume == "keep"
        )
        run = run_policy(model, prompts, policy=policy, predicted=predicted, gen=gen, plan=plan)
        trace = [TraceRequest(len(p), t, q) for p, t, q in zip(prompts, true, predicted, strict=True)]
        sim = simulate(trace, policy=policy, config=plan)
        assert (run.slots, run.failures) == (sim.padded_slots, sim.failures) and run.tokens == reference


def test_fcr_with_cap_at_global_max_never_fails(model, prompts, reference, gen):
    run = run_policy(model, prompts, policy="fcr", predicted=[10_000.0] * len(prompts), gen=gen, plan=PLAN)
    assert run.failures == 0 and run.tokens == reference


def test_continuous_batching_refills_with_late_arrivals(model, prompts, reference, gen):
    config = EngineConfig(max_batch_size=3, max_new_tokens=PLAN.max_new_tokens, refill_min=1)
    arrivals = [3 * i for i in range(len(prompts))]
    result = generate_continuous(model, prompts, queue=FCFSQueue(), gen=gen, config=config, arrivals=arrivals)
    assert result.tokens == reference
    # finished rows leave at once: every computed slot is a real token
    assert result.slots == sum(len(r) for r in reference)
    assert result.admitted_order == list(range(len(prompts)))


def test_vbs_respects_token_budget():
    predicted = [10, 10, 10, 10, 50, 50, 100, 100]
    prompt_lens = [5] * 8
    config = PlanConfig(batch_size=2, max_new_tokens=100, token_budget=200)
    batches = plan_batches("fcr+vbs", predicted=predicted, prompt_lens=prompt_lens, config=config)
    assert [b.rows for b in batches] == [(0, 1, 2, 3), (4, 5), (6,), (7,)]
    assert [b.cap for b in batches] == [10, 50, 100, 100]
    for b in batches:
        assert len(b.rows) * (5 + b.cap) <= 200 or len(b.rows) == 1


def test_vbs_default_budget_never_below_batch_size():
    predicted = [256.0] * 8 + [20.0] * 40
    config = PlanConfig(batch_size=4, max_new_tokens=256)
    batches = plan_batches("fcr+vbs", predicted=predicted, prompt_lens=[30] * 48, config=config)
    assert all(len(b.rows) >= 4 for b in batches[:-1])
    assert len(batches[0].rows) > 4  # the short-predicted requests share bigger batches


def test_unknown_policy_and_missing_predictions_raise():
    with pytest.raises(ValueError, match="unknown static policy"):
        plan_batches("lifo", predicted=None, prompt_lens=[1], config=PLAN)
    with pytest.raises(ValueError, match="predicted length"):
        plan_batches("sorted", predicted=None, prompt_lens=[1], config=PLAN)


def test_fcr_zero_cap_batch_is_skipped_then_rerun(model, prompts, reference, gen):
    run = run_policy(model, prompts[:4], policy="fcr", predicted=[0.0] * 4, gen=gen, plan=PLAN)
    assert run.failures == 4 and run.tokens == reference[:4]
    assert run.slots == 4 * max(len(r) for r in reference[:4])


def test_cb_kv_fits_more_rows_preempts_and_serves_the_same_outputs(model, prompts, reference, gen):
    true = [len(r) for r in reference]
    cb = run_policy(model, prompts, policy="cb", predicted=None, gen=gen, plan=PLAN)
    # every request reserves 1 answer token: many more rows fit the budget, and each that outgrows its
    # reservation may push the newest out (recomputed later, counted as a failure and in the slots)
    kv = run_policy(model, prompts, policy="cb-kv", predicted=[1.0] * len(prompts), gen=gen, plan=PLAN)
    assert kv.tokens == reference and cb.tokens == reference
    assert kv.failures > 0 and kv.slots > kv.useful == sum(true) == cb.slots
    # with the cap reserved by everyone nothing outgrows its reservation: no preemption, no wasted slot
    capped = run_policy(model, prompts, policy="cb-kv", predicted=[24.0] * len(prompts), gen=gen, plan=PLAN)
    assert (capped.failures, capped.slots) == (0, cb.slots)
    with pytest.raises(ValueError, match="prediction for every request"):
        run_policy(model, prompts, policy="cb-kv", predicted=None, gen=gen, plan=PLAN)


def test_cb_kv_with_cap_reservations_and_cb_rows_is_cb(model, prompts, reference, gen):
    # the budget of PLAN.batch_size cap-reserving rows and no more rows than that: cb's schedule exactly
    cap = PLAN.max_new_tokens
    lens = [len(p) for p in prompts]
    runs = [
        generate_continuous(
            model, prompts, queue=make_queue("cb", None), gen=gen, config=config, reserve=reserve
        )
        for config, reserve in (
            (continuous_config("cb", PLAN, lens), None),
            (
                EngineConfig("cb-kv", PLAN.batch_size, cap, kv_prompt_tokens=max(lens), kv_row_factor=1),
                [float(cap)] * len(prompts),
            ),
        )
    ]
    cb, kv = runs
    assert kv.tokens == cb.tokens == reference and kv.preemptions == 0
    assert (kv.admitted_order, kv.decode_steps, kv.prefills, kv.slots) == (
        cb.admitted_order, cb.decode_steps, cb.prefills, cb.slots
    )  # fmt: skip


def test_peak_kv_tokens_counts_the_padded_cache(model):
    """Two prompts (3 and 5 tokens), 4 answer tokens each, no EOS: the prefill holds 2 x 5 positions (left
    padding included), decode step k holds 2 x (5 + k); the last of 3 decode steps holds 2 x 8 = 16."""
    from ecru.serve import GenerationConfig

    never = GenerationConfig(eos_token_ids=(10_000,), pad_token_id=0)
    config = EngineConfig(max_batch_size=2, max_new_tokens=4, refill_min=1)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    result = generate_continuous(model, prompts, queue=FCFSQueue(), gen=never, config=config)
    assert [len(t) for t in result.tokens] == [4, 4]
    assert result.peak_kv_tokens == 16
    one = generate_continuous(model, prompts[:1], queue=FCFSQueue(), gen=never, config=config)
    assert one.peak_kv_tokens == 3 + 3  # one row: its prompt plus the tokens fed back


def test_bins_batches_never_mix_bins_and_run_at_the_bin_top():
    from ecru.serve.sched.policies import bin_top

    # bin capacities under the budget 4 x (5 + 256): 18 rows at cap 50, 9 at 100, 6 at 150, 4 at 256
    predicted = [10, 40, 30] * 12 + [60, 90, 70] * 3 + [140, 101] * 6 + [260, 255, 256, 251]
    config = PlanConfig(batch_size=4, max_new_tokens=256, token_budget=4 * (5 + 256))
    plan = plan_batches("fcr+vbs+bins", predicted=predicted, prompt_lens=[5] * len(predicted), config=config)
    assert sorted(r for b in plan for r in b.rows) == list(range(len(predicted)))
    assert [(len(b.rows), b.cap) for b in plan] == [
        (18, 50),
        (18, 50),
        (9, 100),
        (6, 150),
        (6, 150),
        (4, 256),
    ]
    for b in plan:
        assert {bin_top(predicted[r], 50, 256) for r in b.rows} == {b.cap}


def test_bins_merge_a_small_leftover_into_the_next_bin():
    predicted = [20] * 17 + [90] * 8  # bin 50: one full batch of 16 (budget) and a leftover of 1
    config = PlanConfig(batch_size=4, max_new_tokens=256, token_budget=16 * (10 + 50))
    plan = plan_batches("fcr+vbs+bins", predicted=predicted, prompt_lens=[10] * 25, config=config)
    assert [len(b.rows) for b in plan if b.cap == 50] == [16]
    merged = [b for b in plan if 16 in b.rows]
    assert merged[0].cap == 100  # the leftover row runs with the next bin, at its cap
    assert sum(len(b.rows) for b in plan) == 25


def test_offline_limits_are_the_engines_own():
    lens = [3, 11, 7]
    sjf = continuous_config("cb-sjf", PLAN, lens, refill_min=2)
    assert (sjf.policy, sjf.max_rows, sjf.max_new_tokens, sjf.refill_min, sjf.kv_budget) == (
        "cb-sjf", PLAN.batch_size, PLAN.max_new_tokens, 2, None
    )  # fmt: skip
    kv = continuous_config("cb-kv", PLAN, lens)  # the budget at the longest prompt, 4x the rows
    assert (kv.max_rows, kv.kv_budget) == (4 * PLAN.batch_size, PLAN.batch_size * (PLAN.max_new_tokens + 11))
