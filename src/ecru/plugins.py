"""Pillar modules plug into the CLI and the demo by name; a pillar not built yet is simply absent."""

from __future__ import annotations

import importlib
import importlib.util


def module_available(name: str) -> bool:
    """True if `name` can be imported; its parent packages may be missing too."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]):
    """`(__getattr__, __dir__, __all__)` for a package whose public names load on first use (PEP 562).

    `exports` maps a submodule to the names it provides. A pillar's `cli.py` is imported by `ecru --help`;
    lazy names keep that import free of torch.
    """
    where = {name: module for module, names in exports.items() for name in names}
    public = sorted(where)

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    def __dir__() -> list[str]:
        return public

    return __getattr__, __dir__, public
