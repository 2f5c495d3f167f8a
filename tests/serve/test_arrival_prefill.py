"""Prefill on arrival: prompts prefilled when they arrive, the probe's features read from that forward, the
KV kept until admission. Greedy outputs still equal Hugging Face `generate`; the model runs exactly one
forward per arrival group and per decode step (no admission or prediction forward)."""

import pytest
import torch

from ecru.serve.engine.request_engine import EngineConfig, RequestEngine
from ecru.serve.engine.sampling import SamplingParams
from ecru.serve.predict.predictors import ProbePredictor
from ecru.serve.sched.scheduler import arrival_groups

GREEDY = SamplingParams(max_tokens=24)  # conftest's MAX_NEW


@pytest.fixture(scope="module")
def alone_features(model, prompts):
    """Each prompt's mean last hidden state (after the final norm), computed alone through the decoder."""
    with torch.no_grad():
        return torch.cat(
            [model.get_decoder()(input_ids=torch.tensor([p])).last_hidden_state.mean(1) for p in prompts]
        )


@pytest.fixture(scope="module")
def probe(model, alone_features):
    """A probe with hand-set weights whose predictions spread over 3..21 tokens without clamping."""
    g = torch.Generator().manual_seed(5)
    probe = ProbePredictor(model, None, cap=24)
    w = torch.randn(alone_features.shape[1], generator=g)
    w *= 3 / (alone_features @ w).std()
    probe.w, probe.b = w, 12 - (alone_features @ w).mean()
    return probe


@pytest.fixture
def forwards(model):
    """The number of model forwards while the test runs."""
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    yield calls
    handle.remove()


def make_engine(model, gen, probe, **kw):
    config = EngineConfig(**{"max_new_tokens": 24, "max_batch_size": 4, "refill_min": 2, **kw})
    return RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id, config=config,
                         state_predictor=probe)  # fmt: skip


def run_to_end(engine):
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("policy", ["cb", "cb-sjf"])
def test_greedy_equals_hf_generate_with_one_forward_per_arrival_group_and_decode_step(
    model, prompts, reference, gen, probe, alone_features, forwards, policy
):
    engine = make_engine(model, gen, probe, policy=policy)
    reqs = engine.generate(prompts, GREEDY)
    assert [r.output for r in reqs] == reference
    s = engine.stats
    assert s.prefill_forwards == 0 and s.arrival_prefill_forwards >= len(prompts) / 4  # at most 4 rows each
    assert len(forwards) == s.arrival_prefill_forwards + s.decode_steps
    standalone = probe.predict_states(alone_features)
    torch.testing.assert_close([r.predicted for r in reqs], standalone, rtol=0, atol=1e-4)


@pytest.mark.parametrize("policy", ["cb", "cb-sjf"])
def test_requests_arriving_mid_run_get_the_same_tokens(
    model, prompts, reference, gen, probe, forwards, policy
):
    engine = make_engine(model, gen, probe, policy=policy, max_batch_size=3)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(engine.add_request(p, GREEDY))
        for _ in range(i % 3):  # arrivals between steps, into a batch of changing composition
            engine.step()
    run_to_end(engine)
    assert [r.output for r in reqs] == reference
    s = engine.stats
    assert s.prefill_forwards == 0 and len(forwards) == s.arrival_prefill_forwards + s.decode_steps
    assert 1 < s.arrival_prefill_forwards < len(prompts)  # arrivals into a busy batch were grouped


def test_cb_with_prefill_on_arrival_admits_first_come_first_served(model, prompts, reference, gen, probe):
    # prompts that do not end at their first token, longest first: the arrival forward takes them in
    # length order, the queue must not
    chosen = sorted((p for p, ref in zip(prompts, reference, strict=True) if len(ref) > 1), key=len)[::-1][:5]
    assert len({len(p) for p in chosen}) > 1
    engine = make_engine(model, gen, probe, policy="cb", max_batch_size=1, refill_min=1)
    engine.scheduler.admission_log = []
    for p in chosen:
        engine.add_request(p, GREEDY)
    run_to_end(engine)
    assert engine.scheduler.admission_log == list(range(len(chosen)))


def test_arrival_groups_split_by_length_then_by_rows():
    assert arrival_groups([5, 7, 6], 16) == [[0, 2, 1]]  # one forward, as prefill_groups
    assert arrival_groups([5, 7, 6, 5, 5], 2) == [[0, 3], [4, 2], [1]]  # at most 2 rows, in length order
    assert arrival_groups([2, 70, 3, 2], 16) == [[0, 3, 2], [1]]  # very different lengths apart


