"""cb-srpt in the request engine: re-prediction from the running rows' own states, preemption that keeps
(or recomputes) the KV, greedy outputs equal Hugging Face `generate` whatever is preempted."""

import pytest
import torch

from ecru.serve.engine.request_engine import EngineConfig, RequestEngine
from ecru.serve.engine.sampling import SamplingParams
from ecru.serve.predict.remaining import answer_states

from .conftest import RunsLong

GREEDY = SamplingParams(max_tokens=24)  # conftest's MAX_NEW


def srpt_engine(model, gen, remaining, **kw):
    config = EngineConfig(**{"policy": "cb-srpt", "max_new_tokens": 24, "max_batch_size": 3, "refill_min": 1,
                             "repredict_every": 4, "preempt_margin": 0.0, **kw})  # fmt: skip
    # waiting requests predicted 1 token long: every re-predicted row of a full batch gives way to one
    return RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id, config=config,
                         predict=lambda prompt, params: 1.0, remaining=remaining)  # fmt: skip


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_greedy_equals_hf_generate_through_preemptions(model, prompts, reference, gen, mode):
    engine = srpt_engine(model, gen, RunsLong(), preempt_mode=mode)
    reqs = engine.generate(prompts, GREEDY)
    assert [r.output for r in reqs] == reference
    assert engine.stats.preemptions >= 5
    assert not engine.runner.kept.rows and not engine.requests  # nothing left behind


def spy_on(runner, name: str, check, *, before: bool = False) -> None:
    """Call `check(*args, **kw)` with the arguments of each call of the engine's runner method `name` (the
    scheduler's `Runner` protocol), before or after it."""
    real = getattr(runner, name)

    def spied(*args, **kw):
        if before:
            check(*args, **kw)
        out = real(*args, **kw)
        if not before:
            check(*args, **kw)
        return out

    setattr(runner, name, spied)


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_kept_kv_rejoins_without_a_forward_recompute_prefills_again(model, prompts, reference, gen, mode):
    engine = srpt_engine(model, gen, RunsLong(), preempt_mode=mode)
    prefilled = []  # answer tokens each prefilled request already had

    def admitted(kept, fresh):
        prefilled.extend(len(engine.requests[k].output) for k in fresh)

    spy_on(engine.runner, "admit", admitted, before=True)
    kept = []

    def kept_exactly(keys, *, keep_kv, discard):  # a kept row holds its prompt and every token but the newest
        assert keep_kv == (mode == "keep") and not discard
        for seq in keys if keep_kv else ():
            req = engine.requests[seq]
            kept.append(engine.runner.kept.rows[seq].length == len(req.prompt) + len(req.output) - 1)

    spy_on(engine.runner, "preempt", kept_exactly)
    assert [r.output for r in engine.generate(prompts, GREEDY)] == reference
    assert engine.stats.preemptions > 0
    if mode == "keep":  # only fresh prompts are prefilled; kept rows rejoin without a forward
        assert len(kept) == engine.stats.preemptions and all(kept)
        assert len(prefilled) == len(prompts) and not any(prefilled)
    else:  # every preempted row is prefilled again with its tokens
        assert sum(n > 0 for n in prefilled) == engine.stats.preemptions


def test_a_preempted_request_can_be_cancelled_while_it_waits(model, prompts, reference, gen):
    engine = srpt_engine(model, gen, RunsLong())
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    while not engine.stats.preemptions:
        engine.step()
    victim = next(r for r in reqs if r.status.value == "waiting" and r.output)
    assert victim.seq in engine.runner.kept and engine.abort(victim.request_id)
    assert victim.seq not in engine.runner.kept and victim.finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert all(r.output == ref for r, ref in zip(reqs, reference, strict=True) if r is not victim)


def test_a_preempted_row_whose_kv_is_dropped_by_the_bound_is_prefilled_with_its_tokens(model, prompts, reference,
                                                                                          gen):  # fmt: skip
    engine = srpt_engine(model, gen, RunsLong(), arrival_kv_requests=1)
    assert [r.output for r in engine.generate(prompts, GREEDY)] == reference
    assert engine.stats.preemptions > 1 and not engine.runner.kept.rows


def test_repredicts_from_the_rows_own_state_every_k_tokens(model, prompts, reference, gen):
    probe = RunsLong()
    engine = srpt_engine(model, gen, probe, max_batch_size=8, preempt_margin=1e9)  # re-predict, never preempt
    reqs = engine.generate(prompts[:8], GREEDY)
    assert [r.output for r in reqs] == reference[:8] and engine.stats.preemptions == 0
    by_prompt = {tuple(r.prompt): r.output for r in reqs}
    teacher = {p: s for p, s in zip(by_prompt, answer_states(model, list(by_prompt), list(by_prompt.values())),
                                    strict=True)}  # fmt: skip
    checked = 0
    for states, t in probe.seen:
        assert all(n > 0 and n % 4 == 0 for n in t.tolist())
        for state, n in zip(states, t.tolist(), strict=True):
            # the state that emits token n + 1 of some answer: the teacher-forced state after n tokens
            match = [s[n] for p, s in teacher.items() if len(by_prompt[p]) > n
                     and torch.allclose(s[n], state, atol=1e-4, rtol=1e-4)]  # fmt: skip
            assert match, f"no answer's state after {n} tokens matches"
            checked += 1
    expected = sum(len(range(4, len(a), 4)) for a in reference[:8])
    assert checked == expected > 0


def test_a_request_admitted_past_its_deadline_is_never_preempted(model, prompts, gen):
    engine = srpt_engine(model, gen, RunsLong(), aging=0.0, fcfs_slack=0.0)
    queue, preempted, overdue = engine.scheduler.admitter.queue, [], set()

    def spy(keys, *, keep_kv, discard):
        assert not set(keys) & queue.past_deadline
        preempted.extend(keys)

    spy_on(engine.runner, "preempt", spy, before=True)
    for p in prompts:
        engine.add_request(p, GREEDY)
    while engine.has_unfinished():
        engine.step()
        overdue |= queue.past_deadline
    assert overdue and preempted  # both happened, never to the same running request


def test_cb_srpt_needs_a_remaining_predictor_and_only_it(model, gen):
    with pytest.raises(ValueError, match="remaining"):
        RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id,
                      config=EngineConfig(policy="cb-srpt"))  # fmt: skip
    with pytest.raises(ValueError, match="remaining"):
        RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id,
                      config=EngineConfig(policy="cb"), remaining=RunsLong())  # fmt: skip
    with pytest.raises(ValueError, match="preempt_mode"):
        EngineConfig(policy="cb-srpt", preempt_mode="swap")
    with pytest.raises(ValueError, match="repredict_every"):
        EngineConfig(policy="cb-srpt", repredict_every=0)
