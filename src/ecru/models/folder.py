"""A user's local Hugging Face causal-LM folder, loaded the one safe way every pillar uses: safetensors weights
only (a pickled `pytorch_model.bin` is never unpickled), fp32 on the CPU, and refused when its weights lack
tensors the model has (transformers would start those from random values: an encoder such as BERT loads as a
causal LM with a random head)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ecru.errors import EcruError


def load_causal_lm(path: Path, *, prefix: str = "") -> tuple[Any, Any]:
    """`(model, tokenizer)` of the folder `path` (it holds config.json: the callers say what else they take) in
    eval mode; whatever is wrong with it is one `EcruError` line starting with `prefix` (e.g. the flag)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, use_safetensors=True, output_loading_info=True
        )
    except Exception as exc:  # noqa: BLE001 - whatever a broken folder makes transformers raise, one line
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__  # transformers' messages span lines
        raise EcruError(f"{prefix}cannot load the model folder {path}: {reason}") from None
    if missing := sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"]):
        raise EcruError(
            f"{prefix}{path}: its weights lack {len(missing)} of {type(model).__name__}'s tensors (e.g. "
            f"{missing[0]}): not a whole causal-LM checkpoint (an encoder such as BERT has no LM head)"
        )
    return model.eval(), tokenizer