def test_arrivals_wait_for_refill_min_under_a_backlog_and_go_at_once_when_the_batch_has_room(
    model, prompts, reference, gen, probe
):
    long = [p for p, ref in zip(prompts, reference, strict=True) if len(ref) > 6][:5]
    engine = make_engine(model, gen, probe, max_batch_size=2, refill_min=3)
    engine.add_request(long[0], GREEDY)
    engine.step()  # an idle engine: prefilled at once
    engine.add_request(long[1], GREEDY)
    engine.step()  # 1 running + 0 waiting < 2 rows: prefilled at once
    assert engine.stats.arrival_prefill_forwards == 2 and len(engine.scheduler.running) == 2
    engine.add_request(long[2], GREEDY)
    engine.add_request(long[3], GREEDY)
    engine.step()  # the batch is full and 2 < refill_min arrived: they wait unprefilled
    assert engine.stats.arrival_prefill_forwards == 2 and len(engine.scheduler.admitter) == 0
    engine.add_request(long[4], GREEDY)
    engine.step()  # refill_min arrived: prefilled, at most max_batch_size (2) per forward
    assert engine.stats.arrival_prefill_forwards == 4 and len(engine.scheduler.admitter) == 3


def test_the_state_predictor_gets_the_probe_features_of_the_prompts(chat_model_dir):
    from ecru.serve.engine.models import ServedModel
    from ecru.serve.prompts import encode_chat

    served = ServedModel.load(str(chat_model_dir))
    texts = [
        "hi",
        "What is the capital of France?",
        "Write a long story about a cat and a dog.",
        "ok",
        "Why?",
    ]
    probe = ProbePredictor(served.model, served.tokenizer, cap=24)
    features = probe.features(texts)
    probe.w, probe.b = (
        torch.randn(features.shape[1], generator=torch.Generator().manual_seed(0)),
        torch.tensor(9.0),
    )
    torch.testing.assert_close(probe.predict_states(features), probe.predict(texts), rtol=0, atol=0)

    seen = []

    class Recording:
        def predict_states(self, pooled):
            seen.append(pooled)
            return probe.predict_states(pooled)

    engine = served.engine(EngineConfig(max_new_tokens=24, max_batch_size=8), state_predictor=Recording())
    ids = encode_chat(served.tokenizer, texts)
    reqs = engine.generate(ids, SamplingParams(max_tokens=4))
    order = [i for group in arrival_groups([len(p) for p in ids], 8) for i in group]  # rows as prefilled
    torch.testing.assert_close(torch.cat(seen), features[order], rtol=0, atol=1e-5)
    expected = [min(4.0, p) for p in probe.predict(texts)]  # the queue's key is at most max_tokens
    torch.testing.assert_close([r.predicted for r in reqs], expected, rtol=0, atol=1e-4)


def test_cb_sjf_admits_in_predicted_order(model, prompts, gen, probe, forwards):
    engine = make_engine(model, gen, probe, policy="cb-sjf", max_batch_size=2, refill_min=1)
    engine.scheduler.admission_log = []
    reqs = [engine.add_request(p, GREEDY, key=i) for i, p in enumerate(prompts)]
    run_to_end(engine)
    queued = [i for i, r in enumerate(reqs) if len(r.output) > 1]  # the others ended at their first token
    predicted = [reqs[i].predicted for i in queued]
    assert len(set(predicted)) == len(queued) > 20  # no ties: the order is the predictions'
    assert engine.scheduler.admission_log == sorted(queued, key=lambda i: reqs[i].predicted)


def test_the_bound_drops_the_longest_predicted_kv_and_those_requests_still_match(
    model, prompts, reference, gen, probe, forwards
):
    engine = make_engine(model, gen, probe, policy="cb-sjf", max_batch_size=2, arrival_kv_requests=20)
    engine.scheduler.admission_log = []
    reqs = [engine.add_request(p, GREEDY, key=i) for i, p in enumerate(prompts)]
    engine.step()
    queued = [i for i, r in enumerate(reqs) if not (r.finished and len(r.output) == 1)]
    by_length = sorted(queued, key=lambda i: reqs[i].predicted)
    assert engine.scheduler.admission_log == by_length[:2]
    assert sorted(engine.runner.kept.rows) == sorted(by_length[2:20])  # the predicted longest lost their KV
    assert engine.runner.kept.tokens == sum(len(prompts[i]) for i in by_length[2:20])
    run_to_end(engine)
    assert [r.output for r in reqs] == reference
    s = engine.stats
    assert s.prefill_forwards >= 1  # the dropped ones were prefilled again (prompt + first token)
    assert len(forwards) == s.arrival_prefill_forwards + s.prefill_forwards + s.decode_steps


