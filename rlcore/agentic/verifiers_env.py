"""A verifiers multi-turn environment behind rlcore's token-first env API (rlcore.agentic.env).

    python -m recipes.multi_turn_grpo data.source=verifiers:<environment> +data.source_kwargs.multi_turn=true \\
        env.name=rlcore.agentic.verifiers_env:VerifiersEnv +env.kwargs.environment=<environment>

verifiers runs an episode itself (``MultiTurnEnv.rollout``: its loop asks a client for each model turn);
here rlcore's engine samples the turns, so this class plays that loop's part, as verifiers' own loop does:

- ``reset(task)``: the state ``init_state`` builds from the task's dataset row (``extra_info["input"]``,
  which the verifiers prompt source puts there; else the task's chat ``messages`` and ``answer``), then
  the environment's ``setup_state``; the observation is the row's prompt through the chat template;
- ``step(action)``: the decoded turn is appended to the trajectory as the assistant's message; when a stop
  condition of the environment holds (``is_completed``: its ``max_turns``, its own ``@vf.stop`` methods),
  or its ``env_response`` set ``final_env_response``, the rubric scores the whole conversation
  (``score_rollout``, as ``rollout`` ends) and the episode ends with that reward; otherwise the
  environment's ``env_response`` messages are rendered after the model's turn as the next observation.

Every awaited call into verifiers is bounded by ``timeout_s``. Not covered: environments whose turns
need tool definitions in the template (``ToolEnv`` and its tool calls: rlcore's chat-agent recipe serves
those through an OpenAI-compatible endpoint), token-budget stops (``max_total_completion_tokens``: no
usage is recorded) and group-level rubric functions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from rlcore.agentic.env import Env, Observation, Result
from rlcore.data.verifiers_source import load_env


def _plain(messages: Any) -> list[dict[str, Any]]:
    """verifiers' messages (pydantic objects or dicts) as {"role", "content"} dicts for the chat template."""
    out = []
    for m in messages or []:
        get = m.get if isinstance(m, Mapping) else (lambda key, m=m: getattr(m, key, None))
        out.append({"role": get("role"), "content": get("content") or ""})
    return out


class VerifiersEnv(Env):
    """One episode of the verifiers environment ``environment`` (an id or a factory's import path, as
    ``data.source=verifiers:<environment>`` names it; ``env_args`` its arguments, the same as
    ``data.source_kwargs`` so that rows and episodes come from one environment).

    ``max_turns`` and ``discount`` are the keys the multi-turn recipe's ``env.kwargs`` carries by default
    (for its arithmetic_retry env); they are not passed on: the environment's own stop conditions and
    rubric decide, and the recipe's ``env.max_turns`` bounds the episode."""

    def __init__(self, tokenizer, environment: str, env_args: Mapping[str, Any] | None = None,
                 timeout_s: float = 30.0, max_turns: Any = None, discount: Any = None) -> None:
        super().__init__(tokenizer)
        self.chat  # built now: a tokenizer without a chat template fails here
        self.vf_env = load_env(environment, dict(env_args or {}), multi_turn=True)
        self.timeout_s = float(timeout_s)
        self.state: Any = None

    async def _call(self, awaitable: Any) -> Any:
        return await asyncio.wait_for(awaitable, timeout=self.timeout_s)

    async def reset(self, task: Mapping[str, Any]) -> Observation:
        from verifiers.legacy.types import State, flatten_task_input
        from verifiers.legacy.utils.message_utils import normalize_messages

        row = dict(((task.get("extra_info") or {}).get("input")) or {})
        if not row:
            if not task.get("messages"):
                raise ValueError(f"VerifiersEnv needs a task with the environment's row (extra_info.input) or chat "
                                 f"messages, got keys {sorted(task)}")
            row = {"prompt": [dict(m) for m in task["messages"]], "answer": task.get("answer", ""), "example_id": 0}
        state = State(input=row)
        state["task"] = flatten_task_input(dict(row))
        state["prompt"] = normalize_messages(row["prompt"], field_name="input.prompt")
        state.update(trajectory=[], is_completed=False, is_truncated=False, trajectory_id="0")
        state = await self._call(self.vf_env.setup_state(state)) or state
        self.state, self.messages = state, _plain(state["prompt"])
        return self.render_prompt(self.messages)

    async def step(self, action_token_ids: Sequence[int]) -> Result:
        from verifiers.legacy.utils.message_utils import concat_messages, normalize_messages

        state = self.state
        if state is None or state.get("is_completed"):
            raise RuntimeError("step() on a finished episode: call reset() first")
        reply = normalize_messages([{"role": "assistant", "content": self.decode_action(action_token_ids)}],
                                   field_name="completion")
        prompt = normalize_messages(self.messages, field_name="prompt")
        state["trajectory"].append({"prompt": prompt, "completion": reply, "is_truncated": False, "extras": {},
                                    "reward": None, "advantage": None, "trajectory_id": "0"})
        turns = len(state["trajectory"])
        if not await self._call(self.vf_env.is_completed(state)):
            response = _plain(await self._call(self.vf_env.env_response(concat_messages([prompt, reply]), state)))
            if state.get("final_env_response") is None:
                self.messages = [*self.messages, *_plain(reply), *response]
                return Result(0.0, self.render_turn(action_token_ids, response), info={"turns": float(turns)})
        return await self._finish(turns)

    async def _finish(self, turns: int) -> Result:
        """The rubric's score of the whole conversation, as verifiers' rollout ends."""
        state = self.state
        state["is_completed"] = True
        last = state["trajectory"][-1]
        conversation = [*last["prompt"], *last["completion"]]
        if state.get("final_env_response"):  # what the environment said last, as verifiers' render_completion keeps it
            from verifiers.legacy.utils.message_utils import normalize_messages
            conversation += normalize_messages(state["final_env_response"], field_name="final_env_response")
        state["completion"] = conversation[len(state["prompt"]):]
        await self._call(self.vf_env.rubric.score_rollout(state))
        info = {"turns": float(turns), **{f"rubric/{k}": float(v) for k, v in (state.get("metrics") or {}).items()}}
        return Result(float(state["reward"]), [], terminated=True, info=info)
