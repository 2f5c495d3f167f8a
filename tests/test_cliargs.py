from __future__ import annotations  # string annotations, as in ecru's configs: the flag builder reads them

import argparse
import dataclasses
import os

import pytest

from ecru.cliargs import (
    ArgumentParser,
    add_config_flags,
    config_from,
    config_from_args,
    existing_file,
    fraction,
    int_list,
    non_negative_int,
    positive_float,
    positive_int,
    prepare_out_dir,
    prepare_out_file,
    run_main,
)
from ecru.errors import EcruError
from ecru.io import atomic_write_json


@pytest.mark.parametrize(
    ("parse", "good", "bad"),
    [
        (positive_int, {"3": 3}, ["0", "-10", "1.5", "x"]),
        (non_negative_int, {"0": 0, "7": 7}, ["-1", "a"]),
        (positive_float, {"1e-4": 1e-4}, ["0", "-1", "inf", "nan?"]),
        (fraction, {"0.1": 0.1}, ["0", "1", "1.5", "-0.2"]),
        (int_list, {"400,400": (400, 400), "8,": (8,)}, ["", "4,-1", "a,b"]),
    ],
)
def test_numeric_types_accept_and_refuse(parse, good, bad):
    for text, value in good.items():
        assert parse(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_parser_error_is_one_line_exit_2(capsys):
    parser = ArgumentParser(prog="ecru x")
    parser.add_argument("--rows", type=positive_int, default=5)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--rows", "-10"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err == "ecru x: error: argument --rows: must be > 0, got -10 (see ecru x --help)\n"


def test_subparsers_inherit_the_convention(capsys):
    parser = ArgumentParser(prog="ecru")
    sub = parser.add_subparsers(dest="cmd", required=True).add_parser("train")
    sub.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate")
    assert "(default: 0.001)" in sub.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--lr", "-1"])
    assert capsys.readouterr().err.count("\n") == 1


def test_out_dir_created_and_checked(tmp_path):
    out = prepare_out_dir(tmp_path / "a" / "b")
    assert out.is_dir() and list(out.iterdir()) == []  # the write check leaves nothing behind
    (tmp_path / "f").write_text("x")
    with pytest.raises(EcruError, match="is a file"):
        prepare_out_dir(tmp_path / "f")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_out_dir_not_writable(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(EcruError, match="cannot write there"):
            prepare_out_dir(tmp_path / "sub")
    finally:
        tmp_path.chmod(0o700)


def test_out_file_and_atomic_json(tmp_path):
    with pytest.raises(EcruError, match="is a folder"):
        prepare_out_file(tmp_path, flag="--json")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(EcruError, match="^--json .*afile/x.json: its folder .*afile: is a file"):
        prepare_out_file(tmp_path / "afile" / "x.json", flag="--json")
    path = prepare_out_file(tmp_path / "missing" / "x.json")
    atomic_write_json(path, {"a": 1})
    assert path.read_text() == '{\n  "a": 1\n}\n'
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask


def test_existing_file(tmp_path):
    (tmp_path / "in.jsonl").write_text("{}")
    assert existing_file(str(tmp_path / "in.jsonl")).name == "in.jsonl"
    for missing in (tmp_path / "nope", tmp_path):
        with pytest.raises(argparse.ArgumentTypeError):
            existing_file(str(missing))


def test_config_from_turns_value_error_into_one_line():
    from dataclasses import dataclass

    @dataclass
    class C:
        n: int

        def __post_init__(self):
            if self.n <= 0:
                raise ValueError("n must be > 0")

    assert config_from(C, n=1).n == 1
    with pytest.raises(EcruError, match="n must be > 0"):
        config_from(C, n=0)


@dataclasses.dataclass(frozen=True)
class _Run:
    """A config for the flag builder."""

    name: str
    """What to call it."""
    steps: int = 10
    """Steps to run, 100% of them."""
    rate: float = 0.5
    """Learning rate."""
    fast: bool = False
    """Skip the checks."""

    def __post_init__(self):
        if self.name == "bad":
            raise ValueError("name: bad is not a name")


def test_config_flags_come_from_the_fields_and_build_the_config_back(capsys):
    parser = ArgumentParser(prog="run")
    add_config_flags(parser, _Run, rate={"help": "step size"})
    help_text = parser.format_help()
    assert "Steps to run, 100% of them. (default: 10)" in help_text and "step size" in help_text
    args = parser.parse_args(["--name", "a", "--steps", "3", "--fast"])
    assert config_from_args(_Run, args, rate=0.25) == _Run("a", 3, 0.25, True)
    with pytest.raises(EcruError, match="not a name"):
        config_from_args(_Run, parser.parse_args(["--name", "bad"]))
    for bad in (["--steps", "3"], ["--name", "a", "--steps", "0"], ["--name", "a", "--rate", "-1"]):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(bad)
        assert info.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    only = ArgumentParser(prog="run")
    add_config_flags(only, _Run, only=("steps",))
    assert [a.dest for a in only._actions if a.option_strings[0] != "-h"] == ["steps"]


def test_run_main_is_one_line_and_exit_2_or_130(capsys):
    assert run_main(lambda: None) == 0 and run_main(lambda: 3) == 3

    def fails():
        raise EcruError("--n: too many")

    def interrupted():
        raise KeyboardInterrupt

    assert run_main(fails) == 2 and capsys.readouterr().err == "ecru: error: --n: too many\n"
    assert run_main(interrupted) == 130 and capsys.readouterr().err == "ecru: interrupted\n"


def test_removed_if_refused_takes_back_only_the_empty_folders_it_saw_made(tmp_path):
    import pytest

    from ecru.cliargs import removed_if_refused
    from ecru.io import LOCK_FILE

    (tmp_path / "kept").mkdir()
    with pytest.raises(ValueError), removed_if_refused(tmp_path / "kept" / "a" / "b", None):
        (tmp_path / "kept" / "a" / "b").mkdir(parents=True)
        (tmp_path / "kept" / "a" / "b" / LOCK_FILE).touch()  # ecru's lock does not count
        raise ValueError("refused")
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "a").exists()
    with pytest.raises(KeyboardInterrupt), removed_if_refused(tmp_path / "run"):
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "checkpoint.safetensors").touch()  # work done: the folder stays
        raise KeyboardInterrupt
    assert (tmp_path / "run" / "checkpoint.safetensors").is_file()
    with removed_if_refused(tmp_path / "ok"):
        (tmp_path / "ok").mkdir()
    assert (tmp_path / "ok").is_dir()
