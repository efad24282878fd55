"""Envs for the asynchronous rollout tests, imported by path ("tests.agentic.async_envs:HangingEnv")
in the runner actors: Ray workers have the repository root on their PYTHONPATH (tests/conftest.py)."""

import asyncio

from rlcore.agentic.env import Env, Result


class HangingEnv(Env):
    """A tool that never answers: every step waits an hour."""

    def __init__(self, tokenizer, prompt: str = "1+1=") -> None:
        super().__init__(tokenizer)
        self.prompt = prompt

    async def reset(self, task):
        return self.encode(self.prompt)

    async def step(self, action_token_ids):
        await asyncio.sleep(3600)
        return Result()
