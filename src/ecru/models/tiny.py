"""Small random Hugging Face models for tests and benchmarks (same code paths as the real ones)."""

from __future__ import annotations

import torch


def tiny_llama(
    *,
    vocab_size: int = 128,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    attn_implementation: str = "sdpa",
):
    """A random Llama (SmolLM2's architecture) in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(
    *, vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 2, seed: int = 0, dropout: float = 0.0
):
    """A random GPT-2 in fp32 (learned positions, tied head)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=hidden_size,
        n_layer=num_layers,
        n_head=4,
        n_positions=256,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()
