"""The CTR demo section on a tiny setting (the real one runs in `ecru demo`, ~2-3 minutes)."""

from ecru.ctr import demo
from ecru.demo.report import DemoContext


def test_section_tiny(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "ROWS", 6000)
    monkeypatch.setattr(demo, "SCALE", 1e-3)
    monkeypatch.setattr(demo, "MLP", (8,))
    monkeypatch.setattr(demo, "BASE", 128)
    monkeypatch.setattr(demo, "LARGE", 1024)
    monkeypatch.setattr(
        demo,
        "RUNS",
        (
            ("adam", "sparse", 128),
            ("cowclip", "full", 1024),
            ("linear", "full", 1024),
            ("tempered", "sparse", 1024),
        ),
    )
    section = demo.section(DemoContext(out=tmp_path))
    assert section.status == "ok" and len(section.rows) == 4
    assert (
        0.5 < section.summary["oracle_auc"] < 1 and 0 <= section.summary["clipped_fraction_1K_cowclip"] <= 1
    )
    assert "tempered rule reaches AUC" in section.takeaway and "CowClip's rules" in section.shortfall
    assert (tmp_path / section.plots[0]).stat().st_size > 0
