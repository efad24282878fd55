"""A verifiers environment built in code, as a verifiers user writes one: sums of two numbers as a
``SingleTurnEnv`` whose rubric rewards the right final number (1.0: the one inside
``<answer>...</answer>``, else the reply's last number) and the answer format itself (0.2). Nothing in
it knows about rlcore:

    python -m recipes.grpo +preset=smollm2 data.source=verifiers:examples/envs/verifiers_sums.py:load_environment

trains on its rows with its rubric as the reward (docs/environments.md).
"""

from __future__ import annotations

import random
import re

import datasets
import verifiers as vf


def load_environment(n: int = 400, max_operand: int = 99, seed: int = 0) -> vf.SingleTurnEnv:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n)]
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct_answer(completion, answer, **kwargs) -> float:
        tagged = parser.parse_answer(completion)
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", tagged if tagged else text or "")
        return float(bool(numbers) and numbers[-1] == answer)

    rubric = vf.Rubric(funcs=[correct_answer, parser.get_format_reward_func()], weights=[1.0, 0.2], parser=parser)
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows), parser=parser, rubric=rubric,
                            system_prompt="Give the final number inside <answer></answer>.")
