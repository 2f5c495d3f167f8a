"""Frozen weights read in place: a model whose frozen parameters stay in the model folder's safetensors.

A LoRA fine-tune of a model larger than host memory cannot load the model first. `empty_model(folder)`
builds it with every parameter on the meta device (shapes only; buffers such as rotary frequencies are
real), a peft wrapper adds its adapter on top (`init_adapters_` gives the adapter real, freshly
initialised values), and `FolderWeights` hands the disk tier each frozen parameter's tensor straight
from the folder's safetensors when its block is used: memory-mapped, in the dtype the file holds (a bf16
base stays bf16; the store upcasts per block where the compute dtype needs it), dropped again with the
block. The store's own files then hold trainable state only (ecru.l2l.disk).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from ecru.l2l.config import L2LInputError

INDEX = "model.safetensors.index.json"
_PEFT_PREFIX = "base_model.model."


class FrozenWeights(Protocol):
    """Where the values of parameters the model holds on the meta device come from."""

    def read(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        """The tensors of `params`, in the dtype they are stored in (memory-mapped where that is a file)."""
        ...


def checkpoint_name(name: str, prefix: str = "") -> str:
    """The key of parameter `name` in the base model's safetensors: without peft's wrapper prefix and
    `base_layer` (the frozen layer a LoRA layer wraps) and, for files saved without it, `prefix`."""
    name = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
    return name.removeprefix(f"{prefix}.") if prefix else name


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor key -> the safetensors file holding it (a single file or the sharded index)."""
    from safetensors import safe_open

    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise L2LInputError(f"{folder} holds no safetensors weights; frozen_weights needs a model folder")
    where: dict[str, Path] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), path))
    return where


class FolderWeights:
    """`FrozenWeights` from a Hugging Face model folder, for the parameters of `model` on the meta device
    (checked at construction: a missing tensor or another shape is one error naming it)."""

    def __init__(self, folder: str | os.PathLike, model: nn.Module):
        self.folder = Path(folder)
        where = _tensor_files(self.folder)
        prefix = getattr(model, "base_model_prefix", "") or ""
        self._keys: dict[int, tuple[Path, str]] = {}
        shapes: dict[str, list[int]] = {}
        for name, p in model.named_parameters():
            if p.is_meta:
                names = (checkpoint_name(name), checkpoint_name(name, prefix))
                key = next((k for k in names if k in where), None)
                if key is None:
                    raise L2LInputError(
                        f"parameter {checkpoint_name(name)} is not in the safetensors of {self.folder}; "
                        "give frozen_weights the folder the model was built from"
                    )
                self._keys[id(p)], shapes[key] = (where[key], key), list(p.shape)
        _check_shapes(where, shapes)

    def read(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        from safetensors import safe_open

        out: list[torch.Tensor] = []
        for p in params:
            path, key = self._keys[id(p)]
            with safe_open(path, framework="pt") as f:  # get_tensor maps the file: no copy until read
                out.append(f.get_tensor(key))
        return out


def _check_shapes(where: dict[str, Path], shapes: dict[str, list[int]]) -> None:
    from safetensors import safe_open

    for path in sorted({where[k] for k in shapes}):
        with safe_open(path, framework="pt") as f:
            for key in (k for k in shapes if where[k] == path):
                if f.get_slice(key).get_shape() != shapes[key]:
                    raise L2LInputError(
                        f"{key} in {path} has shape {f.get_slice(key).get_shape()}, the model {shapes[key]}"
                    )


def empty_model(folder: str | os.PathLike) -> nn.Module:
    """The causal LM of `folder` with its parameters on the meta device and real buffers, in fp32 (as the
    CLI loads a model whole); nothing is read from its weight files."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # tied as a loaded model is (outside the context, which leaves them apart)
    return model


def init_adapters_(model: nn.Module, *, seed: int) -> None:
    """Every LoRA adapter of `model` (peft) on the CPU with peft's initial values drawn from `seed`, the
    same whether the base was loaded or built empty: peft adds an adapter on the device of the layer it
    wraps (meta for an empty base, where nothing is drawn), and on the CPU its `nn.Linear`s draw their
    own init first, so the draws differ unless made again here (`reset_lora_parameters`, in module order)."""
    from peft.tuners.lora import LoraLayer

    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        for module in model.modules():
            if isinstance(module, LoraLayer):
                adapters = (module.lora_A, module.lora_B, module.lora_embedding_A, module.lora_embedding_B)
                for adapter_dict in adapters:
                    adapter_dict.to_empty(device="cpu")
                for adapter in module.lora_A.keys() | module.lora_embedding_A.keys():
                    module.reset_lora_parameters(adapter, True)
    finally:
        torch.set_rng_state(generator_state)
    left = [n for n, p in model.named_parameters() if p.requires_grad and p.is_meta]
    if left:
        raise L2LInputError(f"trainable parameters {left[:3]} have no values; train them from a loaded model")
