"""The request-level engine: greedy outputs equal Hugging Face `generate` under every admission policy and
any batch composition; per-request caps, stop tokens, sampling, streaming callbacks and cancellation."""

import math

import pytest
import torch

from ecru.serve.engine.request_engine import EngineConfig, RequestEngine
from ecru.serve.engine.sampling import SamplingParams
from ecru.serve.sched.names import ENGINE_POLICIES

from .conftest import remaining_for

GREEDY = SamplingParams(max_tokens=24)  # conftest's MAX_NEW


def make_engine(model, gen, **kw):
    config = EngineConfig(**{"max_new_tokens": 24, "max_batch_size": 4, "refill_min": 2, **kw})
    return RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id, config=config,
                         remaining=remaining_for(config.policy))  # fmt: skip


@pytest.mark.parametrize("policy", ENGINE_POLICIES)
def test_greedy_equals_hf_generate_for_every_policy(model, prompts, reference, gen, policy):
    engine = make_engine(model, gen, policy=policy, kv_prompt_tokens=1,
                         **({"preempt_margin": 0.0, "repredict_every": 4, "fcfs_slack": math.inf}
                            if policy == "cb-srpt" else {}))  # fmt: skip
    # cb-kv: every request reserves 2 answer tokens, so rows outgrow their reservations and get preempted;
    # cb-srpt: waiting requests predicted 2 tokens, running rows re-predicted to their cap: swapped out
    predict = (lambda prompt, params: 2.0) if policy in ("cb-kv", "cb-srpt") else None
    engine.predict = predict or engine.predict
    reqs = engine.generate(prompts, GREEDY)
    assert [r.output for r in reqs] == reference
    assert all(r.finish_reason == ("stop" if r.output[-1] in gen.eos_token_ids else "length") for r in reqs)
    if policy in ("cb-kv", "cb-srpt"):
        assert engine.stats.preemptions > 0


def test_requests_joining_mid_run_get_the_same_tokens(model, prompts, reference, gen):
    engine = make_engine(model, gen, max_batch_size=3, refill_min=1)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(engine.add_request(p, GREEDY))
        for _ in range(i % 3):  # arrivals between steps, into a batch of changing composition
            engine.step()
    while engine.has_unfinished():
        engine.step()
    assert [r.output for r in reqs] == reference


def test_per_request_caps_and_sampling_do_not_disturb_greedy_rows(model, prompts, reference, gen):
    engine = make_engine(model, gen, max_batch_size=8)
    params = [
        SamplingParams(max_tokens=3 + i % 5)
        if i % 3 == 0
        else SamplingParams(max_tokens=24, temperature=0.9, top_p=0.8, top_k=20, seed=i)
        if i % 3 == 1
        else GREEDY
        for i in range(len(prompts))
    ]
    reqs = engine.generate(prompts, params)
    for i, (r, ref) in enumerate(zip(reqs, reference, strict=True)):
        if i % 3 == 0:
            assert r.output == ref[: params[i].max_tokens]
        elif i % 3 == 2:
            assert r.output == ref
        else:
            assert 1 <= len(r.output) <= 24


def test_seeded_sampling_repeats_whatever_the_batch(model, prompts, gen):
    params = SamplingParams(
        max_tokens=12, temperature=1.0, seed=7, presence_penalty=0.5, frequency_penalty=0.3
    )
    alone = make_engine(model, gen).generate(prompts[:1], params)[0].output
    mixed = make_engine(model, gen).generate(prompts[:6], [params] + [GREEDY] * 5)[0].output
    greedy = make_engine(model, gen).generate(prompts[:1], GREEDY)[0].output
    assert alone == mixed and alone != greedy[:12]


