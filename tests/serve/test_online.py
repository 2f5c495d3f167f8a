"""The online simulator: arrivals in seconds, shortest-(remaining-)first admission, aging, preemption."""

import dataclasses
import math

import pytest

from ecru.serve.sched.scheduler import EngineConfig
from ecru.serve.sim.cost import CostModel
from ecru.serve.sim.simulator import OnlineRequest, simulate_online, simulate_policy

UNIT = CostModel(1.0, 0.0, 0.0, 0.0, 0.0, source="1 s per decode step, free prefill")


BASE = EngineConfig(max_batch_size=1, max_new_tokens=100, refill_min=1)


def config(**kw) -> dict:
    """Overrides of BASE (`EngineConfig` fields and `simulator.SIM_KNOBS`)."""
    return kw


def run(trace, policy: str, overrides: dict, cost=UNIT):
    return simulate_policy(trace, policy, BASE, cost, overrides)


def finish_order(result, trace) -> list[int]:
    finish = [lat + r.arrival_s for lat, r in zip(result.latencies, trace, strict=True)]
    return sorted(range(len(trace)), key=lambda i: finish[i])


def test_single_request_latency_and_tokens():
    # the prefill yields token 1, then n - 1 decode steps of 1 s each
    trace = [OnlineRequest(2.0, prompt_len=5, output_len=7)]
    for policy in ("fcfs", "cb", "cb-sjf", "oracle-srpt"):
        r = run(trace, policy, config())
        assert r.mean_latency_s == pytest.approx(6.0)
        assert r.tokens_per_s == pytest.approx(7 / 8.0)
        assert r.peak_kv_tokens == 5 + 6  # the widest cache a decode step ran over: prompt + 6 tokens


def test_output_capped_at_max_new_tokens():
    trace = [OnlineRequest(0.0, 3, 500)]
    r = run(trace, "cb", config(max_new_tokens=10))
    assert r.mean_latency_s == pytest.approx(9.0)


def test_sjf_admits_shortest_predicted_first():
    trace = [OnlineRequest(0.0, 4, n, predicted=p) for n, p in ((30, 30), (5, 50), (10, 1))]
    cb = run(trace, "cb", config(aging=0.0))
    sjf = run(trace, "cb-sjf", config(aging=0.0))
    assert finish_order(cb, trace) == [0, 1, 2]
    assert finish_order(sjf, trace) == [2, 0, 1]  # by prediction, not by the true length


def _stream():
    # one long request at t=0.5 while a short one arrives every 2 s and keeps the single row busy
    trace = [OnlineRequest(0.0, 4, 3, predicted=3)]
    trace += [OnlineRequest(0.5, 4, 3, predicted=200)]
    trace += [OnlineRequest(1.0 + 2 * i, 4, 3, predicted=3) for i in range(300)]
    return trace


def test_no_aging_starves_the_long_request():
    trace = _stream()
    r = run(trace, "cb-sjf", config(aging=0.0))
    assert finish_order(r, trace)[-1] == 1


def test_aging_bounds_the_wait_in_tokens():
    trace = _stream()
    aging = 0.5
    r = run(trace, "cb-sjf", config(aging=aging))
    # its key falls by 0.5 per second waited; a newcomer's is 3: it must run within (200 - 3) / 0.5 s
    assert r.latencies[1] <= (200 - 3) / aging + 2 * 3 + 1
    assert r.latencies[1] > 100  # but it did let short requests go first


def test_oracle_srpt_preempts_a_long_row_for_a_short_one():
    trace = [OnlineRequest(0.0, 4, 80), OnlineRequest(10.5, 4, 3)]
    base = config(fcfs_slack=math.inf, repredict_every=4, preempt_margin=10, preempt_mode="recompute")
    plain = run(trace, "oracle-srpt", base | {"preempt_margin": math.inf})
    pre = run(trace, "oracle-srpt", base)
    assert finish_order(plain, trace) == [0, 1] and plain.preemptions == 0
    assert finish_order(pre, trace) == [1, 0] and pre.preemptions == 1
    assert pre.latencies[1] < 5
    # the preempted row keeps its tokens: it pays the short request's 2 decode steps, and its own readmission
    # prefill (free here) yields its next token
    assert pre.latencies[0] == pytest.approx(plain.latencies[0] + 2 - 1)


def test_cb_srpt_uses_the_repredicted_remaining_length():
    # both predicted short from the prompt; after 4 tokens row 0 is re-predicted to run long
    long_row = OnlineRequest(0.0, 4, 80, predicted=5, remaining=(5.0, 76.0, 72.0))
    short = OnlineRequest(5.5, 4, 3, predicted=3)
    base = config(aging=0.0, fcfs_slack=math.inf, repredict_every=4, preempt_margin=10)
    r = run([long_row, short], "cb-srpt", base)
    assert r.preemptions == 1 and finish_order(r, [long_row, short]) == [1, 0]
    wrong = OnlineRequest(0.0, 4, 80, predicted=5, remaining=(5.0, 5.0, 5.0))  # never re-predicted long
    r = run([wrong, short], "cb-srpt", base)
    assert r.preemptions == 0


