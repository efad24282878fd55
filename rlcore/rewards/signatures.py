"""How to call a reward function: rlcore's signature, verl's or TRL's, told apart by parameter names.

rlcore's own functions take the response first and everything else by keyword:

    fn(response, ground_truth, *, prompt=..., data_source=..., **extra_keys_and_reward_kwargs)

verl's custom reward functions (``custom_reward_function.path`` there) are called by keyword:

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | {"score": ..., ...}

TRL's (``GRPOTrainer(reward_funcs=...)``) are called once per batch, every argument by name, each
data column a list with one entry per row:

    f(prompts, completions, **columns) -> list[float | None]

``prompts`` and ``completions`` are strings, or for conversational data chat messages: a prompt is
its list of ``{"role", "content"}`` messages, a completion ``[{"role": "assistant", "content": text}]``.
The columns are ``ground_truth`` (also under the data's answer column name, e.g. ``answer``),
``data_source``, ``extra_info``, ``completion_ids`` (the response's token ids) and each
``reward.extra_keys`` column; ``reward.reward_kwargs`` come as plain values. A function without
``**kwargs`` gets only the names it lists. None in the returned list means "not applicable to this row".

A function is verl-style when it has a parameter named ``solution_str`` (verl passes every argument
by name, so that name is what its functions share); TRL-style when it has one named ``completions``
(TRL's own functions may leave out ``prompts``); otherwise it is rlcore-style and must take two
positional arguments. Whichever form, the call is checked against the signature when the manager is
built, so a function matching none is a clear error then, not a TypeError on the first batch.
``extra_info`` (the verl row's dict, when the data has one) reaches a function only if it names that
parameter or takes ``**kwargs``: an rlcore function written before verl data existed keeps working.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

VERL_MARKER = "solution_str"
TRL_MARKER = "completions"
RLCORE_FORM = "fn(response, ground_truth, **extra)"
VERL_FORM = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
TRL_FORM = "f(prompts, completions, **columns) -> list[float | None]"
FORMS = (f"rlcore's {RLCORE_FORM}, verl's {VERL_FORM} (a parameter named {VERL_MARKER!r}) or TRL's "
         f"{TRL_FORM} (a parameter named {TRL_MARKER!r}, called once per batch)")


@dataclass(frozen=True)
class RewardCall:
    """A resolved function with the way to call it (``style`` is "rlcore", "verl" or "trl");
    ``accepts``: the keywords a TRL-style function without ``**kwargs`` lists (None: any)."""

    fn: Callable[..., Any]
    style: str
    takes_extra_info: bool
    takes_data_source: bool
    accepts: frozenset[str] | None = None

    @property
    def batched(self) -> bool:
        """One call scores many rows (TRL's form); else one call per row."""
        return self.style == "trl"

    def call_batch(self, prompts: list, completions: list, columns: Mapping[str, Any]) -> Any:
        """TRL's call: ``columns`` (lists, one entry per row, and the plain reward_kwargs) by name."""
        given = {"prompts": prompts, "completions": completions, **columns}
        if self.accepts is not None:
            given = {k: v for k, v in given.items() if k in self.accepts}
        return self.fn(**given)

    def __call__(self, response: str, ground_truth: Any, *, prompt: Any, data_source: Any,
                 extra_info: Any, kwargs: Mapping[str, Any]) -> Any:
        info = {"extra_info": extra_info} if self.takes_extra_info else {}
        if self.style == "verl":
            source = {"data_source": data_source} if self.takes_data_source else {}
            return self.fn(solution_str=response, ground_truth=ground_truth, **source, **info, **kwargs)
        return self.fn(response, ground_truth, prompt=prompt, data_source=data_source, **info, **kwargs)


def reward_call(fn: Callable[..., Any], name: str, keywords: Iterable[str] = (),
                batch_keywords: Iterable[str] = ()) -> RewardCall:
    """Inspect ``fn`` and check that the manager's call will bind; ``keywords`` are the names of the
    extra keyword arguments every call passes (``reward.extra_keys`` and ``reward.reward_kwargs``),
    ``batch_keywords`` the further columns a TRL-style call passes (``ground_truth``, ``data_source``, ...)."""
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

    if TRL_MARKER in params and VERL_MARKER not in params:
        offered = {"prompts", TRL_MARKER, *batch_keywords, *keywords}
        accepts = None if var_kw else frozenset(k for k in offered if takes(k))
        probe = {k: None for k in offered if accepts is None or k in accepts}
        _check_binds(sig, name, (), probe, "TRL's functions are, " + TRL_FORM)
        return RewardCall(fn, "trl", takes("extra_info"), takes("data_source"), accepts)
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
            f"{sorted(kwargs)} ({exc}). A reward function is {FORMS}"
        ) from None
