"""The models `ecru serve` runs: SmolLM2-135M-Instruct, or a tiny random Llama with SmolLM2's tokenizer."""

from __future__ import annotations

import torch

from ecru.errors import EcruError

MODELS = ("smollm2", "tiny")


def load_model(name: str, *, seed: int = 0):
    """`(model, tokenizer)` in eval mode on the CPU; "tiny" shares SmolLM2's tokenizer and chat template."""
    from ecru.models import load_smollm2, tiny_llama

    if name not in MODELS:
        raise EcruError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    model, tokenizer = load_smollm2()
    if name == "tiny":
        model = tiny_llama(vocab_size=len(tokenizer), hidden_size=64, num_layers=2, seed=seed)
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.eos_token_id = tokenizer.eos_token_id
    return model.to(torch.float32).eval(), tokenizer
