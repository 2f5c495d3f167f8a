"""The models `ecru serve` runs: SmolLM2-135M-Instruct, a tiny random Llama with SmolLM2's tokenizer (for
tests), or any local Hugging Face causal-LM folder (its own tokenizer and chat template)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ecru.errors import EcruError
from ecru.serve.engine.static import GenerationConfig, context_length

if TYPE_CHECKING:
    from ecru.serve.engine.request_engine import PredictLength
    from ecru.serve.predict.predictors import StatePredictor

MODELS = ("smollm2", "tiny")


def load_model(name: str):
    """`(model, tokenizer)` in eval mode on the CPU: "smollm2", "tiny" (SmolLM2's tokenizer and chat
    template on a random 2-layer Llama) or the path of a local Hugging Face model folder."""
    if name not in MODELS:
        return _load_folder(name)
    from ecru.models import load_smollm2, tiny_llama

    model, tokenizer = load_smollm2()
    if name == "tiny":
        model = tiny_llama(vocab_size=len(tokenizer), hidden_size=64, num_layers=2, seed=0)
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.eos_token_id = tokenizer.eos_token_id
    return model.to(torch.float32).eval(), tokenizer


def _load_folder(name: str):
    from ecru.models.folder import load_causal_lm

    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise EcruError(
            f"unknown model {name!r}: give {', '.join(MODELS)} or a local Hugging Face model folder "
            "(with config.json, weights and a tokenizer)"
        )
    model, tokenizer = load_causal_lm(path)
    try:
        GenerationConfig.for_model(model, tokenizer)
    except ValueError as exc:
        raise EcruError(f"{path}: {exc}") from None
    return model, tokenizer


@dataclass
class ServedModel:
    """A loaded model with what serving needs: its name, EOS and padding ids, context length, chat template."""

    name: str
    model: object
    tokenizer: object

    @classmethod
    def load(cls, name: str, *, packed: bool = True) -> ServedModel:
        """`load_model(name)`; `packed`: its linear layers multiply by pre-packed weights on the CPU
        (`ecru.serve.engine.packed`, faster decode steps, one more copy of the linear layers' weights in
        memory)."""
        model, tokenizer = load_model(name)
        if packed:
            from ecru.serve.engine.packed import pack_linears_

            pack_linears_(model)
        return cls(name, model, tokenizer)

    def describe(self) -> str:
        """What was loaded, for a front end to print: the name, and the packed weights' extra memory."""
        from ecru.serve.engine.packed import packed_bytes, packed_layers

        layers = len(packed_layers(self.model))
        extra = f", {layers} linear layers pre-packed (+{packed_bytes(self.model) / 2**20:.0f} MiB)"
        return f"{self.name}{extra if layers else ''}"

    @property
    def generation(self) -> GenerationConfig:
        """The EOS and padding ids (`GenerationConfig.for_model`: the tokenizer's and the model's)."""
        return GenerationConfig.for_model(self.model, self.tokenizer)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.generation.eos_token_ids

    @property
    def pad_token_id(self) -> int:
        return self.generation.pad_token_id

    @property
    def context_len(self) -> int:
        return context_length(self.model)

    def encode(self, prompt: str) -> list[int]:
        """A raw completion prompt's token ids (the tokenizer's special tokens, e.g. BOS, included)."""
        return list(self.tokenizer(prompt)["input_ids"])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for. A byte-level BPE token may be part of a UTF-8 character,
        which `decode` shows as U+FFFD; its own bytes are read through the byte-level alphabet (SentencePiece's
        byte fallback tokens `<0xNN>` are that byte; other tokens, their decoded text)."""
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        table = _byte_of() if _byte_level(self.tokenizer) else {}
        if table and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return self.tokenizer.decode([int(token_id)]).encode("utf-8")

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        """Messages through the model's chat template, ready for the assistant's answer."""
        from ecru.serve.prompts import chat_ids

        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.name} has no chat template: send a raw prompt to /v1/completions")
        return chat_ids(self.tokenizer, messages)

    def engine(
        self,
        config,
        *,
        state_predictor: StatePredictor | None = None,
        remaining=None,
        predict: PredictLength | None = None,
    ):
        """A `RequestEngine` for this model (`state_predictor`, e.g. a fitted `ProbePredictor` of this
        model: prefill on arrival; `remaining`, a fitted `RemainingProbe` of this model: cb-srpt's
        re-prediction; `predict`, e.g. a fitted `EmbeddingPredictor`'s `engine_predict`: each request's
        predicted length, its key in cb-sjf's and cb-srpt's queue; see `request_engine`)."""
        from ecru.serve.engine.request_engine import RequestEngine

        return RequestEngine(
            self.model,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            config=config,
            tokenizer=self.tokenizer,
            context_len=self.context_len,
            state_predictor=state_predictor,
            remaining=remaining,
            predict=predict,
        )


def _byte_level(tokenizer) -> bool:
    """Whether `tokenizer` decodes through GPT-2's byte-level alphabet (a fast tokenizer's `ByteLevel` decoder)."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)  # slow tokenizers have none
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


@functools.cache
def _byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> the byte it stands for (Hugging Face's own table)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}
