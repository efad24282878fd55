"""How to call a reward function: rlcore's signature or verl's, told apart by parameter names.

rlcore's own functions take the response first and everything else by keyword:

    fn(response, ground_truth, *, prompt=..., data_source=..., **extra_keys_and_reward_kwargs)

verl's custom reward functions (``custom_reward_function.path`` there) are called by keyword:

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | {"score": ..., ...}

A function is verl-style when it has a parameter named ``solution_str`` (verl passes every argument
by name, so that name is what its functions share); otherwise it is rlcore-style and must take two
positional arguments. Either way the call is checked against the signature when the manager is
built, so a function matching neither is a clear error then, not a TypeError on the first batch.
``extra_info`` (the verl row's dict, when the data has one) reaches a function only if it names that
parameter or takes ``**kwargs``: an rlcore function written before verl data existed keeps working.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

VERL_MARKER = "solution_str"
RLCORE_FORM = "fn(response, ground_truth, **extra)"
VERL_FORM = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"


@dataclass(frozen=True)
class RewardCall:
    """A resolved function with the way to call it (``style`` is "rlcore" or "verl")."""

    fn: Callable[..., Any]
    style: str
    takes_extra_info: bool
    takes_data_source: bool

    def __call__(self, response: str, ground_truth: Any, *, prompt: Any, data_source: Any,
                 extra_info: Any, kwargs: Mapping[str, Any]) -> Any:
        info = {"extra_info": extra_info} if self.takes_extra_info else {}
        if self.style == "verl":
            source = {"data_source": data_source} if self.takes_data_source else {}
            return self.fn(solution_str=response, ground_truth=ground_truth, **source, **info, **kwargs)
        return self.fn(response, ground_truth, prompt=prompt, data_source=data_source, **info, **kwargs)


def reward_call(fn: Callable[..., Any], name: str, keywords: Iterable[str] = ()) -> RewardCall:
    """Inspect ``fn`` and check that the manager's call will bind; ``keywords`` are the names of the
    extra keyword arguments every call passes (``reward.extra_keys`` and ``reward.reward_kwargs``)."""
    keywords = tuple(keywords)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to inspect, call it rlcore's way
        return RewardCall(fn, "rlcore", takes_extra_info=False, takes_data_source=True)
    params = sig.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())

    def takes(key: str) -> bool:
        p = params.get(key)
        return var_kw or (p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

    if VERL_MARKER in params:
        call = RewardCall(fn, "verl", takes("extra_info"), takes("data_source"))
        probe = {"solution_str": "", "ground_truth": "",
                 **({"data_source": None} if call.takes_data_source else {}),
                 **({"extra_info": None} if call.takes_extra_info else {}), **dict.fromkeys(keywords)}
        _check_binds(sig, name, (), probe, "verl's functions are, " + VERL_FORM)
        return call
    probe = {"prompt": None, "data_source": None, **({"extra_info": None} if takes("extra_info") else {}),
             **dict.fromkeys(keywords)}
    _check_binds(sig, name, ("", ""), probe, "rlcore's functions are, " + RLCORE_FORM)
    return RewardCall(fn, "rlcore", takes("extra_info"), takes_data_source=True)


def _check_binds(sig: inspect.Signature, name: str, args: tuple, kwargs: dict, form: str) -> None:
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"reward function {name} has signature {sig}: it cannot be called the way {form}, with keywords "
            f"{sorted(kwargs)} ({exc}). A reward function is rlcore's {RLCORE_FORM} or verl's {VERL_FORM} "
            f"(told apart by a parameter named {VERL_MARKER!r})"
        ) from None
