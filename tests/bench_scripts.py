"""Import a script of bench/ or bench/experiments/ (not packages) as a module, for tests of its functions."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"
EXPERIMENTS = BENCH / "experiments"


def load_bench_script(name: str) -> ModuleType:
    """bench/<name>.py (a product benchmark), executed as module `name` (not registered in sys.modules)."""
    return _load(BENCH / f"{name}.py")


def load_experiment_script(name: str) -> ModuleType:
    """bench/experiments/<name>.py (a study), executed as module `name` (not registered in sys.modules)."""
    return _load(EXPERIMENTS / f"{name}.py")


def _load(path: Path) -> ModuleType:
    """bench/ joins the import path, as when a script runs: some studies import a product benchmark."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
