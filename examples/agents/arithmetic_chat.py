"""An arithmetic agent written as any OpenAI-client agent is: it asks, reads the answer, says
whether it was right, and asks again (up to ``max_tries``). Nothing in it knows about training.

``recipes/chat_agent_grpo.py`` trains the policy behind ``ctx.base_url`` on its episodes: the
reward is ``discount ** (try - 1)`` for a right answer at that try (1.0 at once), 0 if none is.
``check="exact"``: the reply is the answer and nothing else (the tiny models' format);
``check="number"``: the reply's final number is (a real chat model's "17 + 25 = 42." is right).
"""

from __future__ import annotations

import re

import openai

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The number after the last "answer is", else the text's last number."""
    lower = text.lower()
    if "answer is" in lower:
        after = _NUMBER.findall(text[lower.rindex("answer is"):])
        if after:
            return after[0]
    found = _NUMBER.findall(text)
    return found[-1] if found else None


class RetryAgent:
    def __init__(self, max_tries: int = 3, discount: float = 0.5, check: str = "exact") -> None:
        if check not in ("exact", "number"):
            raise ValueError(f"check must be 'exact' or 'number', got {check!r}")
        self.max_tries, self.discount, self.check = max_tries, discount, check

    def right(self, answer: str, label) -> bool:
        if self.check == "exact":
            return answer.strip() == str(label).strip()
        number = final_number(answer)
        return number is not None and float(number) == float(label)

    async def run(self, ctx) -> float:
        # http_client: the runner's connection pool (optional; without it the client builds its own)
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=60,
                                    http_client=ctx.http_client)
        messages = list(ctx.messages)
        try:
            for attempt in range(self.max_tries):
                try:
                    reply = await client.chat.completions.create(model=ctx.model_name, messages=messages)
                except openai.BadRequestError as exc:
                    if exc.code == "context_length_exceeded":
                        return 0.0  # no room for another try
                    raise
                answer = reply.choices[0].message.content or ""
                if self.right(answer, ctx.label):
                    return self.discount ** attempt
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": f"no. {ctx.prompt}"}]
            return 0.0
        finally:
            if ctx.http_client is None:
                await client.close()
