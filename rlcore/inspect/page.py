"""The page: one HTML file with its script, style and data inline, so that it opens from disk, on a
machine with no network, and can be copied or attached to a bug report as it is.

Why inline data and no JS library: no CDN can be reached here (nor from many clusters), and a run's
sample is small (a few KB per step).
"""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path
from typing import Any

from rlcore.inspect.run_data import load_run

PAGE_FILE = "inspector.html"


def asset(name: str) -> str:
    return resources.files("rlcore.inspect").joinpath("assets", name).read_text(encoding="utf-8")


def script_json(data: Any) -> str:
    """``data`` as JSON that cannot end the <script> element holding it (no raw <, >, &)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(data: dict[str, Any]) -> str:
    """The page (HTML text) for ``data`` from ``load_run``."""
    title = html.escape(f"{data['run']} - rlcore inspector")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>{asset("inspector.css")}</style>
</head><body>
<div id="app"><noscript>The inspector needs JavaScript.</noscript></div>
<script id="run-data" type="application/json">{script_json(data)}</script>
<script>{asset("inspector.js")}</script>
</body></html>
"""


def write_page(folder: str | Path, out: str | Path | None = None, last: int | None = None) -> Path:
    """Write the page of the run in ``folder`` to ``out`` (default ``<folder>/inspector.html``); its path."""
    data = load_run(folder, last)
    path = Path(out) if out is not None else Path(data["folder"]) / PAGE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_page(data), encoding="utf-8")
    tmp.replace(path)
    return path
