"""Bundled real models, loaded offline: SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2."""

from ecru.models.cache import cache_dir
from ecru.models.minilm import MiniLM, load_minilm
from ecru.models.smollm2 import load_smollm2, smollm2_gguf_path
from ecru.models.tiny import tiny_gpt2, tiny_llama

__all__ = [
    "MiniLM",
    "cache_dir",
    "load_minilm",
    "load_smollm2",
    "smollm2_gguf_path",
    "tiny_gpt2",
    "tiny_llama",
]
