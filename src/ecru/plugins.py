"""Pillar modules plug into the CLI and the demo by name; a pillar not built yet is simply absent."""

from __future__ import annotations

import importlib.util


def module_available(name: str) -> bool:
    """True if `name` can be imported; its parent packages may be missing too."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
