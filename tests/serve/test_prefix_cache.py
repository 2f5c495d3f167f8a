"""Prefix caching: prompts sharing a start reuse its keys and values, with Hugging Face `generate`'s tokens."""

import pytest
import torch

from ecru.serve.engine.kv_cache import PrefixHit, PrefixStore, common_prefix
from ecru.serve.engine.request_engine import EngineConfig, RequestEngine
from ecru.serve.engine.sampling import SamplingParams
from ecru.serve.sched.names import ENGINE_POLICIES

from .conftest import MAX_NEW, VOCAB, remaining_for

GREEDY = SamplingParams(max_tokens=MAX_NEW)


def kv(n: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, n, 4), fill), torch.full((2, n, 4), -fill))]


def test_lookup_finds_the_longest_stored_prefix_and_leaves_the_last_token():
    store = PrefixStore(4, min_prefix=3)
    store.insert([1, 2, 3, 4, 5], kv(5, 1.0))
    store.insert([1, 2, 3, 9, 9, 9], kv(6, 2.0))
    assert store.lookup([1, 2, 3, 4, 7]) == PrefixHit(4, (1, 2, 3, 4, 5))
    assert store.lookup([1, 2, 3, 9, 9, 9]) == PrefixHit(5, (1, 2, 3, 9, 9, 9))  # one token left to compute
    assert store.lookup([1, 2, 7]) == PrefixHit()  # 2 shared tokens < min_prefix
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0


def test_store_evicts_the_least_recently_used():
    store = PrefixStore(2, min_prefix=1)
    store.insert([1, 1], kv(2, 1.0))
    store.insert([2, 2], kv(2, 2.0))
    store.lookup([1, 1, 5])  # [1, 1] used: [2, 2] is now the oldest
    store.insert([3, 3], kv(2, 3.0))
    assert len(store) == 2 and store.tokens == 4
    assert store.lookup([2, 2, 5]) == PrefixHit()
    assert store.lookup([1, 1, 5]).length == 2


def test_prefix_kv_right_aligns_each_rows_cached_positions():
    store = PrefixStore(2, min_prefix=1)
    store.insert([1, 2, 3], [(torch.arange(24.0).reshape(2, 3, 4), -torch.arange(24.0).reshape(2, 3, 4))])
    hit = store.lookup([1, 2, 3, 4])
    keys, values = store.prefix_kv([hit, PrefixHit(), hit], [3, 0, 2], layer=0)
    assert keys.shape == (3, 2, 3, 4)
    torch.testing.assert_close(keys[0], torch.arange(24.0).reshape(2, 3, 4), rtol=0, atol=0)
    assert not keys[1].any()  # a row with nothing cached: padding
    torch.testing.assert_close(keys[2, :, 1:], torch.arange(24.0).reshape(2, 3, 4)[:, :2], rtol=0, atol=0)
    torch.testing.assert_close(values, -keys, rtol=0, atol=0)


def test_config_validates_prefix_cache():
    with pytest.raises(ValueError, match="prefix_cache"):
        EngineConfig(prefix_cache=-1)
    with pytest.raises(ValueError):
        PrefixStore(0)


@pytest.fixture(scope="module")
def shared(model, gen):
    """Prompts opening with one 20-token 'system prompt' (a few repeat a whole prompt), and HF's answers."""
    g = torch.Generator().manual_seed(3)
    system = torch.randint(3, VOCAB, (20,), generator=g).tolist()
    tails = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 2, 4, 7, 11, 3, 9, 5, 6, 2)]
    prompts = [system + t for t in tails] + [system + tails[3], system]
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        full = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=list(gen.eos_token_ids), pad_token_id=gen.pad_token_id)  # fmt: skip
        out.append(full[0, len(p) :].tolist())
    return prompts, out


def engine_for(model, gen, **kw):
    config = EngineConfig(**{"max_new_tokens": MAX_NEW, "max_batch_size": 4, "refill_min": 2, **kw})
    return RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id, config=config,
                         remaining=remaining_for(config.policy))  # fmt: skip


