"""The demo report: a self-contained HTML page (PNG plots beside it) and a `summary.json`."""

from __future__ import annotations

import html
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class DemoContext:
    """What a demo section gets: where to write plots, and how to report progress."""

    out: Path
    """Report folder; a section writes its PNGs here and names them in `Section.plots`."""
    quick: bool = True
    """Bundled defaults sized for 2 CPU cores (the whole demo within 15 minutes)."""

    def log(self, message: str) -> None:
        print(f"  {message}", file=sys.stderr, flush=True)


@dataclass
class Section:
    """One pillar's part of the report."""

    title: str
    summary: dict[str, float | int | str]
    """Headline numbers: shown in the report's summary table and in `summary.json`."""
    text: str = ""
    """A paragraph of plain text explaining what was run and what the numbers mean."""
    plots: list[str] = field(default_factory=list)
    """PNG file names relative to the report folder."""
    rows: list[dict[str, float | int | str]] = field(default_factory=list)
    """An optional detail table (e.g. one row per policy or method)."""
    wall_s: float = 0.0
    status: str = "ok"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _table(rows: list[dict]) -> str:
    if not rows:
        return ""
    cols = list(dict.fromkeys(k for row in rows for k in row))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _section_html(s: Section) -> str:
    plots = "".join(f'<img src="{html.escape(p)}" alt="{html.escape(p)}">' for p in s.plots)
    summary = _table([{"metric": k, "value": v} for k, v in s.summary.items()])
    return (
        f"<h2>{html.escape(s.title)}</h2><p class=meta>status: {html.escape(s.status)}, "
        f"{s.wall_s:.1f} s</p><p>{html.escape(s.text)}</p>{summary}{_table(s.rows)}{plots}"
    )


_STYLE = (
    "body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
    "img{max-width:100%;display:block;margin:1em 0}.meta{color:#666;font-size:90%}pre{background:#f4f4f4;padding:8px}"
)


def write_report(out: Path, sections: list[Section], meta: dict[str, str]) -> Path:
    """Write `report.html` and `summary.json` into `out`; return the HTML path."""
    out.mkdir(parents=True, exist_ok=True)
    overview = _table(
        [{"section": s.title, "status": s.status, "wall_s": s.wall_s, **s.summary} for s in sections]
    )
    env = "\n".join(f"{k}: {v}" for k, v in meta.items())
    page = (
        f"<!doctype html><html><head><meta charset=utf-8><title>ecru demo report</title><style>{_STYLE}</style>"
        f"</head><body><h1>ecru demo report</h1><h2>Summary</h2>{overview}"
        + "".join(_section_html(s) for s in sections)
        + f"<h2>Command and environment</h2><pre>{html.escape(env)}</pre></body></html>"
    )
    (out / "report.html").write_text(page)
    summary = {"meta": meta, "sections": [asdict(s) for s in sections]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return out / "report.html"
