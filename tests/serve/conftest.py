"""Shared fixtures: a tiny random Llama whose greedy answers vary in length, and prompts as token ids."""

import pytest
import torch

from ecru.models import tiny_llama
from ecru.serve import GenerationConfig

VOCAB, MAX_NEW = 64, 24


class RunsLong:
    """A cb-srpt remaining-length predictor (`request_engine.RemainingPredictor`) that predicts every running
    row to run far past its cap, and records the states and token counts it was given."""

    def __init__(self):
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def predict(self, states: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.seen.append((states.clone(), t.clone()))
        return torch.full((len(t),), 1000.0)


def remaining_for(policy: str) -> RunsLong | None:
    return RunsLong() if policy == "cb-srpt" else None


def chaotic_llama():
    """tiny_llama with larger weights: greedy outputs do not collapse into one repeated token."""
    model = tiny_llama(vocab_size=VOCAB, seed=1)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.35)
    return model


@pytest.fixture(scope="session")
def model():
    return chaotic_llama()


@pytest.fixture(scope="session")
def gen():
    # two EOS ids so that answers end at many different lengths (1 .. MAX_NEW)
    return GenerationConfig(eos_token_ids=(2, 35), pad_token_id=0)


@pytest.fixture(scope="session")
def prompts():
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 12, (24,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="session")
def reference(model, prompts, gen):
    """Unscheduled greedy generation: each prompt alone through Hugging Face `generate`."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        full = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=list(gen.eos_token_ids),
            pad_token_id=gen.pad_token_id,
        )
        out.append(full[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="session")
def max_new():
    return MAX_NEW


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """A local Hugging Face model folder (save_pretrained): a chaotic random Llama with SmolLM2's tokenizer
    and chat template, so greedy answers are varied text. Served as `--model PATH`."""
    from ecru.models import load_smollm2

    _, tokenizer = load_smollm2()
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, seed=3)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.config.eos_token_id = model.config.pad_token_id = tokenizer.eos_token_id
    model.config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    path = tmp_path_factory.mktemp("models") / "tiny-chat"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def bench_serve(monkeypatch):
    """bench/serve.py as a module (`serve` in sys.modules while the test runs)."""
    import sys

    from tests.bench_scripts import load_bench_script

    monkeypatch.setitem(sys.modules, "serve", None)  # taken out again after the test
    return load_bench_script("serve")
