"""TensorBoard: scalars, the config as text, and completion tables as markdown text."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlcore.trainer.tracking_backends import import_optional

# Backslash-escaped so that model text shows as written, not as emphasis, links or table cells.
_MARKDOWN_SPECIAL = str.maketrans({c: "\\" + c for c in "\\`*_[]|#"} | {"&": "&amp;", "<": "&lt;", ">": "&gt;",
                                                                       "\n": "<br>", "\r": ""})


def markdown_cell(value: Any) -> str:
    """One table cell: numbers with 4 significant digits, None empty, text escaped (newlines as <br>)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).translate(_MARKDOWN_SPECIAL)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (TensorBoard's text plugin renders it as an HTML table)."""
    lines = ["| " + " | ".join(markdown_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(markdown_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardBackend:
    def __init__(self, log_dir: Path, config: dict[str, Any]) -> None:
        tensorboard = import_optional("torch.utils.tensorboard", "tensorboard")  # needs the tensorboard package
        self.writer = tensorboard.SummaryWriter(log_dir=str(log_dir))
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        self.writer.add_text(name, markdown_table(columns, rows), global_step=step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()
