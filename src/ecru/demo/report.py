"""The demo report: a self-contained HTML page (PNG plots beside it) and a `summary.json`."""

from __future__ import annotations

import html
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ecru.io import atomic_write_json, atomic_write_text


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
    takeaway: str = ""
    """One sentence: the pillar's measured result in this run, opening the report."""
    shortfall: str = ""
    """One sentence: what does not hold in this run (or in the project's measurements), said plainly."""
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
    plots = "".join(f'<img src="{html.escape(p)}" alt="{html.escape(p)} plot">' for p in s.plots)
    summary = _table([{"metric": k, "value": v} for k, v in s.summary.items()])
    return (
        f"<h2 id={html.escape(s.title)}>{html.escape(s.title)}</h2><p class=meta>status: "
        f"{html.escape(s.status)}, {s.wall_s:.1f} s</p>{_takeaway_html(s)}<p>{html.escape(s.text)}</p>"
        f"{plots}{summary}{_table(s.rows)}"
    )


def _takeaway_html(s: Section) -> str:
    parts = [f"<p class=win>{html.escape(s.takeaway)}</p>" if s.takeaway else ""]
    if s.shortfall:
        parts.append(f"<p class=short>Does not hold: {html.escape(s.shortfall)}</p>")
    return "".join(parts)


def _headline(s: Section, n: int = 3) -> str:
    return ", ".join(f"{k} {_cell(v)}" for k, v in list(s.summary.items())[:n])


def _overview(sections: list[Section]) -> str:
    rows = "".join(
        f"<tr><td><a href='#{html.escape(s.title)}'>{html.escape(s.title)}</a></td>"
        f"<td class={'ok' if s.status == 'ok' else 'bad'}>{html.escape(s.status)}</td><td>{s.wall_s:.0f}</td>"
        f"<td>{html.escape(s.takeaway or s.text[:160])}</td><td>{_headline(s)}</td></tr>"
        for s in sections
    )
    head = "<tr><th>section</th><th>status</th><th>s</th><th>takeaway</th><th>headline numbers</th></tr>"
    return f"<table>{head}{rows}</table>"


_STYLE = (
    "body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
    "img{max-width:100%;display:block;margin:1em 0}.meta{color:#666;font-size:90%}pre{background:#f4f4f4;padding:8px}"
    ".win{border-left:4px solid #2a7;padding-left:8px}.short{border-left:4px solid #c63;padding-left:8px}"
    ".ok{color:#2a7}.bad{color:#c33;font-weight:bold}"
)


def write_report(out: Path, sections: list[Section], meta: dict[str, str]) -> Path:
    """Write `report.html` and `summary.json` into `out`; return the HTML path."""
    overview = _overview(sections)
    env = "\n".join(f"{k}: {v}" for k, v in meta.items())
    page = (
        f"<!doctype html><html><head><meta charset=utf-8><title>ecru demo report</title><style>{_STYLE}</style>"
        f"</head><body><h1>ecru demo report</h1><h2>Summary</h2>{overview}"
        + "".join(_section_html(s) for s in sections)
        + f"<h2>Command and environment</h2><pre>{html.escape(env)}</pre></body></html>"
    )
    atomic_write_json(out / "summary.json", {"meta": meta, "sections": [asdict(s) for s in sections]})
    return atomic_write_text(out / "report.html", page)
