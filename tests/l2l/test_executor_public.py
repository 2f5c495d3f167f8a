"""Only engine.py reaches into the engine's private attributes: evaluation, export and the rest of ecru
drive blocks through the public executor (`run_stem`, `run_block`, `run_head`, `run_logits`)."""

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ecru"
PRIVATE = re.compile(r"\bengine\._[A-Za-z]")


def test_no_module_outside_engine_touches_its_privates():
    offenders = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if path != SRC / "l2l" / "engine.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert not offenders, "private engine attributes used outside engine.py:\n" + "\n".join(offenders)


def test_the_check_sees_a_private_access():
    assert PRIVATE.search('engine._bindings["stem"]') and not PRIVATE.search("engine.run_stem(w, x)")
