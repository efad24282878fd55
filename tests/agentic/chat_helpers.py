"""What the chat proxy tests share: sampling settings, a recording router, a served proxy on the real
tiny-model engine, the stock client on a session, greedy decoding by hand, the template's rendering."""

import asyncio
import contextlib
import time

import openai
import torch
from transformers import AutoTokenizer

from rlcore.agentic.async_router import AsyncSessionRouter
from rlcore.agentic.chat_proxy import ChatProxy, ChatProxyConfig
from rlcore.engines.async_base import Completion
from rlcore.engines.async_hf import AsyncHFEngine
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.models.config import ModelConfig

SAMPLED = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, n=1, do_sample=True)
GREEDY = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, n=1, do_sample=False)
CALC = {"type": "function", "function": {"name": "calc", "description": "a+b",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}
CALL_TEXT = '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'


class Recording:
    """The router, with every completion it returned written down (what the engine sampled), in
    the order the requests were made (the engine batches them and may finish them in any order)."""

    def __init__(self, router: AsyncSessionRouter) -> None:
        self.router, self.calls, self.streamed = router, [], []  # streamed: per stream, the chunks' token ids

    async def generate(self, prompt_ids, sampling, session_id=None):
        call = [session_id, list(prompt_ids), None]
        self.calls.append(call)
        call[2] = await self.router.generate(prompt_ids, sampling, session_id)
        return call[2]

    async def generate_stream(self, prompt_ids, sampling, session_id=None):
        call, streamed = [session_id, list(prompt_ids), None], []
        self.calls.append(call)
        self.streamed.append(streamed)
        async for item in self.router.generate_stream(prompt_ids, sampling, session_id):
            if isinstance(item, Completion):
                call[2] = item
            else:
                streamed += item.token_ids
            yield item

    def release(self, session_id) -> None:
        self.router.release(session_id)


@contextlib.asynccontextmanager
async def serving(model_dir, sampling=SAMPLED, **config):
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig())
    recording = Recording(AsyncSessionRouter([engine]))
    proxy = ChatProxy(recording, AutoTokenizer.from_pretrained(model_dir), sampling, ChatProxyConfig(**config))
    await proxy.start()
    try:
        yield proxy, recording, engine
    finally:
        await proxy.stop()
        await engine.close()


def client(access, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key, max_retries=0, timeout=30, **kw)


@torch.no_grad()
def hand_greedy(model, prompt_ids, max_new_tokens, stop_ids):
    """Greedy decoding as a plain loop over full forwards (the engines' own tests use the same)."""
    seq, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        out.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        seq.append(out[-1])
        if out[-1] in stop_ids:
            break
    return out


def render(tok, messages, **kw) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw),
                      add_special_tokens=False)


class SlowSteps:
    """Each decode step of the engine takes ``delay_s`` longer (a turn that visibly takes time); ``steps``
    counts the steps taken so far (what a test compares events against, rather than the clock)."""

    def __init__(self, engine, delay_s):
        self.batch, self.delay_s = engine.batch, delay_s
        self.steps = 0

    def __call__(self, tokens):
        time.sleep(self.delay_s)
        out = type(self.batch).step(self.batch, tokens)
        self.steps += 1
        return out

    def __enter__(self):
        self.batch.step = self
        return self

    def __exit__(self, *exc):
        del self.batch.step


async def until_idle(engine, hang_guard_s=60.0):
    """Waits for the engine to have nothing running (a hang guard: a dropped request goes at its next step)."""
    deadline = time.monotonic() + hang_guard_s
    while (engine.num_running() or engine.rows) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
