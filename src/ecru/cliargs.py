"""One command-line convention for every `ecru` command.

- Every parser is an `ArgumentParser` from here: `--help` shows defaults, and a bad argument is one line
  on stderr (``ecru ctr train: error: argument --rows: must be > 0, got -10``) with exit status 2.
- Numeric flags are validated when parsed (`positive_int`, `non_negative_float`, `fraction`, ...).
- A run's artifacts go to `--out DIR` (`add_out_dir`), created if missing and checked writable before any
  work (`prepare_out_dir`); `--resume` continues from what that folder holds. A single output file
  (`--out answers.jsonl`, `--json F`) goes through `prepare_out_file` and `ecru.io`'s atomic writers.
- A config dataclass gives its own flags (`add_config_flags`: name, default, docstring as help) and is built
  back from the parsed arguments (`config_from_args`), validated on construction.
- Anything a handler raises as `EcruError` is printed as one line, exit status 2, and Ctrl-C exits 130
  (`run_main`: `ecru.cli.main` and the benchmark scripts of bench/).

Nothing here imports torch: `ecru --help` imports every pillar's `cli.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from ecru.errors import EcruError

EXIT_USAGE = 2  # bad arguments and bad inputs alike: one line on stderr, this status
T = TypeVar("T")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless X is None/False or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.default in (None, False, argparse.SUPPRESS)
            or "default" in text
            or not action.option_strings
        ):
            return action.help
        return f"{text} (default: %(default)s)".lstrip()


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults in `--help` and one-line errors (no usage block) with exit status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def number_in(kind: Callable[[str], T], name: str, ok: Callable[[T], bool], rule: str):
    """An argparse type: `kind(text)` that must satisfy `ok`; the messages say `name` and `rule`."""

    def parse(text: str) -> T:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {name}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = name  # argparse names the type in its messages
    return parse


positive_int = number_in(int, "an integer", lambda v: v > 0, "> 0")
non_negative_int = number_in(int, "an integer", lambda v: v >= 0, ">= 0")
positive_float = number_in(float, "a number", lambda v: v > 0 and v != float("inf"), "> 0 and finite")
non_negative_float = number_in(float, "a number", lambda v: 0 <= v < float("inf"), ">= 0 and finite")
fraction = number_in(float, "a number", lambda v: 0 < v < 1, "strictly between 0 and 1")
probability = number_in(float, "a number", lambda v: 0 <= v <= 1, "between 0 and 1")


def int_list(text: str) -> tuple[int, ...]:
    """`--mlp 400,400,400` -> (400, 400, 400); every entry a positive integer."""
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}")
    return values


def existing_file(text: str) -> Path:
    """An input file that must exist now: checked when parsed, before any work."""
    path = Path(text).expanduser()
    if not path.is_file():
        what = "a folder" if path.is_dir() else "not a regular file" if path.exists() else "not found"
        raise argparse.ArgumentTypeError(f"{text}: {what}; give the path of an existing file")
    return path


def add_out_dir(
    parser: argparse.ArgumentParser,
    *,
    default: str | None = None,
    required: bool = False,
    overwrite: bool = False,
):
    """`--out DIR` (the run's artifacts), `--resume` (continue from what DIR holds) and, with `overwrite`,
    `--overwrite` (start again over a run DIR holds). One rule for every run: a folder holding a run is
    refused unless one of them is given."""
    parser.add_argument(
        "--out",
        default=default,
        required=required,
        metavar="DIR",
        help="folder for the run's artifacts (JSON, checkpoints, plots); created if missing",
    )
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out (or start it if --out holds none): the same command finishes a "
        "run killed at any point",
    )
    if overwrite:
        runs.add_argument(
            "--overwrite", action="store_true", help="delete the run --out holds and start again"
        )


def prepare_out_dir(path: str | os.PathLike[str], *, flag: str = "--out") -> Path:
    """Create `path` if missing and check that it is a writable folder, before any work is done."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise EcruError(f"{flag} {out}: is a file, not a folder; give a folder path")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".ecru-write-check-"):
            pass
    except OSError as exc:
        raise EcruError(f"{flag} {out}: cannot write there ({exc.strerror}); choose another folder") from None
    return out


@contextlib.contextmanager
def removed_if_refused(*paths: str | os.PathLike[str] | None) -> Iterator[None]:
    """The folders from each of `paths` up that do not exist yet are removed again if the block raises while they
    hold nothing (ecru's lock file aside): a command refused after making its --out leaves nothing behind."""
    from ecru.io import LOCK_FILE

    starts = [Path(p).expanduser().absolute() for p in paths if p is not None]
    new = {q for start in starts for q in (start, *start.parents) if not q.exists()}
    try:
        yield
    except BaseException:
        for folder in sorted(new, key=lambda q: len(q.parts), reverse=True):  # deepest first
            if folder.is_dir() and {f.name for f in folder.iterdir()} <= {LOCK_FILE}:
                (folder / LOCK_FILE).unlink(missing_ok=True)
                folder.rmdir()
        raise


def prepare_out_file(path: str | os.PathLike[str], *, flag: str = "--out") -> Path:
    """Check that `path` can be written as a file (its folder created if missing), before any work."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise EcruError(f"{flag} {out}: is a folder; give a file path")
    if out.exists() and not out.is_file():  # a device, pipe or socket: an atomic write would replace it
        raise EcruError(f"{flag} {out}: is not a regular file; give a file path")
    prepare_out_dir(out.parent, flag=f"{flag} {out}: its folder")
    return out


def not_an_input(
    path: str | os.PathLike[str], *inputs: str | os.PathLike[str] | None, flag: str = "--out"
) -> str:
    """`path`, refused if it is one of `inputs` (files or folders a command reads) or lies inside one: an output
    never overwrites what the command reads (a model's weights, the data, a store's manifest)."""
    target = Path(path).expanduser().resolve()
    for given in inputs:
        source = None if given is None else Path(given).expanduser().resolve()
        if source is not None and (target == source or source in target.parents):
            raise EcruError(f"{flag} {path} would overwrite the input {given}; write it elsewhere")
    return str(path)


def config_from(cls: Callable[..., T], **kwargs: Any) -> T:
    """Build a validated config, turning its `ValueError` into a one-line `EcruError`."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise EcruError(str(exc)) from None


def config_from_args(cls: Callable[..., T], args: argparse.Namespace, **overrides: Any) -> T:
    """A config built from the arguments named as its fields (`overrides` win); its ValueError is one line."""
    names = {f.name for f in dataclasses.fields(cls)}
    return config_from(cls, **{k: v for k, v in vars(args).items() if k in names} | overrides)


_FIELD_TYPES = {"int": positive_int, "int | None": positive_int, "float": non_negative_float,
                "float | None": non_negative_float, "Path": existing_file, "Path | None": existing_file}  # fmt: skip
"""The parser of a field's annotation; other annotations (str) are taken as given."""


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type, *, only: tuple[str, ...] | None = None, **special: dict
) -> None:
    """One flag per field of the config `cls` (or of those in `only`): --field-name, the field's default (a
    field without one is required), its docstring as help, its annotation's parser (ints > 0, floats >= 0,
    paths of existing files, bools on/off); `special[name]` adds or replaces argparse keywords."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        kw: dict[str, Any] = {"help": docs[f.name]}
        if f.default is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = f.default
        if f.type == "bool":
            kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        elif f.type in _FIELD_TYPES:
            kw["type"] = _FIELD_TYPES[f.type]
        parser.add_argument(f"--{f.name.replace('_', '-')}", **kw | special.get(f.name, {}))


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), on one line."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        field.target.id: " ".join(doc.value.value.split()).replace("%", "%%")
        for field, doc in zip(body, body[1:], strict=False)
        if isinstance(field, ast.AnnAssign)
        and isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
    }


def run_main(body: Callable[[], int | None]) -> int:
    """Run a command's body the one way: an `EcruError` is one line on stderr (``ecru: error: ...``) with
    exit status 2, Ctrl-C is ``ecru: interrupted`` with 130; otherwise `body`'s status (None: 0)."""
    try:
        return int(body() or 0)
    except EcruError as exc:
        print(f"ecru: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("ecru: interrupted", file=sys.stderr)
        return 130


def note_long_run(estimate: str) -> None:
    """Say on stderr, before starting, that the defaults run long and how long."""
    print(
        f"note: {estimate}; Ctrl-C stops it (progress so far is kept where the command says)", file=sys.stderr
    )
