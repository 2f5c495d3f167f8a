"""Bad input: a clear error at construction or at the first step, before any weight is changed."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from ecru.errors import EcruError
from ecru.l2l import L2L, L2LConfig, L2LInputError
from ecru.models import tiny_llama

from .helpers import lm_batch

SGD = functools.partial(torch.optim.SGD, lr=0.1)


@pytest.fixture
def engine():
    return L2L.from_hf(tiny_llama(), optimizer=SGD, config=L2LConfig(micro_batch_size=2))


def _without(batch: dict, key: str) -> dict:
    return {k: v for k, v in batch.items() if k != key}


BAD_BATCHES = {
    "no labels": (_without(lm_batch(), "labels"), "no 'labels'"),
    "labels shape": ({**lm_batch(), "labels": lm_batch()["labels"][:, :-1]}, "labels has shape"),
    "mask shape": (
        {**lm_batch(), "attention_mask": lm_batch()["attention_mask"][:3]},
        "attention_mask has shape",
    ),
    "no targets": ({**lm_batch(), "labels": torch.full((5, 12), -100)}, "no target token"),
    "ids out of vocab": (
        {**lm_batch(), "input_ids": lm_batch()["input_ids"] + 1000},
        r"input_ids must lie in \[0, 128\)",
    ),
    "labels out of vocab": (
        {**lm_batch(), "labels": lm_batch()["labels"].clamp_min(0) + 500},
        "labels must lie",
    ),
    "not a dict": ((lm_batch()["input_ids"],), "dict with input_ids"),
    "float ids": ({**lm_batch(), "input_ids": lm_batch()["input_ids"].float()}, "int64"),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_bad_batch_errors_before_any_update(engine, case):
    batch, message = BAD_BATCHES[case]
    before = copy.deepcopy(engine.state_dict())
    with pytest.raises(L2LInputError, match=message):
        engine.step(batch)
    for name, value in engine.state_dict().items():
        torch.testing.assert_close(value, before[name], atol=0, rtol=0)
    engine.step(lm_batch())  # the engine is still usable


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size must be an integer >= 1"),
        ({"micro_batch_size": 1.5}, "micro_batch_size must be an integer"),
        ({"compute_dtype": "int8"}, "compute_dtype 'int8' is unknown"),
        ({"stash": "nvme"}, "stash must be one of"),
        ({"device": "gpu0"}, "not a device name"),
        ({"max_grad_norm": 0.0}, "max_grad_norm must be > 0"),
    ],
)
def test_bad_config(kwargs, message):
    with pytest.raises(L2LInputError, match=message):
        L2LConfig(**kwargs)


def test_missing_device_errors_at_construction():
    device = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(L2LInputError, match="does not exist|not available"):
        L2L.from_hf(tiny_llama(), optimizer=SGD, config=L2LConfig(device=device))


def test_unsupported_model_says_what_fits_and_names_from_sequential():
    with pytest.raises(L2LInputError, match=r"decoder-only Hugging Face causal LM.*from_sequential"):
        L2L.from_hf(nn.Linear(2, 2), optimizer=SGD)


def test_optimizer_must_be_a_factory():
    with pytest.raises(L2LInputError, match="callable params -> torch.optim.Optimizer"):
        L2L.from_hf(tiny_llama(), optimizer=torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))


def test_input_errors_are_ecru_errors_for_the_cli():
    assert issubclass(L2LInputError, EcruError) and issubclass(L2LInputError, ValueError)


def test_sequential_bad_batches_and_a_failing_forward_leave_weights_unchanged():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    engine = L2L.from_sequential(seq, loss_fn=nn.MSELoss(), optimizer=SGD)
    before = copy.deepcopy(engine.state_dict())
    with pytest.raises(L2LInputError, match="same leading batch dimension"):
        engine.step((torch.randn(3, 4), torch.randn(2, 2)))
    with pytest.raises(L2LInputError, match=r"tuple \(inputs, targets\)"):
        engine.step(torch.randn(3, 4))
    with pytest.raises(RuntimeError):  # wrong feature size: fails inside the forward, before any update
        engine.step((torch.randn(3, 5), torch.randn(3, 2)))
    for name, value in engine.state_dict().items():
        torch.testing.assert_close(value, before[name], atol=0, rtol=0)
    with pytest.raises(L2LInputError, match="non-empty nn.Sequential"):
        L2L.from_sequential(nn.Linear(2, 2), loss_fn=nn.MSELoss(), optimizer=SGD)


def test_blocks_sharing_a_weight_are_refused():
    shared = nn.Linear(4, 4)
    with pytest.raises(L2LInputError, match="shared between block 0 and block 1"):
        L2L.from_sequential(nn.Sequential(shared, shared), loss_fn=nn.MSELoss(), optimizer=SGD)
