"""A recipe's command line: a user's mistake printed as a few lines and exit status 2, not a traceback.

Every recipe goes through the two functions here: its ``__main__`` calls ``prepare_argv(SECTIONS)``
before Hydra reads ``sys.argv``, and its Hydra main is wrapped in ``@user_errors``.

- ``prepare_argv`` rewrites verl's keys (``rlcore.trainer.verl_compat``) and checks every
  ``section.key=value`` override against the recipe's sections, so that a typo gets the closest key
  (``actor.lrr: no such key in actor (did you mean 'lr'?)``) rather than Hydra's "Could not override";
  a value of the wrong type is named with the type expected; every refused key, unknown key and
  refused value is printed at once.
- ``user_errors`` catches a ``rlcore.errors.UserError`` raised while the run starts (a ``ConfigError``
  from ``load_config``, the pre-flight's ``PreflightError`` listing every problem, a data file's
  ``DataError`` naming file and row) and prints its message alone. Any other exception is a bug or a
  fault of the machine, and Hydra prints it with its traceback as before.

The traceback of a user error too: ``--debug`` on the command line (taken off before Hydra sees it; it
sets ``RLCORE_DEBUG=1`` and Hydra's ``HYDRA_FULL_ERROR=1``), or either variable set in the environment.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType

from rlcore.errors import UserError
from rlcore.trainer.config import SECTIONS
from rlcore.trainer.verl_compat import translate_overrides_collecting
from rlcore.typed_config import ConfigError, merge_section, unknown_key

DEBUG_ENV = "RLCORE_DEBUG"
EXIT_USER_ERROR = 2  # as argparse exits on a bad argument


def debugging() -> bool:
    """Whether a user error shows its traceback (``--debug``, ``RLCORE_DEBUG=1`` or ``HYDRA_FULL_ERROR=1``)."""
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0") or os.environ.get("HYDRA_FULL_ERROR") == "1"


def prepare_argv(sections: Sequence[str]) -> None:
    """``sys.argv`` made ready for Hydra (module docstring): ``--debug`` taken off, verl's keys rewritten
    with a note each, and the process ended (status 2) listing every refused or unknown key."""
    args = sys.argv[1:]
    if "--debug" in args:
        args = [a for a in args if a != "--debug"]
        os.environ[DEBUG_ENV] = "1"
        os.environ["HYDRA_FULL_ERROR"] = "1"
    args, notes, refused = translate_overrides_collecting(args, sections)
    problems = refused + override_problems(args, sections)
    if problems:
        fail(problems)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    sys.argv[1:] = args


def override_problems(args: Sequence[str], sections: Sequence[str]) -> list[str]:
    """A line for each ``section.key=value`` whose key the section does not have (with the closest key), or
    whose value its type refuses (``actor.lr=abc``). Hydra's own overrides (``hydra.*``, a config group
    such as ``preset=smollm2``, ``+key``/``~key``, sweeps, interpolations) are left to Hydra."""
    parser, problems = OverridesParser.create(), []
    for arg in args:
        try:
            [override] = parser.parse_overrides([arg])
        except Exception:  # noqa: BLE001 - a flag (--cfg job) or a malformed override: Hydra's own
            continue
        section, _, rest = override.key_or_group.partition(".")
        if override.type != OverrideType.CHANGE or override.package or section not in sections or not rest:
            continue
        problem = unknown_key(SECTIONS[section], rest, section)
        if problem is None and not override.is_sweep_override():
            value = override.value()
            if not (isinstance(value, str) and "${" in value):
                problem = _refused_value(section, rest, value)
        if problem:
            problems.append(problem)
    return problems


def _refused_value(section: str, key: str, value: Any) -> str | None:
    """Why the section's type refuses ``value`` for ``key``, or None."""
    nested: Any = value
    for part in reversed(key.split(".")):
        nested = {part: nested}
    try:
        merge_section(SECTIONS[section], nested, section)
    except ConfigError as exc:
        return str(exc)
    return None


def user_errors(main: Callable[..., Any]) -> Callable[..., Any]:
    """``main`` (a recipe's Hydra main), a ``UserError`` it raises printed as lines and exit status 2."""

    @functools.wraps(main)  # Hydra unwraps it to find the recipe's module and config folder
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except UserError as exc:
            if debugging():
                raise
            fail(str(exc).splitlines())

    return run


def fail(lines: Sequence[str]) -> None:
    """Print ``lines`` as the error and exit with status 2: one line as it is; several under a count (or
    under the message's own first line, when that is a heading ending in ':'), one problem per line."""
    lines = [line.strip() for line in lines if line.strip()]
    if len(lines) > 1 and not lines[0].endswith(":"):
        lines = [f"{len(lines)} problems:", *lines]
    print(f"error: {lines[0]}", file=sys.stderr)
    for line in lines[1:]:
        print(f"  {line if line.startswith('- ') else '- ' + line}", file=sys.stderr)
    print("(the traceback: run again with --debug)", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USER_ERROR)
