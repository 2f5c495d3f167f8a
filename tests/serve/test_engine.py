import pytest

from ecru.serve import GenerationConfig, SamplingParams, generate_static, left_pad
from ecru.serve.engine.static import resume_static


def test_reference_lengths_vary(reference, max_new):
    lengths = [len(r) for r in reference]
    assert min(lengths) < max_new // 2 and max(lengths) == max_new and len(set(lengths)) >= 6


def test_static_batch_equals_unbatched_greedy_in_input_order(model, prompts, reference, gen, max_new):
    result = generate_static(model, prompts, max_new_tokens=max_new, config=gen)
    assert result.tokens == reference


def test_slot_accounting_counts_every_row_every_step(model, prompts, reference, gen, max_new):
    batch = prompts[:8]
    result = generate_static(model, batch, max_new_tokens=max_new, config=gen)
    lengths = [len(r) for r in reference[:8]]
    assert result.steps == max(lengths)
    assert result.slots == 8 * max(lengths)
    assert result.useful == sum(lengths)
    assert result.slots - result.useful == 8 * max(lengths) - sum(lengths)  # padding slots
    assert result.prompt_slots == 8 * max(len(p) for p in batch)
    assert result.ended == [t[-1] in gen.eos_token_ids for t in reference[:8]]


def test_per_row_budgets_stop_each_row_at_its_own_count(model, prompts, reference, gen, max_new):
    budgets = [1 + (3 * i) % max_new for i in range(8)]
    result = generate_static(model, prompts[:8], max_new_tokens=max_new, config=gen, budgets=budgets)
    assert result.tokens == [r[:b] for r, b in zip(reference, budgets, strict=False)]
    assert result.steps == max(min(len(r), b) for r, b in zip(reference, budgets, strict=False))
    for ended, ref, b in zip(result.ended, reference, budgets, strict=False):
        assert ended == (len(ref) <= b and ref[-1] in gen.eos_token_ids)
    with pytest.raises(ValueError, match="budgets"):
        generate_static(model, prompts[:2], max_new_tokens=4, config=gen, budgets=[5, 1])


def test_per_batch_cap_truncates_and_marks_unfinished(model, prompts, reference, gen):
    result = generate_static(model, prompts, max_new_tokens=5, config=gen)
    assert result.tokens == [r[:5] for r in reference]
    assert result.steps == 5
    for ended, ref in zip(result.ended, reference, strict=True):
        assert ended == (len(ref) <= 5 and ref[-1] in gen.eos_token_ids)


def test_kept_rows_resume_as_if_never_cut(model, prompts, reference, gen, max_new):
    cut = generate_static(model, prompts, max_new_tokens=5, config=gen, keep_cut=True)
    rows = [i for i, kv in enumerate(cut.kept) if kv is not None]
    assert rows == [i for i, r in enumerate(reference) if len(r) > 5]  # cut, not ended: kept; the rest: None
    for i in rows:  # the prompt and every token but the pending last one
        assert cut.kept[i][0][0].shape[-2] == len(prompts[i]) + 5 - 1
    pending = [cut.tokens[i][-1] for i in rows]
    budgets = [max_new - 5] * len(rows)
    more = resume_static(model, [cut.kept[i] for i in rows], pending, max_new_tokens=max_new, config=gen,
                         budgets=budgets)  # fmt: skip
    assert [cut.tokens[i] + t for i, t in zip(rows, more.tokens, strict=True)] == [reference[i] for i in rows]
    assert more.prompt_slots == 0 and more.steps == max(len(reference[i]) - 5 for i in rows)
    assert generate_static(model, prompts, max_new_tokens=5, config=gen).kept is None  # not asked: none kept


def test_left_pad_right_aligns():
    ids, mask = left_pad([[5, 6, 7], [9]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []], pad_token_id=0)
    with pytest.raises(ValueError, match="eos_token_ids"):
        GenerationConfig(eos_token_ids=(), pad_token_id=0)


def test_sampling_is_seeded(model, prompts):
    cfg, sampled = (
        GenerationConfig(eos_token_ids=(2,), pad_token_id=0),
        SamplingParams(temperature=0.7, seed=3),
    )
    a = generate_static(model, prompts[:4], max_new_tokens=8, config=cfg, params=sampled).tokens
    b = generate_static(model, prompts[:4], max_new_tokens=8, config=cfg, params=sampled).tokens
    greedy = generate_static(model, prompts[:4], max_new_tokens=8, config=cfg).tokens
    assert a == b and a != greedy
