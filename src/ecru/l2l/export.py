"""The trained model out of the engine: a Hugging Face export, or the model whole on one device."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from ecru.l2l.config import L2LInputError

if TYPE_CHECKING:
    from ecru.l2l.engine import L2L


def save_pretrained(engine: L2L, path: str | os.PathLike, *, tokenizer, dtype: torch.dtype) -> None:
    """`model.save_pretrained(path)` from the masters cast to `dtype` (config records it), plus the
    tokenizer; the disk tier reads every block back for it (O(model) host memory)."""
    if engine.parts.kind != "hf":
        raise L2LInputError("save_pretrained exports Hugging Face models; use engine.state_dict() or save()")
    adapter = hasattr(engine.model, "peft_config")  # peft writes the adapter only: leave the base unread
    engine.store.materialize(frozen=not adapter)
    try:
        state = {
            k: v.detach().to("cpu", dtype=dtype) if v.is_floating_point() else v.detach().cpu()
            for k, v in engine.model.state_dict().items()
        }
        engine.model.save_pretrained(path, state_dict=state)
    finally:
        engine.store.release()
    config = getattr(engine.model, "config", None)
    if config is not None and not adapter:
        # save_pretrained records the masters' dtype (fp32) in config.json: record what was written
        config.dtype = dtype
        config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def model_on(engine: L2L, device: torch.device, *, dtype: torch.dtype | None) -> nn.Module:
    """Close `engine` and return its model with every parameter and buffer on `device`, every parameter
    in `dtype` (None: float32, as the trainable masters; frozen weights kept in another dtype upcast)."""
    engine.store.materialize()  # the disk tier: every block read back into its parameters
    engine.close()
    model = engine.model
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(device, dtype=dtype or torch.float32)
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)
    return model
