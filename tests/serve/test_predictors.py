"""Length predictors: metrics, ridge against lstsq, oracle, and the self-predicting LoRA adapter."""

import pytest
import torch

from ecru.serve import (
    ConstantPredictor,
    GenerationConfig,
    OraclePredictor,
    SelfLoRAConfig,
    SelfLoRAPredictor,
    generate_static,
    length_metrics,
    ridge_cv,
    ridge_fit,
    timed_predict,
)
from ecru.serve.predict.predictors import spearman
from ecru.serve.predict.self_predict import PiAPredictor, bucket_label, parse_length


def test_length_metrics_by_hand():
    m = length_metrics([10, 100, 300, 50], [40, 160, 100, 50])  # errors 30, 60, 200, 0
    assert m == {"mae": pytest.approx(72.5), "acc50": 0.5, "acc100": 0.75}


def test_ridge_matches_lstsq_when_unregularised():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 7 + 0.01 * torch.randn(50, generator=g)
    w, b = ridge_fit(x, y, lam=0.0)
    ref = torch.linalg.lstsq(
        torch.cat([x, torch.ones(50, 1)], 1).double(), y.double()[:, None]
    ).solution.flatten()
    torch.testing.assert_close(torch.cat([w, b[None]]).double(), ref, rtol=1e-4, atol=1e-4)


def test_oracle_and_constant():
    oracle = OraclePredictor({"a": 3, "b": 7})
    lengths, seconds = timed_predict(oracle, ["b", "a"])
    assert lengths == [7.0, 3.0] and seconds >= 0
    with pytest.raises(KeyError, match="no recorded length"):
        oracle.predict(["c"])
    assert ConstantPredictor(88).predict(["x", "y"]) == [88.0, 88.0]


def test_minilm_predictor_is_ridge_on_its_encoders_embeddings():  # a stub encoder: no MiniLM load
    from types import SimpleNamespace

    from ecru.serve import MiniLMPredictor

    p = MiniLMPredictor(lam=1e-6, cap=100)
    p._encoder = SimpleNamespace(encode=lambda texts: torch.tensor([[float(len(t))] for t in texts]))
    p.fit(["a", "abc", "abcdef"], [3.0, 7.0, 13.0])  # 2 x length + 1
    assert p.predict(["ab", "x" * 80]) == pytest.approx([5.0, 100.0], abs=1e-3)  # the second clamped to cap


def test_bucket_and_parse():
    assert [bucket_label(v, bucket=50, cap=256) for v in (1, 50, 51, 240, 256)] == [50, 50, 100, 250, 256]
    assert parse_length("About 150 tokens.", cap=256) == 150
    assert parse_length("9999", cap=256) == 256 and parse_length("0", cap=256) == 1
    assert parse_length("no idea", cap=256) is None


def test_answers_without_a_number_get_the_predictors_default(monkeypatch):
    import ecru.serve.predict.self_predict as self_predict

    stated = {"a": 40.0, "b": None, "c": 1.0}  # what the model's answers parse to
    monkeypatch.setattr(
        self_predict, "stated_lengths", lambda model, tok, prompts, **kw: [stated[p] for p in prompts]
    )
    pia = PiAPredictor(None, None, default=77.0)
    assert pia.predict(["b", "a", "c", "b"]) == [77.0, 40.0, 1.0, 77.0] and pia.parsed == 2
    lora = SelfLoRAPredictor.__new__(SelfLoRAPredictor)  # only its predict: no model to wrap
    lora.model, lora.tokenizer, lora.config, lora.default = None, None, SelfLoRAConfig(), 99.0
    assert lora.predict(["b", "a"]) == [99.0, 40.0]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from ecru.models import cache_dir

    path = cache_dir() / "smollm2-135m-instruct"
    if not (path / "tokenizer_config.json").is_file():
        from ecru.models import load_smollm2

        return load_smollm2()[1]
    return AutoTokenizer.from_pretrained(path)


