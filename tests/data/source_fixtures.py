"""Sources for the tests, named by path as a user would: a seeded generator function (finite, so its
passes roll over), one that yields a bad row, and small verifiers environments built with the real
library's classes (no download: the datasets are made here)."""

import random

from rlcore.data.sources import PromptSource


def sums(seed: int, count: int = 7):
    """``count`` "a+b=" problems from ``seed``, with their own exact-match verifier."""
    rng = random.Random(seed)

    def rows():
        for _ in range(count):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            yield {"prompt": f"{a}+{b}=", "answer": str(a + b)}

    def reward(response, ground_truth, **_):
        return float(response.strip() == ground_truth)

    return PromptSource(rows=rows(), reward=reward, data_source="test_sums")


def bad_rows(seed: int):
    """Rows 0-2 are fine; row 3 has no answer."""
    for i in range(5):
        yield {"prompt": f"{i}+1="} if i == 3 else {"prompt": f"{i}+1=", "answer": str(i + 1), "data_source": "arithmetic"}


def unscored(seed: int):
    yield {"prompt": "1+1=", "answer": "2"}  # data_source defaults to the function's name: no reward has it


def _xml():
    import verifiers as vf

    return vf.XMLParser(["answer"], answer_field="answer")


def correct(completion, answer, **kwargs) -> float:
    return float((_xml().parse_answer(completion) or "").strip() == answer)


def tagged(completion, **kwargs) -> float:
    return 1.0 if "<answer>" in str(completion) else 0.0


def arithmetic_env(n: int = 40, with_eval: bool = False):
    """A single-turn verifiers environment: "a+b=" questions, rubric 1.0 * correct + 0.2 * tagged."""
    import datasets
    import verifiers as vf

    rng = random.Random(0)
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in
            ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n))]
    evaluation = datasets.Dataset.from_list([{"question": "10+10=", "answer": "20"}]) if with_eval else None
    return vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows), eval_dataset=evaluation,
                            rubric=vf.Rubric(funcs=[correct, tagged], weights=[1.0, 0.2], parser=_xml()),
                            parser=_xml())


def tool_env():
    """A multi-turn environment (tools): refused as a prompt source."""
    import datasets
    import verifiers as vf

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    return vf.ToolEnv(dataset=datasets.Dataset.from_list([{"question": "1+1=", "answer": "2"}]), tools=[add])


def retry_env(n: int = 20, max_turns: int = 2):
    """A multi-turn verifiers environment: a wrong answer hears "wrong, try again." (up to ``max_turns``
    tries); solved ends the episode; the rubric scores the last answer (1.0 * correct)."""
    import datasets
    import verifiers as vf

    class Retry(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "wrong, try again."}]

        @vf.stop
        async def solved(self, state, **kwargs) -> bool:
            steps = state["trajectory"]
            return bool(steps) and correct(steps[-1]["completion"], state["answer"]) == 1.0

    rng = random.Random(1)
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in
            ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n))]
    return Retry(dataset=datasets.Dataset.from_list(rows), rubric=vf.Rubric(funcs=[correct], parser=_xml()),
                 parser=_xml(), max_turns=max_turns)