def test_static_fcfs_batches_what_is_waiting():
    trace = [OnlineRequest(0.0, 4, 10), OnlineRequest(0.0, 6, 2), OnlineRequest(0.5, 4, 2)]
    r = run(trace, "fcfs", config(max_batch_size=4))
    # rows 0 and 1 form a batch at t=0 (10 tokens: 9 s); row 2 waits for it, then runs 1 s
    assert r.latencies == pytest.approx([9.0, 1.0, 9.5])
    assert r.peak_kv_tokens == 2 * (6 + 9)


def test_config_validated():
    with pytest.raises(ValueError):
        run([OnlineRequest(0, 1, 1)], "cb", {"aging": -1})
    with pytest.raises(ValueError):
        simulate_online([OnlineRequest(0, 1, 1)], policy="sjf", config=BASE, cost=UNIT)


PREFILL = CostModel(1.0, 0.0, 0.0, 10.0, 0.0, source="1 s per decode step, 10 s per prefill forward")


def test_prefill_at_arrival_costs_a_lone_request_nothing_more():
    trace = [OnlineRequest(2.0, prompt_len=5, output_len=7, predicted=7)]
    plain = run(trace, "cb-sjf", config(), PREFILL)
    early = run(trace, "cb-sjf", config(prefill_at_arrival=True), PREFILL)
    assert early.latencies == plain.latencies == pytest.approx([10.0 + 6.0])


def test_prefill_at_arrival_does_the_waiting_requests_prefill_first():
    # two arrivals, one row: admission prefills the second when its turn comes; on arrival both are
    # prefilled first (forwards of at most one row here), so the first answer ends later, the total is equal
    trace = [OnlineRequest(0.0, 4, 3, predicted=3), OnlineRequest(0.0, 4, 3, predicted=3)]
    plain = run(trace, "cb-sjf", config(), PREFILL)
    early = run(trace, "cb-sjf", config(prefill_at_arrival=True), PREFILL)
    assert plain.latencies == pytest.approx([12.0, 24.0])
    assert early.latencies == pytest.approx([22.0, 24.0])
    # while the first row decodes (its widest cache: 4 + 2), the second's prompt KV (4) waits beside it
    assert early.peak_kv_tokens == (4 + 2) + 4


def test_a_lone_arrival_waits_for_company_only_while_the_batch_is_full():
    # request 1 arrives alone while request 0 holds the only row: it is not prefilled (refill_min 2)
    # until the row frees; request 2 finds the engine empty and is prefilled at once
    trace = [OnlineRequest(0.0, 4, 5, predicted=5), OnlineRequest(10.5, 4, 2, predicted=2),
             OnlineRequest(30.0, 4, 2, predicted=2)]  # fmt: skip
    cfg = config(refill_min=2, prefill_at_arrival=True)
    r = run(trace, "cb-sjf", cfg, PREFILL)
    # 0: prefill 0-10, steps to 14; 1: prefill 14-24, one step; 2: prefill 30-40, one step
    assert r.latencies == pytest.approx([14.0, 25.0 - 10.5, 41.0 - 30.0])


def test_arrival_kv_bound_drops_the_longest_predicted_and_prefills_it_again():
    trace = [OnlineRequest(0.0, 4, 3, predicted=p) for p in (3, 9, 3)]
    cfg = config(refill_min=3, prefill_at_arrival=True)
    keep_all = run(trace, "cb-sjf", cfg, PREFILL)
    bounded = run(trace, "cb-sjf", cfg | {"arrival_kv_requests": 2}, PREFILL)
    assert keep_all.time_s == pytest.approx(3 * 10 + 3 * 2)  # three one-row arrival forwards
    # request 1 (predicted 9) is prefilled again, with its first token: that forward yields its second
    assert bounded.time_s == pytest.approx(keep_all.time_s + 10 - 1)


def test_prefill_at_arrival_charges_no_prediction_time():
    with pytest.raises(ValueError, match="predict_s 0 with prefill_at_arrival"):
        run([OnlineRequest(0, 1, 1)], "cb-sjf", {"prefill_at_arrival": True, "predict_s": 0.1})
    with pytest.raises(ValueError, match="arrival_kv_requests"):
        EngineConfig(arrival_kv_requests=0)


def test_arrival_forwards_hold_at_most_max_batch_size_prompts():
    trace = [OnlineRequest(0.0, 4, 1, predicted=1) for _ in range(5)]  # answers end at the first token
    r = run(trace, "cb-sjf", config(max_batch_size=2, prefill_at_arrival=True), PREFILL)
    assert r.time_s == pytest.approx(3 * 10)  # 5 arrivals: forwards of 2, 2 and 1 rows