def test_self_lora_learns_its_answer_and_disables_for_generation(tokenizer):
    from ecru.models import tiny_llama

    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, seed=0)
    with torch.no_grad():  # larger embeddings: the tied head can then put most mass on one token
        model.model.embed_tokens.weight.mul_(25)
    prompt = [[5, 6, 7, 8]]
    gen = GenerationConfig(eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=0)
    before = generate_static(model, prompt, max_new_tokens=6, config=gen).tokens
    every_linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    config = SelfLoRAConfig(lr=2e-2, epochs=6, batch_size=4, dropout=0.0, target_modules=every_linear)
    predictor = SelfLoRAPredictor(model, tokenizer, config=config)
    train = [f"question number {i}" for i in range(8)]
    predictor.fit(train, [140.0] * 8, progress=False)  # bucketed label: 150
    assert predictor.predict(["an unseen question", "another one"]) == [150.0, 150.0]
    with predictor.adapter_disabled():
        assert generate_static(model, prompt, max_new_tokens=6, config=gen).tokens == before
        # untuned PiA asks the same question of the base model: whatever it says, a number or the default
        pia = PiAPredictor(predictor.model, tokenizer, cap=256, default=77.0, max_tokens=4)
        stated = pia.predict(["an unseen question", "another one"])
        assert all(x == 77.0 or 1 <= x <= 256 for x in stated) and 0 <= pia.parsed <= 2
    # with the adapter on, the same query path reads the tuned answer
    pia = PiAPredictor(predictor.model, tokenizer, cap=256, default=77.0)
    assert pia.predict(["an unseen question"]) == [150.0] and pia.parsed == 1


def test_bucket_log_probs_match_scoring_each_answer_whole(tokenizer):
    from ecru.models import tiny_llama
    from ecru.serve.predict.self_predict import QUERY, bucket_log_probs, buckets
    from ecru.serve.prompts import encode_chat

    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, seed=1).eval()
    with torch.no_grad():  # larger weights: peaked attention, so a wrong position or mask shows
        for p in model.parameters():
            p.mul_(8)
    prompts = ["a short one", "a somewhat longer prompt than the first", "mid length prompt"]
    values = buckets(bucket=50, cap=256)
    assert values == [50, 100, 150, 200, 250, 256]
    got = bucket_log_probs(model, tokenizer, prompts, values, batch_size=2)  # a batch of 2, then of 1
    for row, ids in enumerate(encode_chat(tokenizer, [QUERY.format(prompt=p) for p in prompts])):
        for col, v in enumerate(values):  # one unpadded sequence per answer, no cache
            answer = tokenizer.encode(str(v), add_special_tokens=False) + [tokenizer.eos_token_id]
            with torch.no_grad():
                logp = model(input_ids=torch.tensor([ids + answer])).logits[0].log_softmax(-1)
            want = sum(logp[len(ids) - 1 + j, t] for j, t in enumerate(answer))
            torch.testing.assert_close(got[row, col], want, rtol=0, atol=1e-4)
            with torch.no_grad():  # the answer one position further from the query (a padding-sized slip)
                pos = list(range(len(ids))) + list(range(len(ids) + 1, len(ids) + 1 + len(answer)))
                shifted = model(input_ids=torch.tensor([ids + answer]), position_ids=torch.tensor([pos]))
            logp = shifted.logits[0].log_softmax(-1)
            assert abs(sum(logp[len(ids) - 1 + j, t] for j, t in enumerate(answer)) - want) > 1e-2


def test_expected_readout_reads_the_learned_bucket(tokenizer):
    from ecru.models import tiny_llama

    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(25)
    every_linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    config = SelfLoRAConfig(lr=2e-2, epochs=6, batch_size=4, dropout=0.0, target_modules=every_linear,
                            readout="expected")  # fmt: skip
    predictor = SelfLoRAPredictor(model, tokenizer, config=config)
    seen = []  # after_epoch runs in eval mode, once per epoch
    predictor.fit(
        [f"question number {i}" for i in range(8)],
        [140.0] * 8,
        progress=False,
        after_epoch=lambda e: seen.append((e, predictor.model.training)),
    )  # bucket 150; fmt: skip
    assert seen == [(e, False) for e in range(1, 7)] and predictor.model.training is False
    got = predictor.predict(["an unseen question", "another one"])
    assert all(abs(x - 150) < 5 for x in got), got  # nearly all the probability on "150"
    with pytest.raises(ValueError, match="readout must be one of greedy, expected"):
        SelfLoRAConfig(readout="mean")


