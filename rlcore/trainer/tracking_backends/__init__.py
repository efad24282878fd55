"""The optional tracking backends of ``rlcore.trainer.tracking``, one short module per library:
TensorBoard, W&B, MLflow, trackio. Each is imported only when ``trainer.loggers`` names it.

Every backend has ``log(metrics, step)``, ``log_table(name, columns, rows, step)`` (the completion
table: ``rlcore.trainer.completion_table``) and ``close(failed)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

INSTALL_HINT = 'pip install -e ".[tracking]"'


def import_optional(module: str, backend: str) -> Any:
    """`module`, or an ImportError that names the backend and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"tracking backend {backend!r} (in trainer.loggers) needs `{module}`, which failed to "
                          f"import ({e}); install the tracking extra: {INSTALL_HINT}") from e


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as one level, keys joined by dots (``{"actor": {"lr": 1}}`` -> ``{"actor.lr": 1}``)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{name}."))
        else:
            out[name] = v
    return out
