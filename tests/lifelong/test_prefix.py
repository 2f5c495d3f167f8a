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