def test_ridge_cv_is_the_out_of_fold_spearman_of_each_penalty():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(23, 6, generator=g)
    y = x[:, 0] - x[:, 1] + 0.3 * torch.randn(23, generator=g)
    scores = ridge_cv(x, y, (0.1, 100.0), folds=4, seed=3)
    perm = torch.randperm(23, generator=torch.Generator().manual_seed(3)).tolist()
    for lam in (0.1, 100.0):
        oof = [0.0] * 23
        for f in range(4):  # by hand: rows perm[f], perm[f + 4], ... held out
            held = perm[f::4]
            kept = [i for i in range(23) if i not in held]
            w, b = ridge_fit(x[kept], y[kept], lam=lam)
            for i in held:
                oof[i] = float(x[i] @ w + b)
        assert scores[lam] == pytest.approx(spearman(oof, y.tolist()))
    assert scores[0.1] > 0.8


def test_embedding_predictor_reads_the_models_own_embedding_rows(model):
    from ecru.serve import EmbeddingPredictor

    table = model.get_input_embeddings().weight.detach()
    g = torch.Generator().manual_seed(0)
    ids = [
        torch.randint(3, 64, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (80,), generator=g)
    ]
    truth = torch.randn(table.shape[1], generator=g)
    labels = [float(40 + 20 * table[i].mean(0) @ truth) for i in ids]  # linear in the mean embedding
    p = EmbeddingPredictor(model, None, cap=400).fit_ids(ids[:60], labels[:60])
    assert p.lam == min(p.LAMS) and set(p.cv) == set(p.LAMS)  # noise-free: the least penalty wins
    torch.testing.assert_close(p.id_features(ids[:2]), torch.stack([table[i].mean(0) for i in ids[:2]]))
    got = p.predict_ids(ids[60:])
    assert spearman(got, labels[60:]) > 0.95  # unseen prompts
    assert p.engine_predict(ids[61], None) == pytest.approx(got[1])
    with pytest.raises(ValueError, match="empty prompt"):
        p.predict_ids([[]])
    for bad in ([3, 64], [-1, 5]):  # past the vocabulary of 64, or negative (which would wrap around)
        with pytest.raises(ValueError, match="outside the model's vocabulary of 64"):
            p.predict_ids([bad])
    with pytest.raises(RuntimeError, match="not fitted"):
        EmbeddingPredictor(model, None).predict_ids(ids[:1])


def test_constant_labels_rank_nothing_and_the_smallest_penalty_is_kept(model):
    from ecru.serve import EmbeddingPredictor

    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 3, generator=g)
    assert ridge_cv(x, torch.full((20,), 7.0), (0.1, 1.0)) == {0.1: None, 1.0: None}
    ids = [[i, i + 1] for i in range(3, 23)]
    p = EmbeddingPredictor(model, None).fit_ids(ids, [7.0] * 20)
    assert p.lam == min(p.LAMS) and p.predict_ids([[40, 41]]) == pytest.approx([7.0])


def test_a_predictor_that_raises_leaves_no_request_behind(model, gen):
    from ecru.serve import EngineConfig, RequestEngine, SamplingParams

    def refuses(prompt, params):
        raise ValueError("no prediction")

    engine = RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id,
                           config=EngineConfig(policy="cb-sjf", max_new_tokens=8), predict=refuses)  # fmt: skip
    with pytest.raises(ValueError, match="no prediction"):
        engine.add_request([5, 6], SamplingParams(max_tokens=8), request_id="a")
    assert not engine.has_unfinished() and not engine.requests
    engine.predict = lambda prompt, params: 3.0
    assert engine.add_request([5, 6], SamplingParams(max_tokens=8), request_id="a").predicted == 3.0


def test_the_engine_queues_a_request_at_the_embedding_predictors_length(model, gen):
    from ecru.serve import EmbeddingPredictor, EngineConfig, RequestEngine, SamplingParams

    ids = [[5, 6, 7], [9, 9, 30, 41], [12], [50, 3, 3]]
    p = EmbeddingPredictor(model, None, lam=1.0, cap=24).fit_ids(ids, [3.0, 20.0, 7.0, 15.0])
    engine = RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id,
                           config=EngineConfig(policy="cb-sjf", max_new_tokens=24), predict=p.engine_predict)  # fmt: skip
    reqs = [engine.add_request(i, SamplingParams(max_tokens=24)) for i in ids]
    assert [r.predicted for r in reqs] == pytest.approx(p.predict_ids(ids))
