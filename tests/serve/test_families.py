"""The request engine on decoder families beyond Llama, run by each model's own code: greedy answers equal Hugging
Face `generate` of each prompt alone while rows join and leave a left-padded batch, sliding windows included
(windows of 4-5 tokens, answers of 24: the window bites)."""

from __future__ import annotations

import pytest
import torch

from ecru.models import tiny_gpt2
from ecru.serve.engine.request_engine import EngineConfig, RequestEngine
from ecru.serve.engine.sampling import SamplingParams
from tests.l2l.helpers import FAMILIES, tiny_family

from .conftest import RunsLong

MAX_NEW = 24
LENGTHS = (3, 9, 5, 14, 7, 20, 4, 11)


def family(name: str):
    return tiny_gpt2() if name == "gpt2" else tiny_family(name)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in LENGTHS]


def alone(model, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=2, pad_token_id=0)  # fmt: skip
        out.append(gen[0, len(p) :].tolist())
    return out


class ByLength:
    """A state predictor (prefill on arrival) that predicts a prompt's own length from nothing but its row."""

    def __init__(self):
        self.rows = 0

    def predict_states(self, pooled: torch.Tensor) -> list[float]:
        self.rows += len(pooled)
        return [float(3 + 2 * i) for i in range(len(pooled))]


def served(model, prompts, *, state_predictor=None, **kw) -> tuple[list[list[int]], RequestEngine]:
    config = EngineConfig(**{"max_batch_size": 3, "max_new_tokens": MAX_NEW, "refill_min": 1, **kw})
    srpt = (
        config.policy == "cb-srpt"
    )  # waiting requests predicted 1 token long, running rows far longer: swapped
    engine = RequestEngine(model, eos_token_ids=[2], pad_token_id=0, config=config, state_predictor=state_predictor,
                           remaining=RunsLong() if srpt else None, predict=(lambda p, s: 1.0) if srpt else None)  # fmt: skip
    assert engine.runner.prefixes is not None  # every layer keeps its whole KV: prefix caching is on
    return [r.output for r in engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))], engine


@pytest.mark.parametrize("name", [*FAMILIES, "gpt2"])
def test_greedy_answers_equal_generate_alone(name, prompts):
    """Sliding-window layers (Mistral, Phi-3, Qwen 2/3, Gemma 2/3) crashed at the first merge: Hugging Face's
    sliding layer keeps only the window, whose columns are not the batch's."""
    model = family(name)
    assert served(model, prompts)[0] == alone(model, prompts)


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_kept_kv_on_a_sliding_window_model_answers_alike(name, prompts):
    """cb-srpt's kept preemption and prefill on arrival keep a request's KV while it waits: whole on these layers
    too (they were refused for sliding-window models)."""
    model = family(name)
    want = alone(model, prompts)
    got, engine = served(model, prompts, policy="cb-srpt", repredict_every=4, preempt_margin=0.0)
    assert got == want and engine.stats.preemptions > 0
    arrival = ByLength()
    got, engine = served(model, prompts, policy="cb-sjf", state_predictor=arrival)
    assert got == want and arrival.rows == len(prompts) and engine.stats.arrival_prefill_forwards > 0
