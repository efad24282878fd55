"""A verifiers environment as a prompt source: ``data.source=verifiers:<environment>``.

``<environment>`` is an installed environment id, loaded with ``verifiers.load_environment(id,
**data.source_kwargs)``, or ``module:function`` / ``path/file.py:function`` returning an environment
(one built in code: ``vf.SingleTurnEnv(dataset=..., rubric=vf.Rubric(funcs=[...], weights=[...]))``).

Rows: the environment's formatted dataset (``env.get_dataset(seed=...)``: its chat ``prompt``, system
prompt and few-shot included, ``answer``, ``info``), shuffled by the seed; validation reads its
``eval_dataset`` when it has one, else the same dataset under another seed (the loader holds those rows
out of training). The whole dataset row travels in ``extra_info["input"]``.

Reward: the environment's rubric, ``await rubric.score_rollout(state)`` on a state built as the
environment's own ``init_state`` builds one (the row as its input, the response as the assistant's
completion): the weighted sum of its functions, each function's own score reported beside it (as
``reward/extra/<function>/mean``). The rubric is async; each call runs to completion in an event loop of
its own, bounded by ``score_timeout_s`` (default 8 s, below the reward manager's 10 s). verifiers
itself turns a reward function's exception into a 0 (and logs it).

Single-turn environments here: GRPO scores one response per prompt. A multi-turn environment (its
``env_response`` between the policy's turns) is refused unless ``multi_turn=true``, which hands its rows
to recipes.multi_turn_grpo, whose episodes rlcore.agentic.verifiers_env plays through rlcore's env API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from typing import Any

from rlcore.data.sources import PromptSource
from rlcore.registry import load_named

_ENVS: dict[str, Any] = {}  # one environment per (id, arguments): the train and validation streams share it


def load_env(name: str, kwargs: dict[str, Any], multi_turn: bool = False) -> Any:
    """The environment ``name`` (an id, or a factory's import path), built once per arguments; a
    multi-turn one only with ``multi_turn`` (its episodes go through rlcore.agentic.verifiers_env)."""
    import verifiers as vf  # the optional "envs" extra

    key = json.dumps([name, kwargs], sort_keys=True, default=repr)
    if key not in _ENVS:
        if ":" in name:
            factory = load_named(name, "data.source=verifiers:<factory>")
            if not callable(factory):
                raise ValueError(f"data.source=verifiers:{name}: no callable there that returns an environment")
            env = factory(**kwargs)
        else:
            env = vf.load_environment(name, **kwargs)
        if not isinstance(env, vf.Environment):
            raise TypeError(f"data.source=verifiers:{name} gave a {type(env).__name__}, not a verifiers Environment")
        _ENVS[key] = env
    env = _ENVS[key]
    if not multi_turn and not isinstance(env, vf.SingleTurnEnv):
        raise ValueError(f"data.source=verifiers:{name} is a multi-turn environment ({type(env).__name__}); GRPO "
                         "on single responses takes single-turn environments (vf.SingleTurnEnv). Its episodes train "
                         "with recipes.multi_turn_grpo and env.name=rlcore.agentic.verifiers_env:VerifiersEnv "
                         "(+data.source_kwargs.multi_turn=true): see docs/environments.md")
    return env


def verifiers_source(name: str, *, seed: int, split: str, score_timeout_s: float = 8.0, multi_turn: bool = False,
                     **env_args: Any) -> PromptSource:
    """The rows of environment ``name`` for ``split`` shuffled by ``seed``, scored by its rubric
    (``multi_turn``: a multi-turn environment's rows, for its episodes; the rubric then scores the one
    reply of the single-turn validation)."""
    if not score_timeout_s > 0:
        raise ValueError(f"data.source_kwargs.score_timeout_s must be positive, got {score_timeout_s!r}")
    env = load_env(name, env_args, multi_turn)
    has_eval = split == "val" and env.build_eval_dataset() is not None
    dataset = env.get_eval_dataset(seed=seed) if has_eval else env.get_dataset(seed=seed)
    chat = env.message_type == "chat"

    def rows():
        for row in dataset:
            prompt = row["prompt"]
            if isinstance(prompt, list):  # a dataset's messages carry every column of any message: keep two
                prompt = [{"role": m.get("role"), "content": m.get("content")} for m in prompt]
            yield {"prompt": prompt, "answer": row.get("answer", ""), "extra_info": {"input": dict(row)}}

    def reward(response: str, ground_truth: Any, *, extra_info: dict | None = None, **_: Any) -> dict[str, float]:
        """The rubric's weighted score of ``response`` as the completion of the row's input."""
        row = (extra_info or {}).get("input") or {"answer": ground_truth}
        return score_with_rubric(env.rubric, row, response, chat, score_timeout_s)

    data_source = "verifiers/" + (name.rsplit(":", 1)[-1] if ":" in name else name).replace(":", "_")
    return PromptSource(rows=rows(), reward=reward, data_source=data_source)


def score_with_rubric(rubric: Any, row: dict[str, Any], response: str, chat: bool, timeout_s: float) -> dict[str, float]:
    """``{"score": reward, <function>: its score, ...}`` of one response, by ``rubric.score_rollout``."""
    from verifiers.legacy.types import State, flatten_task_input
    from verifiers.legacy.utils.message_utils import normalize_messages

    state = State(input=dict(row))
    state["task"] = flatten_task_input(dict(row))
    if isinstance(row.get("prompt"), (str, list)):
        state["prompt"] = normalize_messages(row["prompt"], field_name="input.prompt")
    state["completion"] = (normalize_messages([{"role": "assistant", "content": response}], field_name="completion")
                           if chat else response)
    state["trajectory"] = [{"prompt": state.get("prompt"), "completion": state["completion"]}]  # one turn (num_turns)

    async def score() -> None:
        await asyncio.wait_for(rubric.score_rollout(state), timeout=timeout_s)

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread (the reward manager's): run one here
        asyncio.run(score())
    else:  # called from async code: a loop of its own in another thread
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, score()).result(timeout=timeout_s + 1)
    return {"score": float(state["reward"]), **{str(k): float(v) for k, v in (state.get("metrics") or {}).items()}}
