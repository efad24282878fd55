"""Registry: named, pluggable functions (advantage estimators, policy losses, reward functions).

A config names the function; a recipe or user module adds its own with ``@registry.register(name)``.
A name of the form ``package.module:function`` is imported where it is looked up, which is what a
Ray worker process needs: it never ran the recipe module that registered the function.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import uuid
from typing import Any, Callable, Generic, TypeVar

from rlcore.errors import MissingFileError, UserError, close_file, did_you_mean

F = TypeVar("F", bound=Callable)


class UnknownNameError(UserError, ValueError):
    """A name a setting gives is not registered, or not defined where it points."""


class Registry(Generic[F]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: make ``fn`` available as ``name``. A name can be taken only once."""

        def decorate(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            if not callable(fn):
                raise TypeError(f"{self.kind} {name!r} must be callable, got {type(fn).__name__}")
            self._entries[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> F:
        if name in self._entries:
            return self._entries[name]
        if ":" in name:
            module, attr = name.rsplit(":", 1)
            loaded = importlib.import_module(module)
            fn = getattr(loaded, attr, None)
            if not callable(fn):
                raise UnknownNameError(f"{self.kind} {name!r}: module {module!r} has no callable {attr!r}"
                                       f"{did_you_mean(attr, public_callables(loaded))}")
            return fn
        raise UnknownNameError(f"unknown {self.kind} {name!r}{did_you_mean(name, self.names())}; known: "
                               f"{self.names()} or 'package.module:function'")

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)


def load_named(path: str, what: str) -> Any:
    """The object at ``file.py:Name`` or ``package.module:Name`` (``what`` names the setting in errors),
    None when the module has no such name."""
    return getattr(load_module(path, what), path.rpartition(":")[2], None)


def load_module(path: str, what: str) -> Any:
    """The module of ``file.py:Name`` or ``package.module:Name``. A file is imported as a module of a fresh
    name, so two files of one name do not collide."""
    where, sep, name = path.rpartition(":")
    if not sep or not where or not name:
        raise UnknownNameError(f"{what} must be 'path/to/file.py:Name' or 'package.module:Name', got {path!r}")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise MissingFileError(f"{what} file {where!r} does not exist{close_file(where)} (from {what}={path!r})")
        spec = importlib.util.spec_from_file_location(f"rlcore_loaded_{uuid.uuid4().hex[:8]}", where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(where)


def public_callables(module: Any) -> list[str]:
    """The names of a module's public callables: the candidates a misspelt ``file.py:name`` is matched to."""
    return sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
