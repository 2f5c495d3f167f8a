"""Every `ecru ...` command of README.md's shell blocks runs, at small sizes, on files made here.

Sizes shrink by appending flags (argparse keeps an option's last value: `--steps 100 ... --steps 2`);
the bundled SmolLM2 becomes the random tiny model. `ecru serve api` blocks until Ctrl-C: its examples are
run by tests/serve (a real server and the official client)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from ecru.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)
SMALL = {  # (pillar, command) -> flags appended to the README's own
    ("l2l", "train"): ["--model", "tiny", "--steps", "2", "--batch-size", "4", "--save-every", "1"],
    ("ctr", "synth"): ["--rows", "3000", "--scale", "1e-3"],
    ("ctr", "train"): ["--mlp", "16", "--epochs", "1", "--patience", "0", "--min-count", "1"],
    ("serve", "run"): ["--model", "tiny", "--max-new-tokens", "4"],
    ("serve", "probe"): ["--model", "tiny", "--max-new-tokens", "8"],
    ("lifelong", "learn"): ["--epochs", "1"],
}
SKIP = {("serve", "api")}


def commands() -> list[list[str]]:
    out = []
    for block in BLOCKS:
        for line in block.splitlines():
            for part in line.split("#")[0].split(";"):
                if not part.strip().startswith("ecru "):
                    continue
                words = shlex.split(part)
                if words[:1] == ["ecru"] and tuple(words[1:3]) not in SKIP:
                    out.append(words[1:] + SMALL.get(tuple(words[1:3]), []))
    return out


def _inputs(folder: Path) -> None:
    from ecru.datasets import load_clinc

    clinc = load_clinc()
    texts = [e.text for e in clinc["train"][:40]]
    (folder / "my_texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts[:12]))
    for domain, name in (("banking", "banking.jsonl"), ("travel", "travel.csv")):
        intents = clinc.domains[domain][:3]
        rows = [(e.text, e.label) for i in intents for e in [x for x in clinc["train"] if x.label == i][:6]]
        if name.endswith(".jsonl"):
            (folder / name).write_text(
                "".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in rows)
            )
        else:
            (folder / name).write_text("text,label\n" + "".join(f'"{t}",{lab}\n' for t, lab in rows))
    for name in ("questions.jsonl", "q.jsonl"):
        (folder / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:5]))


def test_readme_shell_commands_run(tmp_path, monkeypatch):
    cmds = commands()
    assert len(cmds) >= 14  # every pillar's block was found
    monkeypatch.chdir(tmp_path)
    _inputs(tmp_path)
    for argv in cmds:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code
        assert code == 0, f"ecru {' '.join(argv)} exited {code}"
    assert (tmp_path / "runs" / "l2l" / "hf" / "config.json").is_file()
    assert len((tmp_path / "scores.txt").read_text().splitlines()) == 3000
    assert (tmp_path / "exported").is_dir() and (tmp_path / "answers.jsonl").is_file()
