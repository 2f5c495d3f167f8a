"""Every ecru command follows the one convention of `ecru.cliargs` (issue: a front door for users)."""

import argparse

import pytest

from ecru import cli


def _commands(parser: argparse.ArgumentParser, prefix: str = "ecru"):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{prefix} {name}")


COMMANDS = dict(_commands(cli.build_parser()))


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_has_help(name):
    parser = COMMANDS[name]
    missing = [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings
        and not isinstance(a, argparse._HelpAction | argparse._VersionAction)
        and not a.help
    ]
    assert not missing, f"{name}: flags without help: {missing}"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_numeric_flags_are_validated(name):
    """An int or float flag uses one of the validating types (a bare int/float accepts -10)."""
    bare = [
        a.option_strings[0]
        for a in COMMANDS[name]._actions
        if a.option_strings and a.type in (int, float) and not a.choices
    ]
    assert not bare, f"{name}: numeric flags parsed without validation: {bare}"
