import subprocess
import sys

import pytest

from ecru import cli
from ecru.datasets import records


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ecru", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_command():
    res = run_cli("--help")
    assert res.returncode == 0
    for name in ("l2l", "ctr", "serve", "lifelong", "demo", "env"):
        assert name in res.stdout


@pytest.mark.parametrize("args", [["bogus"], ["demo", "--no-such-option"], []])
def test_bad_arguments_are_one_line_and_exit_2(args):
    res = run_cli(*args)
    assert res.returncode == 2
    assert res.stderr.startswith("ecru") and res.stderr.count("\n") == 1 and "--help" in res.stderr
    assert "Traceback" not in res.stderr


def test_version():
    from ecru import __version__

    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"ecru {__version__}"


def test_help_shows_defaults():
    res = run_cli("demo", "--help")
    assert "(default: runs/demo)" in res.stdout


def test_demo_refuses_a_file_as_out(tmp_path, capsys):
    target = tmp_path / "report"
    target.write_text("keep me")
    assert cli.main(["demo", "--out", str(target), "--only", "foundation"]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a folder" in err and err.count("\n") == 1
    assert target.read_text() == "keep me"


def test_env_reports_the_machine():
    res = run_cli("env")
    assert res.returncode == 0
    for key in ("torch", "device", "torch_threads", "cache", "all-MiniLM-L6-v2"):
        assert key in res.stdout


def test_unknown_demo_section_is_one_line(capsys):
    assert cli.main(["demo", "--only", "nonsense"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ecru: error: unknown demo section") and err.count("\n") == 1


def test_missing_data_file_names_the_fix(monkeypatch, tmp_path):
    from ecru.datasets import clinc

    monkeypatch.setattr(clinc, "data_dir", lambda name: tmp_path)
    clinc.load_clinc_domains.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="is missing; restore it"):
            clinc.load_clinc_domains()
    finally:
        clinc.load_clinc_domains.cache_clear()


def test_missing_data_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(records, "resources", type("R", (), {"files": staticmethod(lambda pkg: tmp_path)}))
    with pytest.raises(FileNotFoundError, match="reinstall ecru"):
        records.data_dir("clinc150")


def test_a_pillar_that_is_absent_is_reported_not_built(monkeypatch, capsys):
    monkeypatch.setitem(cli.PILLARS, "l2l", ("ecru.no_such_pillar.cli", "help"))
    assert cli.main(["l2l"]) == 2
    assert "not built yet" in capsys.readouterr().err


def test_cli_choices_match_the_library():
    # the pillar CLIs copy these names to stay free of torch at import time: the copies must not drift
    from ecru.cowclip.recipes import RECIPES
    from ecru.ctr import cli as ctr_cli
    from ecru.ctr.models import MODELS

    assert ctr_cli.MODELS == MODELS and ctr_cli.RECIPES == RECIPES
