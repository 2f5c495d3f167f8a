"""The `ecru` command line. Each pillar adds its own subcommands from `ecru.<pillar>.cli.configure`.

Pillar CLI modules import heavy libraries (torch, transformers) inside their handlers only, so that
`ecru --help` stays fast and importing the CLI has no side effects. This module imports only `sys` at its
top: `main` loads the rest, so that Ctrl-C at any instant is `ecru: interrupted` (130), never a traceback.
"""

from __future__ import annotations

import sys

from ecru import __version__

TYPE_CHECKING = False  # not typing's: importing typing takes ~17 ms, outside main's Ctrl-C handler
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

# subcommand -> (module that configures it, one-line help)
PILLARS: dict[str, tuple[str, str]] = {
    "l2l": ("ecru.l2l.cli", "layer-to-layer training of models larger than device memory"),
    "ctr": ("ecru.ctr.cli", "large-batch click-through-rate training with CowClip"),
    "serve": (
        "ecru.serve.entrypoints.cli",
        "OpenAI-compatible LLM server, batch runner, length-aware scheduling",
    ),
    "lifelong": (
        "ecru.lifelong.cli",
        "teach a frozen encoder your own tasks one after another (knowledge store); continual-learning benchmark",
    ),
}


def _not_built(name: str):
    def handler(args: argparse.Namespace) -> int:
        from ecru.cliargs import EXIT_USAGE

        print(f"ecru {name}: not built yet in this version of ecru", file=sys.stderr)
        return EXIT_USAGE

    return handler


def _add_pillar(sub, name: str, module: str, help_text: str) -> None:
    import importlib

    from ecru.plugins import module_available

    parser = sub.add_parser(name, help=help_text, description=help_text)
    if not module_available(module):
        parser.set_defaults(func=_not_built(name))
        return
    importlib.import_module(module).configure(parser)


def build_parser() -> argparse.ArgumentParser:
    from ecru.cliargs import ArgumentParser

    parser = ArgumentParser(
        prog="ecru", description="ecru: make large neural networks cheaper to train and serve."
    )
    parser.add_argument("--version", action="version", version=f"ecru {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in PILLARS.items():
        _add_pillar(sub, name, module, help_text)
    demo = sub.add_parser("demo", help="run every pillar's quick demo and write an HTML report")
    demo.add_argument("--out", default="runs/demo", metavar="DIR", help="report folder; created if missing")
    demo.add_argument("--only", default=None, help="comma-separated sections, e.g. foundation,ctr")
    demo.set_defaults(func=_run_demo)
    env = sub.add_parser("env", help="print versions, device, threads, cache and installed models")
    env.set_defaults(func=_run_env)
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    from ecru.cliargs import note_long_run, prepare_out_dir
    from ecru.demo import run_demo
    from ecru.errors import EcruError

    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only is not None else None
    if only == []:
        raise EcruError("--only: no section given; name sections, e.g. --only foundation,ctr")
    out = prepare_out_dir(args.out)
    if only is None:
        note_long_run("ecru demo runs every pillar's section: up to 13 minutes on 2 busy CPU cores")
    failed = run_demo(out, only=only)
    if failed:
        raise EcruError(f"demo section(s) failed: {', '.join(failed)} (the report still holds the others)")
    return 0


def _run_env(args: argparse.Namespace) -> int:
    from ecru.env import describe_env

    for key, value in describe_env().items():
        print(f"{key:<16} {value}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ecru ARGV` (default: the command line); its exit status."""
    try:
        import shlex

        from ecru.cliargs import run_main

        parser = build_parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)  # exits 2 with a usage message on bad arguments
        args.command_line = "ecru " + shlex.join(argv)  # what a result file records as its command
        return run_main(lambda: args.func(args))
    except KeyboardInterrupt:  # while the CLI loads and builds, before run_main's handler is in place
        print("ecru: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