def test_aborting_a_prefilled_waiting_request_frees_its_kv(model, prompts, reference, gen, probe):
    engine = make_engine(model, gen, probe, max_batch_size=1, refill_min=1)
    first, waiting, other = (engine.add_request(p, GREEDY) for p in prompts[:3])
    engine.step()
    assert waiting.output == reference[1][:1] and waiting.first_token_s is not None  # first token at arrival
    assert waiting.status.value == "waiting" and waiting.seq in engine.runner.kept
    held = engine.runner.kept.tokens
    assert engine.abort(waiting.request_id) and waiting.seq not in engine.runner.kept
    assert engine.runner.kept.tokens == held - len(prompts[1]) and waiting.finish_reason == "abort"
    late = engine.add_request(prompts[3], GREEDY)
    assert engine.abort(late.request_id)  # arrived, never prefilled
    run_to_end(engine)
    assert late.output == [] and [first.output, other.output] == [reference[0], reference[2]]
    assert (
        engine.stats.arrival_prefill_forwards == 3
    )  # the first three, one row per forward (max_batch_size 1)


def test_a_request_ending_at_its_first_token_is_never_queued(model, prompts, reference, gen, probe, forwards):
    engine = make_engine(model, gen, probe)
    engine.scheduler.admission_log = []
    one = engine.add_request(prompts[0], SamplingParams(max_tokens=1))
    finished = engine.step()
    assert finished == [one] and one.output == reference[0][:1] and one.finish_reason == "length"
    assert (
        engine.scheduler.admission_log == [] and not engine.has_unfinished() and len(engine.runner.kept) == 0
    )
    assert len(forwards) == 1 and engine.stats.decode_steps == 0


def test_peak_kv_counts_the_kept_kv(model, prompts, reference, gen, probe):
    five = [i for i, p in enumerate(prompts) if len(p) >= 5 and len(reference[i]) > 2][:3]
    engine = make_engine(model, gen, probe, max_batch_size=1, refill_min=1)
    for i in five:
        engine.add_request(prompts[i][:5], GREEDY)
    engine.step()
    # the arrival forwards (one row each) hold up to 2 kept rows + 1 of 5; the decode step 1 row of 5 + 1
    # and two kept rows of 5
    assert engine.stats.peak_kv_tokens == 6 + 10


def test_seeded_sampling_is_unchanged_by_prefill_on_arrival(model, prompts, gen, probe):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, presence_penalty=0.5)
    plain = make_engine(model, gen, None).generate(prompts[:6], params)
    arrival = make_engine(model, gen, probe).generate(prompts[:6], params)
    assert [r.output for r in arrival] == [r.output for r in plain]


def test_refusals(model, gen, probe):
    with pytest.raises(ValueError, match="cb-kv"):
        make_engine(model, gen, probe, policy="cb-kv")
    with pytest.raises(ValueError, match="arrival_kv_requests"):
        EngineConfig(arrival_kv_requests=0)
    with pytest.raises(ValueError, match="either predict or state_predictor"):
        RequestEngine(
            model, eos_token_ids=(2,), pad_token_id=0, state_predictor=probe, predict=lambda p, s: 1.0
        )
    with pytest.raises(ValueError, match="reserve"):
        make_engine(model, gen, probe).add_request([5, 6], GREEDY, reserve=3.0)


def test_a_stop_string_in_the_first_token_ends_the_request_at_arrival(chat_model_dir):
    from ecru.serve.engine.models import ServedModel

    served = ServedModel.load(str(chat_model_dir))
    ids = served.encode_chat([{"role": "user", "content": "Tell me about cats."}])
    first = served.engine(EngineConfig(max_new_tokens=8)).generate([ids], SamplingParams(max_tokens=1))[0]
    stop = first.text.strip() or first.text
    probe = ProbePredictor(served.model, served.tokenizer, cap=8)
    probe.w, probe.b = torch.zeros(served.model.config.hidden_size), torch.tensor(4.0)
    engine = served.engine(EngineConfig(max_new_tokens=8), state_predictor=probe)
    engine.scheduler.admission_log = []
    req = engine.add_request(ids, SamplingParams(max_tokens=8, stop=(stop,)))
    assert engine.step() == [req] and req.finish_reason == "stop" and req.output == first.output
    assert (
        engine.scheduler.admission_log == []
        and engine.stats.decode_steps == 0
        and len(engine.runner.kept) == 0
    )


def test_refused_for_a_model_whose_layers_keep_part_of_the_kv(gen, probe):
    """Llama 4's chunked attention layers keep only their chunk (sliding windows keep the whole KV here:
    tests/serve/test_families.py)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           attention_chunk_size=4, num_local_experts=2)  # fmt: skip
    with pytest.raises(ValueError, match="chunked or linear attention"):
        make_engine(Llama4ForCausalLM(cfg).eval(), gen, probe)
