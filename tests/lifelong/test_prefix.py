import torch

from ecru.lifelong.prefix import FrozenPrefix, PrefixCachedEncoder

TEXTS = [
    "what is my balance",
    "please freeze my account right now, it was stolen yesterday",
    "hi",
    "book a table",
]


def test_cached_prefix_reproduces_the_full_forward(tiny_model):
    model = tiny_model()
    for k in (0, 3, 6):
        enc = PrefixCachedEncoder(model, FrozenPrefix(model, k))
        # a different batch composition than the reference: padding must not change the result
        got = torch.cat([enc.encode(TEXTS[:1]), enc.encode(TEXTS[1:])])
        torch.testing.assert_close(got, model.encode(TEXTS), rtol=1e-5, atol=1e-6)


def test_gradients_flow_to_top_layers_only_and_match_the_full_forward(tiny_model):
    model, ref = tiny_model(), tiny_model()
    enc = PrefixCachedEncoder(model, FrozenPrefix(model, 4))
    enc(TEXTS).sum().backward()
    ref(TEXTS).sum().backward()
    for (name, p), q in zip(model.encoder.named_parameters(), ref.encoder.parameters(), strict=True):
        if ".layer.4." in name or ".layer.5." in name:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        else:
            assert p.grad is None, name


def test_each_text_goes_through_the_frozen_layers_once(tiny_model):
    model = tiny_model()
    prefix = FrozenPrefix(model, 3)
    enc = PrefixCachedEncoder(model, prefix)
    enc.encode(TEXTS)
    enc.encode(TEXTS[::-1])
    enc(TEXTS[:2])
    assert prefix.encoded == len(TEXTS)
    prefix.drop(TEXTS[:1])
    enc.encode(TEXTS)
    assert prefix.encoded == len(TEXTS) + 1


def test_the_cache_is_bounded_and_evictions_do_not_change_results(tiny_model):
    model = tiny_model()
    prefix = FrozenPrefix(model, 3, max_items=2)
    enc = PrefixCachedEncoder(model, prefix)
    got = enc.encode(TEXTS, batch_size=4)  # a batch larger than the cache
    assert len(prefix) == 2
    torch.testing.assert_close(got, model.encode(TEXTS), rtol=1e-5, atol=1e-6)
    enc.encode(TEXTS[:1])
    assert len(prefix) == 2 and prefix.encoded == len(TEXTS) + 1  # the first text was evicted, recomputed


def test_the_routed_encoder_s_memo_is_bounded(tiny_model, tiny_evaluator):
    from ecru.lifelong import TrainConfig, make_method
    from ecru.lifelong.methods.routed import RoutedEncoder

    method = make_method(
        "routed-lora", tiny_model(), train=TrainConfig(epochs=1, batch_size=8, progress=False)
    )
    method.learn(tiny_evaluator.stream.tasks[0], index=0)
    texts = [e.text for t in tiny_evaluator.stream.tasks for e in t.train + t.test]
    labels = ["freeze account", "book a flight"]
    small = RoutedEncoder(method, memo_items=5)
    torch.testing.assert_close(small.scores(texts, labels), method.encoder().scores(texts, labels))
    assert len(small._memo) <= 5