def test_listener_streams_and_cancel_frees_the_row(model, prompts, gen):
    engine = make_engine(model, gen, max_batch_size=2, refill_min=1)
    seen = []
    long = engine.add_request(prompts[0], SamplingParams(max_tokens=24), listener=lambda r, p: seen.append(r))
    other = engine.add_request(prompts[1], GREEDY)
    waiting = engine.add_request(prompts[2], GREEDY)
    engine.step()
    assert len(engine.scheduler.running) == 2 and engine.scheduler.num_waiting == 1
    assert engine.abort(long.request_id) and long.finish_reason == "abort" and seen[-1].finished
    engine.step()  # the cancelled row left: the waiting request took it
    assert len(engine.scheduler.running) + len([r for r in (other, waiting) if r.finished]) == 2
    assert long.seq not in engine.runner.run.ids and waiting.status.value != "waiting"
    while engine.has_unfinished():
        engine.step()
    assert not engine.abort(long.request_id)


def test_a_cancelled_waiting_request_never_runs(model, prompts, gen):
    engine = make_engine(model, gen, max_batch_size=1, refill_min=1)
    first = engine.add_request(prompts[0], GREEDY)
    queued = engine.add_request(prompts[1], GREEDY)
    engine.abort(queued.request_id)
    while engine.has_unfinished():
        engine.step()
    assert first.finish_reason in ("stop", "length") and queued.output == []


def test_context_and_cap_checked_before_queueing(model, gen):
    engine = make_engine(model, gen)
    with pytest.raises(ValueError, match="context"):
        engine.add_request([5] * 500, SamplingParams(max_tokens=24))
    with pytest.raises(ValueError, match="cap"):
        engine.add_request([5], SamplingParams(max_tokens=25))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([5], SamplingParams(max_tokens=4, stop=("x",)))
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "kw",
    [
        {"max_tokens": 0},
        {"max_tokens": 2.5},
        {"temperature": -0.1},
        {"temperature": "hot"},
        {"top_p": 0.0},
        {"top_k": -1},
        {"presence_penalty": 3.0},
        {"stop": ("",)},
        {"stop": ("a", "b", "c", "d", "e")},
        {"seed": 1.5},
        {"logprobs": -1},
        {"logprobs": 21},
        {"logprobs": True},
    ],
)
def test_sampling_params_validated_on_construction(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_token_logprobs_are_the_log_softmax_and_its_top_k():
    from ecru.serve.engine.sampling import token_logprobs

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    expected = torch.log(torch.softmax(logits.double(), -1))
    logprob, top = token_logprobs(logits, 2, 2)
    assert abs(logprob - float(expected[2])) < 1e-6
    assert [i for i, _ in top] == [3, 0] and all(abs(v - float(expected[i])) < 1e-6 for i, v in top)
    assert token_logprobs(logits, 1, 0)[1] == []


def test_penalties_match_openai_formula():
    from ecru.serve.engine.sampling import penalize

    logits = torch.zeros(5)
    out = penalize(logits, [1, 1, 3], presence=0.5, frequency=0.25)
    torch.testing.assert_close(out, torch.tensor([0.0, -1.0, 0.0, -0.75, 0.0]))


def test_prefill_groups_split_only_when_padding_costs_more_than_a_forward():
    from ecru.serve.sched.scheduler import prefill_groups

    assert prefill_groups([5, 7, 6]) == [[0, 2, 1]]  # 3 x 7 positions: one forward
    # 3 x 3 + 32 (+ 70 + 32 for the long one) = 143 < 4 x 70 + 32 = 312
    assert prefill_groups([2, 70, 3, 2]) == [[0, 3, 2], [1]]
    assert prefill_groups([2, 70, 3, 2], overhead=500) == [[0, 3, 2, 1]]
    assert prefill_groups([4, 4, 4, 4], overhead=0) == [[0, 1, 2, 3]]


def test_short_and_long_prompts_admitted_together_prefill_apart_with_the_same_tokens(model, prompts, gen):
    long = [(p * 12)[:60] for p in prompts[:2]]
    batch = [long[0], *prompts[:6], long[1]]
    engine = make_engine(model, gen, max_batch_size=8)
    reqs = engine.generate(batch, GREEDY)
    assert engine.stats.prefills == 1 and engine.stats.prefill_forwards == 2
    for p, r in zip(batch, reqs, strict=True):
        ids = torch.tensor([p])
        full = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              eos_token_id=list(gen.eos_token_ids), pad_token_id=gen.pad_token_id)  # fmt: skip
        assert r.output == full[0, len(p) :].tolist()


