"""Typed config sections: every section of a run is a dataclass, read and checked here, one way.

Each layer declares the sections it owns as dataclasses next to its code (``ModelConfig`` in
``rlcore.models``, ``RolloutConfig`` in ``rlcore.engines``, ``ActorConfig`` in ``rlcore.workers``,
``TrainerConfig`` in ``rlcore.trainer`` ...): a field's type and default are its documentation,
its comment says what it means. This module turns a mapping (a dict, an OmegaConf node, a Hydra
composition) into such a dataclass, through OmegaConf's structured configs, so that

- a key the dataclass does not have is refused (``actor.lrr``);
- a value is converted to the field's type or refused (``actor.lr=abc``: not a float;
  ``rollout.do_sample=no`` is False, ``=maybe`` is refused: never a truthy string);
- the dataclass's own ``__post_init__`` checks (ranges, choices) run;

and every failure is one ``ConfigError`` naming the section, the key and what was expected.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlcore.errors import UserError, did_you_mean

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A config key no section knows, a value of the wrong type, or a value out of range."""


def section_schema(cls: type) -> DictConfig:
    """The dataclass as a struct OmegaConf node: every key with its default and type. Writable even
    for a frozen dataclass, so that Hydra can compose YAMLs over it and a recipe can fill in a value
    (``model.path`` from the warm start); the dataclass instance itself stays frozen."""
    node = OmegaConf.structured(cls)
    _set_writable(node)
    return node


def _set_writable(node: DictConfig) -> None:
    """Clear the read-only flag of ``node`` and of every section nested in it: a frozen dataclass
    field holding another frozen dataclass (``actor.lora``) gets a read-only flag of its own, which
    the parent's flag does not override."""
    OmegaConf.set_readonly(node, False)
    for key in node.keys():
        child = node._get_node(key)  # the node itself: indexing would resolve it, or fail on a missing value
        if isinstance(child, DictConfig):
            _set_writable(child)


def merge_section(cls: type, given: Any, section: str) -> DictConfig:
    """``given`` (a mapping, or None for all defaults) merged over ``cls``'s defaults, typed."""
    if given is None:
        given = {}
    instance = dataclasses.is_dataclass(given) and not isinstance(given, type)
    if not instance and not isinstance(given, (Mapping, DictConfig)):
        raise ConfigError(f"config section {section!r} must be a mapping, got {type(given).__name__} {given!r}")
    try:
        return OmegaConf.merge(section_schema(cls), OmegaConf.structured(given) if instance else given)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        reason = str(exc).splitlines()[0]  # OmegaConf appends full_key/object_type lines
        unknown = _unknown_part(cls, str(key))
        hint = unknown[1] if unknown else _expected(cls, str(key))
        raise ConfigError(f"config key {section}.{key}: {reason}{hint}") from None


def unknown_key(cls: type, key: str, section: str) -> str | None:
    """Why ``<section>.<key>`` is no key of ``cls`` (with the closest one it has), or None when it is one,
    or lies below a field that is no dataclass (a mapping, ``Any``: any key goes there)."""
    unknown = _unknown_part(cls, key)
    if unknown is None:
        return None
    parent = ".".join([section, *unknown[0].split(".")[:-1]])
    return f"{section}.{unknown[0]}: no such key in {parent}{unknown[1]}"


def _unknown_part(cls: type, key: str) -> tuple[str, str] | None:
    """(the dotted key up to its first part ``cls`` does not have, the hint: the closest key, else the keys
    there are), or None when every part is a key."""
    node: Any = cls
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return None
        fields = _field_types(node)
        if part not in fields:
            return ".".join(parts[:i + 1]), did_you_mean(part, fields) or f"; its keys: {', '.join(sorted(fields))}"
        node = _unoptional(fields[part])
    return None


def _unoptional(hint: Any) -> Any:
    """``X`` for ``X | None`` / ``Optional[X]``; any other hint as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and type(None) in typing.get_args(hint) else hint


def to_section(cls: type[T], given: Any, section: str) -> T:
    """``given`` as an instance of ``cls`` (see the module docstring). An instance is checked too (against
    its own class's fields): a dataclass built in Python keeps whatever it is given, and
    ``ActorConfig(use_kl_loss="off")`` would otherwise reach a worker as a truthy string."""
    if isinstance(given, cls):
        cls = type(given)
    merged = merge_section(cls, given, section)
    try:
        return OmegaConf.to_object(merged)
    except (ValueError, TypeError) as exc:  # a __post_init__ check
        raise ConfigError(f"config section {section!r}: {exc}") from None


def read_section(config: Any, section: str, cls: type[T], required: bool = False) -> T:
    """Section ``section`` of a whole run config (dict, OmegaConf or object with attributes) as ``cls``.

    Sections the caller does not read are left alone, so a worker can be handed a recipe's whole
    config. A missing section means all defaults, unless ``required``.
    """
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    if not isinstance(config, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {type(config).__name__}")
    if required and section not in config:
        raise ConfigError(f"the config has no {section!r} section; it has {sorted(config)}")
    return to_section(cls, config.get(section), section)


def _expected(cls: type, key: str) -> str:
    """' (expected <type>)' for a known field, so a refused value says what would be accepted."""
    node: Any = cls
    for part in key.split("."):
        fields = _field_types(node) if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return ""
        node = fields[part]
    return f" (expected {node})" if isinstance(node, str) else f" (expected {getattr(node, '__name__', node)})"


def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> type of a dataclass, string annotations resolved where they can be, so that a
    nested section (``actor.lora.rank``) is followed into its own dataclass."""
    raw = {f.name: f.type for f in dataclasses.fields(cls)}
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # an annotation naming something its module does not define
        return raw
    return {name: hints.get(name, t) for name, t in raw.items()}
