"""Pre-packed linear layers: the same products as `F.linear` within fp32 rounding, the same Parameters, a
fresh pack after the weight changes, `F.linear` itself outside the packed range, and the engine's greedy
answers on a packed model equal to Hugging Face `generate` on the plain one."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ecru.models import tiny_llama
from ecru.serve.engine.packed import ROWS, PackedLinear, pack_linears_, packing_available, unpack_linears_
from ecru.serve.engine.request_engine import EngineConfig, RequestEngine
from ecru.serve.engine.sampling import SamplingParams
from ecru.serve.sched.names import ENGINE_POLICIES

from .conftest import remaining_for

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")


def layer(bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(96, 200, bias=bias)


@pytest.mark.parametrize("shape", [(2, 96), (16, 96), (64, 96), (4, 5, 96), (1, 3, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_product_equals_f_linear_within_fp32_rounding(shape, bias):
    plain = layer(bias)
    packed = PackedLinear(plain)
    x = torch.randn(shape)
    with torch.no_grad():
        # 96 products of unit-scale terms: rounding differences stay near 1e-6 of the sum's scale
        torch.testing.assert_close(packed(x), F.linear(x, plain.weight, plain.bias), rtol=1e-5, atol=1e-5)


def test_non_contiguous_rows_are_multiplied_as_given():
    packed = PackedLinear(layer())
    x = torch.randn(8, 3, 96)[:, 1]  # 8 rows with a stride of 3 x 96
    with torch.no_grad():
        torch.testing.assert_close(packed(x), F.linear(x, packed.weight, packed.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, ROWS[1] + 1])
def test_outside_the_packed_range_it_is_f_linear_exactly(rows, monkeypatch):
    packed = PackedLinear(layer())
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", None, raising=False)  # any use would fail
    x = torch.randn(rows, 96)
    with torch.no_grad():
        assert torch.equal(packed(x), F.linear(x, packed.weight, packed.bias))


def test_autograd_goes_through_f_linear_and_trains_the_shared_weight():
    plain = layer()
    packed = PackedLinear(plain)
    assert packed.weight is plain.weight and packed.bias is plain.bias
    x = torch.randn(4, 96)
    packed(x).sum().backward()
    assert torch.allclose(plain.weight.grad, x.sum(0).expand(200, 96))  # d(sum of W x)/dW = sum of x rows


class Counting:
    """Counts the packed products (wraps `torch.ops.mkldnn._linear_pointwise`)."""

    def __init__(self, monkeypatch):
        self.calls, self.op = 0, torch.ops.mkldnn._linear_pointwise
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", self)

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


def test_a_replaced_or_loaded_weight_is_packed_again():
    packed = PackedLinear(layer())
    x = torch.randn(8, 96)
    with torch.no_grad():
        packed(x)
        packed.weight = nn.Parameter(layer(seed=1).weight.clone())
        expected = F.linear(x, packed.weight, packed.bias)
        torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)
        packed.load_state_dict(layer(seed=2).state_dict())
        torch.testing.assert_close(packed(x), layer(seed=2)(x), rtol=1e-5, atol=1e-5)


def test_other_dtypes_copies_and_inference_weights_work():
    x = torch.randn(8, 96)
    with torch.no_grad():
        packed = PackedLinear(layer())
        twin = copy.deepcopy(packed)  # the opaque packed copy is left behind and remade
        torch.testing.assert_close(twin(x), packed(x), rtol=0, atol=0)
        half = PackedLinear(layer()).to(torch.bfloat16)
        assert torch.equal(half(x.bfloat16()), F.linear(x.bfloat16(), half.weight, half.bias))
    with torch.inference_mode():
        made_here = PackedLinear(layer())
        torch.testing.assert_close(made_here(x), F.linear(x, made_here.weight, made_here.bias), rtol=1e-5,
                                   atol=1e-5)  # fmt: skip


def test_a_weight_written_in_place_is_packed_again():
    packed = PackedLinear(layer())
    x = torch.randn(8, 96)
    with torch.no_grad():
        before = packed(x)
        packed.weight.mul_(2)
        after = packed(x)
    torch.testing.assert_close(after - packed.bias, 2 * (before - packed.bias), rtol=1e-5, atol=1e-5)


def test_only_weights_of_min_size_are_packed():
    model = tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=64, seed=3)  # MLP 2,048; head 2,048
    assert pack_linears_(model, min_size=2048) == 2 * 3 + 1  # gate, up, down per layer and the LM head
    assert all(type(m) is nn.Linear for m in model.model.layers[0].self_attn.children() if m._parameters)


def test_biases_mode_and_hooked_layers_survive_pack_and_unpack():
    model = nn.Sequential(layer(bias=True), nn.ReLU(), layer(bias=True, seed=1)).eval()
    model[2].weight = nn.Parameter(torch.randn(200, 200))
    model[2].register_forward_hook(lambda *a: None)  # e.g. accelerate's: left as it is
    x = torch.randn(4, 96)
    with torch.no_grad():
        before = model(x)
        assert pack_linears_(model, min_size=0) == 1
        assert type(model[0]) is PackedLinear and type(model[2]) is nn.Linear and not model[0].training
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
        assert unpack_linears_(model) == 1
        assert type(model[0]) is nn.Linear and not model[0].training and model[0].bias is not None
        assert torch.equal(model(x), before)


def test_a_failed_pack_leaves_the_model_plain(monkeypatch):
    def fail(*args):
        raise RuntimeError("no packed layout here")

    model = nn.Sequential(layer())
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", fail)
    assert pack_linears_(model, min_size=0) == 0
    assert type(model[0]) is nn.Linear


def test_pack_and_unpack_keep_parameters_ties_and_state_dict():
    model = tiny_llama(vocab_size=64, seed=3)
    model.tie_weights()
    keys, params = list(model.state_dict()), {n: p for n, p in model.named_parameters()}
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears_(model, min_size=0) == linears > 0
    assert sum(type(m) is PackedLinear for m in model.modules()) == linears
    assert pack_linears_(model, min_size=0) == linears  # already packed: packed afresh
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert unpack_linears_(model) == linears
    assert sum(type(m) is nn.Linear for m in model.modules()) == linears
    assert all(p is params[n] for n, p in model.named_parameters())


@pytest.fixture(scope="module")
def packed_model(model):
    packed = copy.deepcopy(model)
    assert pack_linears_(packed, min_size=0) > 0
    return packed


@pytest.mark.parametrize("policy", ENGINE_POLICIES)
def test_engine_on_a_packed_model_answers_as_generate_on_the_plain_one(packed_model, prompts, reference, gen,
                                                                        policy, monkeypatch):  # fmt: skip
    products = Counting(monkeypatch)
    config = EngineConfig(max_new_tokens=24, max_batch_size=4, refill_min=2, policy=policy)
    engine = RequestEngine(packed_model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id,
                           config=config, remaining=remaining_for(policy))  # fmt: skip
    reqs = engine.generate(prompts, SamplingParams(max_tokens=24))
    assert [r.output for r in reqs] == reference  # conftest: each prompt alone through `generate`, unpacked
    assert products.calls > 0  # the packed path ran
