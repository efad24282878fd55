"""rlcore. ``from rlcore import DataProto`` is ``rlcore.protocol.DataProto`` (verl's ``from verl import
DataProto``), loaded on first use so that importing a subpackage does not pull in torch through it."""

import importlib


def __getattr__(name: str):
    if name == "DataProto":
        return importlib.import_module("rlcore.protocol").DataProto
    raise AttributeError(f"module 'rlcore' has no attribute {name!r}")
