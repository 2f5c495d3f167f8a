"""Running `ecru ARGV` in-process from a test."""

from ecru.cli import main


def status_and_err(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of `ecru ARGV`; argparse errors exit through SystemExit."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err
