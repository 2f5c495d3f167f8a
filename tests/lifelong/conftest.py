"""A tiny randomly initialised 6-layer BERT behind MiniLM's tokenizer: the methods' mechanics in seconds."""

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from ecru.lifelong import Evaluator, StreamConfig, build_clinc_stream
from ecru.models import MiniLM
from ecru.models.minilm import minilm_dir


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(minilm_dir())


@pytest.fixture
def tiny_model(tokenizer):
    def make() -> MiniLM:
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)  # fmt: skip
        return MiniLM(BertModel(cfg, add_pooling_layer=False), tokenizer, max_length=32).eval()

    return make


@pytest.fixture(scope="session")
def tiny_stream():
    return build_clinc_stream(
        StreamConfig(tasks=2, train_per_intent=2, test_per_intent=1, heldout_per_class=1, reference_size=24)
    )


@pytest.fixture(scope="session")
def tiny_evaluator(tiny_stream):
    return Evaluator(tiny_stream)
