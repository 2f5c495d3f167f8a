"""Runs the demo sections in order, keeps going past a failing one, writes the report."""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path

from ecru.demo.report import DemoContext, Section, write_report
from ecru.errors import EcruError
from ecru.plugins import module_available

# section name -> module exposing `section(ctx: DemoContext) -> Section`
SECTIONS: dict[str, str] = {
    "foundation": "ecru.demo.foundation",
    "l2l": "ecru.l2l.demo",
    "ctr": "ecru.ctr.demo",
    "serve": "ecru.serve.entrypoints.demo",
    "lifelong": "ecru.lifelong.demo",
}


def _run_section(name: str, module: str, ctx: DemoContext) -> Section:
    if not module_available(module):
        return Section(name, {}, text=f"The {name} demo is not built yet.", status="not built")
    start = time.perf_counter()
    try:
        section = importlib.import_module(module).section(ctx)
        status = section.status
    except Exception as exc:  # one broken section must not lose the others' results
        traceback.print_exc()
        section, status = Section(name, {}, text=f"{type(exc).__name__}: {exc}"), "failed"
    section.status, section.wall_s = status, time.perf_counter() - start
    return section


def _meta(argv: list[str]) -> dict[str, str]:
    from ecru.env import describe_env

    return {"command": " ".join(["ecru", *argv]) or "ecru demo", **describe_env()}


def _print_summary(sections: list[Section]) -> None:
    print(f"\n{'section':<12} {'status':<10} {'wall_s':>7}  headline")
    for s in sections:
        headline = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(s.summary.items())[:4]
        )
        print(f"{s.title[:12]:<12} {s.status:<10} {s.wall_s:>7.1f}  {headline}")


def run_demo(out: str | Path = "runs/demo", *, only: list[str] | None = None) -> list[str]:
    """Run the sections (all, or those named in `only`), write `out/report.html`; the failed sections."""
    unknown = set(only or []) - set(SECTIONS)
    if unknown:
        raise EcruError(f"unknown demo section(s) {sorted(unknown)}; choose from {list(SECTIONS)}")
    ctx = DemoContext(out=Path(out))
    ctx.out.mkdir(parents=True, exist_ok=True)
    names = [n for n in SECTIONS if only is None or n in only]
    sections = []
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] demo section: {name}", file=sys.stderr, flush=True)
        sections.append(_run_section(name, SECTIONS[name], ctx))
    path = write_report(ctx.out, sections, _meta(sys.argv[1:]))
    _print_summary(sections)
    print(f"\nreport: {path}")
    return [s.title for s in sections if s.status == "failed"]
