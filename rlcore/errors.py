"""User errors: what a user gave is wrong (a config key or value, a path, a reward function, a data row).

Why a type of their own: a recipe's command line (``rlcore.trainer.cli``) prints a ``UserError`` as its
message alone, a line or a few naming the key, the value and the fix, and exits with status 2; any other
exception is a bug or a machine's fault and keeps its traceback. ``UserError`` is a mix-in, so each
concrete error is still the built-in type callers catch (``ConfigError`` a ``ValueError``,
``MissingFileError`` a ``FileNotFoundError``).

``did_you_mean`` and ``close_file`` add the hint a typo needs: the closest known name (difflib), or the
closest file in the folder a missing path names.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable


class UserError(Exception):
    """Mix-in: a problem in what the user gave, printed without a traceback (module docstring)."""


class DataError(UserError, ValueError):
    """A data file's content is wrong: a row that does not parse, lacks a column or a ground truth."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder a setting names does not exist."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the known name closest to ``name``, or '' when none is close."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def close_file(path: str | os.PathLike) -> str:
    """' (<hint>)' for a missing ``path`` (``missing_path_hint``), or '' when there is none."""
    hint = missing_path_hint(path)
    return f" ({hint})" if hint else ""


def missing_path_hint(path: str | os.PathLike) -> str:
    """The closest name in a missing ``path``'s folder ('did you mean ...?'), or that the folder is missing."""
    folder, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    close = difflib.get_close_matches(name, sorted(os.listdir(folder)), n=1, cutoff=0.6)
    return f"did you mean {os.path.join(folder, close[0])}?" if close else ""
