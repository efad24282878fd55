"""For the test hooks (``stop_hook/`` and ``update_stop_hook/``, each a ``sitecustomize`` that Python runs at
start-up in every process of the run under test): patch a module of rlcore the moment it is first imported,
in whichever process imports it (the driver, a Ray worker), without importing it early."""

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


class PatchOnImport(importlib.abc.MetaPathFinder):
    """On the first import of ``name``: load it as usual, then call ``patch(module)``; removed after."""

    def __init__(self, name: str, patch: Callable) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install(name: str, patch: Callable) -> None:
    sys.meta_path.insert(0, PatchOnImport(name, patch))
