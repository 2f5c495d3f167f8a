"""Every ```python block in README.md runs, so the documentation cannot drift from the code."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_names_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text


# A snippet that uses what a README command writes: the command runs first (on small data), in the same folder.
SETUP = {
    'load_model("runs/ctr")': [
        ["ctr", "synth", "--rows", "20000", "--scale", "1e-3", "--out", "data/day_0.tsv"],
        [
            "ctr",
            "train",
            "--data",
            "criteo:data/day_0.tsv",
            "--mlp",
            "16",
            "--min-count",
            "1",
            "--out",
            "runs/ctr",
        ],
    ],
}


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_snippet_runs(code, tmp_path, monkeypatch):
    from ecru import cli

    monkeypatch.chdir(tmp_path)
    for marker, commands in SETUP.items():
        if marker in code:
            for argv in commands:
                assert cli.main(argv) == 0, argv
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
