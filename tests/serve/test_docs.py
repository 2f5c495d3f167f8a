"""docs/serve.md's Python blocks that need no running server run, so the page cannot drift from the code."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "serve.md"
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S) if "127.0.0.1" not in b]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_doc_snippet_runs(code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(DOC), "exec"), {"__name__": "__doc__"})
    assert capsys.readouterr().out.strip()


def test_the_page_has_a_runnable_block():
    assert BLOCKS