@pytest.mark.parametrize("policy", ENGINE_POLICIES)
def test_prompts_sharing_a_start_reuse_it_with_generates_tokens(model, gen, shared, policy):
    prompts, reference = shared
    engine = engine_for(model, gen, policy=policy)
    reqs = engine.generate(prompts, GREEDY)
    assert [r.output for r in reqs] == reference
    # the first prompts admitted together compute their shared start once; later ones find it stored
    assert engine.stats.prefix_hit_tokens >= 16 * len(prompts)
    assert (
        0 < engine.stats.prefix_store_tokens == engine.runner.prefixes.tokens <= 16 * max(map(len, prompts))
    )


def test_prefix_cache_off_computes_every_prompt_token(model, gen, shared):
    prompts, reference = shared
    engine = engine_for(model, gen, prefix_cache=0)
    assert [r.output for r in engine.generate(prompts, GREEDY)] == reference
    assert engine.stats.prefix_hit_tokens == 0 and engine.runner.prefixes is None


def test_requests_arriving_one_by_one_reuse_the_prefix(model, gen, shared):
    prompts, reference = shared
    engine = engine_for(model, gen, refill_min=1)
    reqs = []
    for p in prompts:  # a server's arrivals: each prefilled alone, after the previous ones
        reqs.append(engine.add_request(p, GREEDY))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert [r.output for r in reqs] == reference
    assert engine.stats.prefix_hit_tokens >= 16 * (len(prompts) - 1)


def test_prefill_logits_with_a_cached_prefix_match_a_full_prefill(model, gen, shared):
    from ecru.serve.engine.static import forward, left_pad, new_cache

    prompts, _ = shared
    engine = engine_for(model, gen)
    rows = prompts[3:6]
    ids, mask = left_pad(rows, gen.pad_token_id)
    full = forward(model, ids, mask, new_cache(model))
    engine.generate([prompts[0]], GREEDY)  # stores prompts[0]'s KV
    hits = [engine.runner.prefixes.lookup(r) for r in rows]
    assert all(h.length == 20 for h in hits)
    ids, mask, cache = engine.runner._prefill_inputs(rows, hits)
    assert ids.shape[1] < 20  # only the tails are computed
    torch.testing.assert_close(forward(model, ids, mask, cache), full, rtol=1e-5, atol=1e-5)


def test_a_start_shared_within_one_admission_is_computed_once(model, gen, shared):
    prompts, reference = shared
    engine = engine_for(model, gen, max_batch_size=8)
    reqs = engine.generate(prompts[:8], GREEDY)  # one admission: nothing stored yet
    assert [r.output for r in reqs] == reference[:8]
    assert engine.stats.prefill_forwards == 2  # the 20-token start alone, then the tails in one forward
    # that forward computes the longest tail's 11 positions in every row: the rest came from the store
    tails = [len(p) - 20 for p in prompts[:8]]
    assert engine.stats.prefix_hit_tokens == sum(20 + t - max(tails) for t in tails)


def test_prefix_caching_survives_preemption_with_generates_tokens(model, gen, shared):
    prompts, reference = shared
    engine = engine_for(model, gen, policy="cb-kv", kv_prompt_tokens=1)
    engine.predict = lambda prompt, params: 2.0  # reservations of 2 tokens: rows outgrow them, are preempted
    assert [r.output for r in engine.generate(prompts, GREEDY)] == reference
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hit_tokens > 0


def test_offline_measurement_loop_runs_without_prefix_caching(model, gen, shared, monkeypatch):
    from ecru.serve.engine.policy_runs import generate_continuous
    from ecru.serve.sched.queues import FCFSQueue
    from ecru.serve.sched.scheduler import EngineConfig

    # the static baselines and the simulator it is compared with have no prefix caching
    monkeypatch.setattr(PrefixStore, "lookup", lambda *args: pytest.fail("the prefix cache was used"))
    prompts, reference = shared
    config = EngineConfig(max_batch_size=4, max_new_tokens=MAX_NEW, refill_min=2)
    result = generate_continuous(model, prompts, queue=FCFSQueue(), gen=gen, config=config)
    assert result.tokens == reference