def test_arrival_forwards_are_the_engines_groups_each_with_its_own_first_tokens():
    from ecru.serve.sched.scheduler import arrival_groups

    per_token = CostModel(1.0, 0.0, 0.0, 0.0, 1.0, source="1 s per prompt position")
    trace = [OnlineRequest(0.0, n, 1, predicted=1) for n in (4, 100, 4)]  # answers end at the first token
    assert arrival_groups([4, 100, 4], 2) == [[0, 2], [1]]
    r = run(trace, "cb", config(max_batch_size=2, prefill_at_arrival=True), per_token)
    assert r.latencies == pytest.approx([8.0, 108.0, 8.0])  # 2 rows x 4, then 1 row x 100


def test_fcfs_slack_bounds_the_wait_by_the_backlog():
    # no aging: the long request would starve; with fcfs_slack 0.5 it waits 1.5 x the backlog of predicted
    # tokens (its own 200, capped at 100; a waiting short's 3; the running row's <= 3) on one row, in steps
    trace = _stream()
    r = run(trace, "cb-sjf", config(aging=0.0, fcfs_slack=0.5))
    assert 1.5 * 100 <= r.latencies[1] <= 1.5 * 106 + 3
    assert r.latencies[0] <= 3 and max(r.latencies[2:]) <= 3 + 3  # the short ones barely wait


def test_a_row_admitted_past_its_deadline_is_never_preempted():
    # the long request's deadline (0.5 x its own 80 predicted tokens) passes while the short rows run;
    # once admitted, later short arrivals do not push it out again
    trace = [OnlineRequest(0.0, 4, 3, predicted=3), OnlineRequest(0.5, 4, 80, predicted=80)]
    trace += [OnlineRequest(1.0 + 2 * i, 4, 3, predicted=3) for i in range(100)]
    cfg = config(aging=0.0, fcfs_slack=0.0, repredict_every=4, preempt_margin=10)
    r = run(trace, "oracle-srpt", cfg)
    assert r.preemptions == 0 and r.latencies[1] <= 80 + 83 + 6


def test_fcfs_slack_rejected_where_nothing_is_predicted_shortest_first():
    for policy in ("fcfs", "cb"):
        with pytest.raises(ValueError, match="fcfs_slack"):
            run(_stream(), policy, config(fcfs_slack=0.1))
    with pytest.raises(ValueError, match="fcfs_slack"):
        EngineConfig(policy="cb-sjf", fcfs_slack=-0.1)
    with pytest.raises(ValueError, match="fcfs_slack"):  # a config valid for cb-sjf, run as fcfs
        simulate_online(
            _stream(), policy="fcfs", config=EngineConfig(policy="cb-sjf", fcfs_slack=0.1), cost=UNIT
        )


def test_a_preempted_row_that_keeps_its_kv_rejoins_without_a_prefill():
    trace = [OnlineRequest(0.0, 4, 80), OnlineRequest(10.5, 100, 3)]
    base = config(fcfs_slack=math.inf, repredict_every=4, preempt_margin=10)
    plain = run(trace, "oracle-srpt", base | {"preempt_margin": math.inf}, PREFILL)
    runs = {mode: run(trace, "oracle-srpt", base | {"preempt_mode": mode}, PREFILL)
            for mode in ("recompute", "keep")}  # fmt: skip
    for r in runs.values():
        assert r.preemptions == 1 and finish_order(r, trace) == [1, 0]
    # both wait for the short request (its prefill, 10 s, and 2 decode steps); recomputing prefills the long
    # row again (10 s, which yields its next token: one decode step fewer), keeping its KV does not
    assert runs["keep"].latencies[0] == pytest.approx(plain.latencies[0] + 10 + 2)
    assert runs["recompute"].latencies[0] == pytest.approx(plain.latencies[0] + 10 + 2 + 10 - 1)
    # the kept KV is memory: the long row's prompt and tokens wait beside the short request's running row
    assert runs["recompute"].peak_kv_tokens == 100 + 2  # the short request's widest step
    # re-predicted in the step that reads its 4th token and emits its 5th, then preempted: its prompt and 4
    # cached tokens (the 5th is pending) beside that step
    assert runs["keep"].peak_kv_tokens == 100 + 2 + 4 + 4
    with pytest.raises(ValueError, match="preempt_mode"):
        EngineConfig(preempt_mode="swap")


def test_plain_cb_srpt_is_the_shipped_configuration():
    from ecru.serve.sched.names import FCFS_SLACK

    engine = EngineConfig(policy="cb-srpt")
    assert (engine.deadline, engine.aging_per_step, engine.preempt_mode) == (FCFS_SLACK, 0.0, "keep")
    sjf = dataclasses.replace(engine, policy="cb-sjf")  # the defaults follow the policy
    assert sjf.deadline is None and sjf.aging_per_step == 0.1
    study = EngineConfig(policy="cb-srpt", fcfs_slack=math.inf, preempt_mode="recompute")
    assert study.deadline is None and study.aging_per_step == 0.1 and study.preempt_mode == "recompute"