def test_padded_peak_hand_computed():
    from ecru.serve.sched.scheduler import padded_peak

    # rows holding 10 and 4 positions, running 2 and 5 more steps: step 2 holds 2 x 12, step 5 1 x 9
    assert padded_peak([10, 4], [2, 5]) == 24
    assert padded_peak([4, 10], [5, 2]) == 24
    assert padded_peak([10, 4], [1, 30]) == 34  # the short row leaves at once; the long one grows alone
    assert padded_peak([100, 3], [0, 2]) == 5  # a row running no more steps is gone
    assert padded_peak([], []) == 0


@pytest.mark.parametrize("reserve", [1.0, 6.0, None])  # short (preemptions), middling, the cap
def test_cb_kv_measured_kv_peak_never_exceeds_its_budget(model, prompts, reference, gen, reserve):
    engine = make_engine(model, gen, policy="cb-kv", kv_prompt_tokens=4)  # budget 4 x (24 + 4) = 112
    if reserve is not None:
        engine.predict = lambda prompt, params: reserve
    reqs = engine.generate(prompts, GREEDY)
    assert [r.output for r in reqs] == reference
    budget = engine.scheduler.admitter.config.kv_budget
    assert budget == 112 and 0 < engine.stats.peak_kv_tokens <= budget
    if reserve == 1.0:
        assert engine.stats.preemptions > 0


def test_cb_kv_refuses_a_request_its_budget_cannot_hold(model, gen):
    engine = make_engine(model, gen, policy="cb-kv", kv_prompt_tokens=4)
    with pytest.raises(ValueError, match="KV-cache budget of 112"):
        engine.add_request(list(range(3, 93)), GREEDY)  # 90 + 24 > 112


def test_a_key_or_request_id_in_use_is_refused_and_leaves_nothing_behind(model, gen):
    engine = make_engine(model, gen)
    engine.add_request([5, 6, 7], GREEDY, key=3, request_id="a")
    with pytest.raises(ValueError, match="request key 3 is already in use"):
        engine.add_request([5, 6], GREEDY, key=3, request_id="b")
    with pytest.raises(ValueError, match="request id 'a' is already running"):
        engine.add_request([5, 6], GREEDY, request_id="a")
    assert len(engine.requests) == len(engine.scheduler.seqs) == 1


def test_offline_cb_kv_with_padded_accounting_stays_within_its_budget(model, prompts, reference, gen):
    from ecru.serve import FCFSQueue, generate_continuous

    lens = [len(p) for p in prompts]
    config = EngineConfig("cb-kv", 2, 24, 1, kv_prompt_tokens=max(lens))  # 2 x (24 + 11) = 70
    run = generate_continuous(model, prompts, queue=FCFSQueue(), gen=gen, config=config, reserve=[3.0] * 24)
    assert run.tokens == reference and run.preemptions > 0
    assert 0 < run.peak_kv_tokens <= config.kv_budget == 70


def _long_among_shorts(model, prompts, gen, **kw) -> list[int]:
    """Admission order (request seqs) on one row: seq 1 is predicted to run to the cap, the others 1
    token; a short request arrives every 3 steps for 60 steps, then the queue drains."""
    engine = make_engine(model, gen, policy="cb-sjf", max_batch_size=1, refill_min=1, aging=0.0, **kw)
    long_prompt = prompts[1]
    engine.predict = lambda prompt, params: 24.0 if prompt == long_prompt else 1.0
    engine.scheduler.admission_log = []
    engine.add_request(prompts[0], GREEDY)
    engine.step()
    engine.add_request(long_prompt, GREEDY)
    for step in range(60):
        if step % 3 == 0:
            engine.add_request(prompts[2 + step // 3], GREEDY)
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return engine.scheduler.admission_log


def test_fcfs_slack_admits_a_long_request_before_later_short_ones(model, prompts, gen):
    plain = _long_among_shorts(model, prompts, gen)
    assert plain[-1] == 1  # shortest first, no aging: the long request waits for every short one
    bounded = _long_among_shorts(model, prompts, gen, fcfs_slack=0.0)
    assert sorted(bounded) == sorted(plain) and bounded.index(1) < len(bounded) - 3
