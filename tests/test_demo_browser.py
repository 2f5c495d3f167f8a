"""The demo report as a person sees it: headless Chromium (Debian's `chromium`) renders it to a screenshot,
and a script run in the page checks that every plot image loaded."""

import shutil
import subprocess

import pytest

from ecru import cli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHECK = (
    "<script>window.addEventListener('load', () => { const imgs = [...document.images];"
    " document.title = imgs.length && imgs.every(i => i.complete && i.naturalWidth > 0)"
    " ? 'IMAGES_OK ' + imgs.length : 'IMAGES_BROKEN'; });</script>"
)


def chromium(*args: str) -> str:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files"]
    res = subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)
    return res.stdout


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_report_renders_with_every_image(tmp_path):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--out", str(out), "--only", "foundation"]) == 0
    page = (out / "report.html").read_text()
    checked = out / "checked.html"
    checked.write_text(page.replace("</body>", CHECK + "</body>"))
    dom = chromium("--virtual-time-budget=10000", "--dump-dom", checked.as_uri())
    assert "<title>IMAGES_OK" in dom, dom[:300]
    shot = tmp_path / "report.png"
    chromium(f"--screenshot={shot}", "--window-size=1100,1400", (out / "report.html").as_uri())
    assert shot.stat().st_size > 20_000  # a rendered page with text and a plot, not a blank one
    # a broken image is caught
    (out / checked.name).write_text(
        page.replace('src="', 'src="missing-').replace("</body>", CHECK + "</body>")
    )
    assert "IMAGES_BROKEN" in chromium("--virtual-time-budget=10000", "--dump-dom", checked.as_uri())
