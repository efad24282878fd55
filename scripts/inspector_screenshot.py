"""Redraw docs/img/inspector.png from a run folder, so the picture in the docs is the page as it is now.

    python -m recipes.grpo trainer.total_steps=30 trainer.output_dir=/tmp/shot
    python scripts/inspector_screenshot.py /tmp/shot/grpo/default [docs/img/inspector.png]

Renders the run's page (``python -m rlcore.inspect``), opens it in Debian's headless chromium through
playwright (both installed by scripts/setup.sh), opens the last step's first response and writes a
1200 x 1000 screenshot of the top of the page.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright


def main(run_dir: str, out: str = "docs/img/inspector.png") -> None:
    subprocess.run([sys.executable, "-m", "rlcore.inspect", run_dir], check=True)
    page_file = Path(run_dir) / "inspector.html"
    chromium = shutil.which("chromium") or "/usr/lib/chromium/chromium"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": 1200, "height": 1000})
        tab.goto(page_file.resolve().as_uri())
        rows = tab.locator(".bar")  # a response's line: a click shows its tokens
        if rows.count():
            rows.first.click()
        tab.wait_for_timeout(300)
        tab.screenshot(path=out)
        browser.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
