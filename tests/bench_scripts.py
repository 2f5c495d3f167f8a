"""Import a product benchmark script of bench/ (not a package) as a module, for tests of its functions.

Studies are not the product: no test imports one (tests/test_bench_results.py checks)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(name: str) -> ModuleType:
    """bench/<name>.py (a product benchmark), executed as module `name` and registered in sys.modules under it,
    as `python bench/<name>.py` registers `__main__`: dataclasses and `inspect` look a class's module up there."""
    path = BENCH / f"{name}.py"
    if str(BENCH) not in sys.path:  # bench/ joins the import path, as when a script runs
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
