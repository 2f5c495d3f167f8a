"""The frozen initial model's embeddings of the reference sentences, computed once and cached.

ZSCL's reference code recomputes the teacher's outputs on every step; the teacher never changes, so ecru
encodes the reference set once per process and keeps it on disk keyed by the texts and the model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ecru.io import load_tensors, save_tensors
from ecru.lifelong.evaluate import Encoder, encode_sorted


def _key(texts: tuple[str, ...], model_id: str) -> str:
    h = hashlib.sha256(model_id.encode())
    for t in texts:
        h.update(t.encode() + b"\0")
    return h.hexdigest()[:16]


class TeacherCache:
    """Teacher embeddings [N, D] of `texts`, encoded at most once (in memory, and on disk if `folder`)."""

    def __init__(
        self, texts: tuple[str, ...], teacher: Encoder, *, model_id: str, folder: Path | None = None
    ):
        self.texts, self.teacher = tuple(texts), teacher
        self.path = (
            None if folder is None else Path(folder) / f"teacher-{_key(self.texts, model_id)}.safetensors"
        )
        self.computed = 0
        """How many times the teacher actually encoded the reference set (tests check it stays <= 1)."""
        self._emb: torch.Tensor | None = None

    def embeddings(self) -> torch.Tensor:
        if self._emb is None and self.path is not None and self.path.is_file():
            self._emb = load_tensors(self.path, hint="delete it to encode again")[0]["embeddings"]
        if self._emb is None:
            self._emb = encode_sorted(self.teacher, list(self.texts))
            self.computed += 1
            if self.path is not None:
                save_tensors(self.path, {"embeddings": self._emb})
        return self._emb
