"""An env for the fault tests, imported by path in the runner actors ("tests.faults.fault_envs:HangingToolEnv";
Ray workers have the repository root on their PYTHONPATH: tests/conftest.py)."""

import asyncio
import time
from pathlib import Path

from rlcore.agentic.env import Env, Result


class HangingToolEnv(Env):
    """A tool that never answers: the first step waits an hour. ``started`` names a file that gets the
    time the first hung step began (for the test's clock)."""

    def __init__(self, tokenizer, started: str = "", **_) -> None:
        super().__init__(tokenizer)
        self.started = started

    async def reset(self, task):
        return self.encode(task.get("prompt", "1+1="))

    async def step(self, action_token_ids):
        if self.started and not Path(self.started).exists():
            Path(self.started).write_text(repr(time.time()))
        await asyncio.sleep(3600)
        return Result()
