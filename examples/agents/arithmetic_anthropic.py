"""The arithmetic retry agent written with the stock ``anthropic`` client instead of OpenAI's: it asks,
reads the answer, says whether it was right, and asks again (up to ``max_tries``). Nothing in it
knows about training.

``python -m recipes.chat_agent_grpo agent.path=examples/agents/arithmetic_anthropic.py:RetryAgent``
trains the policy behind ``ctx.session_url`` (the chat proxy's Anthropic Messages route,
``/s/<session>/v1/messages``) on its episodes: the reward is ``discount ** (try - 1)`` for a right
answer at that try (1.0 at once), 0 if none is. The reply must be the answer and nothing else
(the tiny models' format).
"""

from __future__ import annotations

import anthropic


class RetryAgent:
    def __init__(self, max_tries: int = 3, discount: float = 0.5) -> None:
        self.max_tries, self.discount = max_tries, discount

    async def run(self, ctx) -> float:
        # session_url: Anthropic's client adds /v1/messages itself; the key opens this session only
        client = anthropic.AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0, timeout=60)
        messages = list(ctx.messages)
        try:
            for attempt in range(self.max_tries):
                try:
                    reply = await client.messages.create(model=ctx.model_name, max_tokens=ctx.sampling["max_tokens"],
                                                         messages=messages)
                except anthropic.BadRequestError as exc:
                    if "prompt is too long" in str(exc):  # no room for another try in the session's context
                        return 0.0
                    raise
                answer = "".join(block.text for block in reply.content if block.type == "text")
                if answer.strip() == str(ctx.label).strip():
                    return self.discount ** attempt
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": f"no. {ctx.prompt}"}]
            return 0.0
        finally:
            await client.close()
