import json

from ecru.demo import DemoContext, Section, write_report
from ecru.demo.plots import new_figure, save


def test_report_is_self_contained_html_with_summary_json(tmp_path):
    ctx = DemoContext(out=tmp_path)
    fig, ax = new_figure()
    ax.plot([0, 1], [1, 0])
    plot = save(fig, ctx.out / "p.png")
    sections = [
        Section(
            "alpha",
            {"auc": 0.81234, "steps": 3},
            text="a < b & c",
            plots=[plot],
            rows=[{"x": 1}],
            takeaway="alpha wins by 2x",
            shortfall="not at 32K",
        ),
        Section("beta", {}, status="not built"),
    ]
    path = write_report(ctx.out, sections, {"command": "ecru demo"})
    page = path.read_text()
    assert '<img src="p.png"' in page and (tmp_path / "p.png").stat().st_size > 1000
    assert "a &lt; b &amp; c" in page and "0.8123" in page and "not built" in page
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sections"][0]["summary"]["auc"] == 0.81234
    assert summary["meta"]["command"] == "ecru demo"
    # the page opens with one takeaway per section; what does not hold is said in the section
    assert page.index("alpha wins by 2x") < page.index("<h2 id=alpha>")
    assert "Does not hold: not at 32K" in page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "report.html", "summary.json"]
