"""Package-wide properties: no import-time side effects, no reads of the workplace's shared folder."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_has_no_side_effects():
    code = (
        "import os, sys; before = dict(os.environ); import ecru, ecru.cli; "
        "assert 'torch' not in sys.modules, 'importing ecru imported torch'; "
        "assert dict(os.environ) == before, 'importing ecru changed the environment'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cli_parser_imports_no_heavy_library():
    # `ecru --help` builds every pillar's subcommands: they must not import torch at module level
    code = (
        "import sys; from ecru.cli import build_parser; build_parser(); "
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_no_code_reads_the_shared_folder():
    pattern = re.compile(r"\.\./shared|shared/data|shared/spec")
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("src", "bench")
        for p in (ROOT / folder).rglob("*.py")
        if pattern.search(p.read_text())
    ]
    assert offenders == []


def test_bundled_data_carries_its_licences():
    data = ROOT / "src" / "ecru" / "datasets" / "data"
    for name in ("clinc150", "banking77"):
        assert (data / name / "LICENSE").stat().st_size > 1000
