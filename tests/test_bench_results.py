"""bench/results/ holds only what a doc, a script, a test or the package names, and at most 80 files."""

import io
import re
import tokenize
from pathlib import Path

from ecru.io import LOCK_FILE

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MAX_FILES = 80


def _citing_texts() -> str:
    """Every text that may cite a result file: the README, the docs, the CHANGELOG, the Makefile,
    the benchmark scripts and studies, the tests and the package sources."""
    paths = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "Makefile", ROOT / "bench" / "README.md"]
    paths += sorted((ROOT / "docs").glob("*.md"))
    for pattern in ("bench/*.py", "bench/experiments/*.py", "tests/**/*.py", "src/**/*.py"):
        paths += sorted(ROOT.glob(pattern))
    return "\n".join(p.read_text(encoding="utf-8") for p in paths if p.is_file())


def _result_files() -> list[str]:
    """Every file but the lock `ecru.io.merge_json` leaves (git ignores it)."""
    return sorted(
        p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p.name != LOCK_FILE
    )


def _is_cited(name: str, text: str) -> bool:
    # The exact name, alone or after bench/results/: `serve_bench.json` must not count for `x_serve_bench.json`.
    return re.search(r"(?<![\w./-])(?:bench/results/)?" + re.escape(name) + r"(?!\w)", text) is not None


def test_cited_detects_exact_names_only():
    text = "see `bench/results/serve_bench.json` and lifelong_quick_run2.json."
    assert _is_cited("serve_bench.json", text)
    assert _is_cited("lifelong_quick_run2.json", text)
    assert not _is_cited("bench.json", text)
    assert not _is_cited("lifelong_quick_run2.js", text)
    assert not _is_cited("serve_bench.jsonl", text)


def test_bench_results_is_small():
    files = _result_files()
    assert 0 < len(files) <= MAX_FILES, f"bench/results holds {len(files)} files; at most {MAX_FILES}"


def test_every_result_file_is_cited():
    text = _citing_texts()
    uncited = [name for name in _result_files() if not _is_cited(name, text)]
    assert not uncited, f"cite these from a doc or script, or remove them: {uncited}"


def _code_without_comments(path: Path) -> str:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return " ".join(t.string for t in tokens if t.type != tokenize.COMMENT)


def test_no_test_loads_a_study():
    # Studies (bench/experiments/) are not the product: what a test needs lives in src/ecru or a bench/ script.
    loads = [
        p.relative_to(ROOT).as_posix()
        for p in sorted((ROOT / "tests").rglob("*.py"))
        if "experiments" in _code_without_comments(p) and p != Path(__file__).resolve()
    ]
    assert not loads, f"these tests name bench/experiments: {loads}"
