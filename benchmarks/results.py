"""What every benchmark does with ``--json FILE``: its results as indented JSON, one file a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path | None, results: Any) -> None:
    """``results`` into ``path`` (the ``--json`` argument); nothing when it was not given."""
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n")
