"""reasoning-gym as a prompt source: ``data.source=reasoning_gym:<task>``.

``reasoning_gym.create_dataset(task, seed=, size=, **config)`` generates the problems (each item a
pure function of seed and index); a row's prompt is the item's ``question``, its answer the item's
``answer``, and the whole item (question, answer, metadata) travels in ``extra_info["entry"]``. The
reward is the dataset's own ``score_answer(answer=..., entry=...)``: what reasoning-gym itself counts
as right, partial credit included (e.g. ``len(oracle) / len(answer)`` when the oracle answer is inside
a longer one).

Options in ``data.source_kwargs`` besides the task's own config fields (``min_terms``, ...):

- ``size`` (default 10000): items per pass; pass k is generated with another seed (rlcore.data.sources);
- ``answer_from``: what of the response is scored. "auto" (default): the last ``<answer>...</answer>``
  when the response has one, else the whole response stripped; "tag": only the tag's content (None, so
  0, without one: reasoning-gym's own evaluation); "response": the whole response stripped;
- ``system_prompt``: a system message before the question (a string, or "default" / "DeepSeekZero"
  for reasoning-gym's prompts asking for ``<answer>`` tags); none by default.
"""

from __future__ import annotations

from typing import Any

from rlcore.data.sources import PromptSource

ANSWER_FROM = ("auto", "tag", "response")


def reasoning_gym_source(task: str, *, seed: int, split: str, size: int = 10_000, answer_from: str = "auto",
                         system_prompt: str | None = None, **config: Any) -> PromptSource:
    """The rows of reasoning-gym's ``task`` generated with ``seed``, scored by its ``score_answer``."""
    import reasoning_gym  # the optional "envs" extra
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if task not in reasoning_gym.factory.DATASETS:
        known = sorted(reasoning_gym.factory.DATASETS)
        raise ValueError(f"data.source=reasoning_gym:{task}: reasoning-gym has no task {task!r}; "
                         f"it has {len(known)}, e.g. {known[:12]}")
    if answer_from not in ANSWER_FROM:
        raise ValueError(f"data.source_kwargs.answer_from must be one of {ANSWER_FROM}, got {answer_from!r}")
    try:
        dataset = reasoning_gym.create_dataset(task, seed=seed, size=size, **config)
    except TypeError as e:  # a config field the task does not have
        raise ValueError(f"data.source=reasoning_gym:{task}: data.source_kwargs {sorted(config)} do not fit the "
                         f"task's config ({e})") from None
    system = SYSTEM_PROMPTS.get(system_prompt, system_prompt) if system_prompt else None

    def rows():
        for item in dataset:
            prompt = ([{"role": "system", "content": system}, {"role": "user", "content": item["question"]}]
                      if system else item["question"])
            yield {"prompt": prompt, "answer": item["answer"], "extra_info": {"entry": item}}

    def reward(response: str, ground_truth: Any, *, extra_info: dict | None = None, **_: Any) -> float:
        """reasoning-gym's score of the response's answer (see ``answer_from``) against the row's item."""
        entry = (extra_info or {}).get("entry") or {"answer": ground_truth, "metadata": {}}
        return float(dataset.score_answer(answer=extract_answer(response, answer_from), entry=entry))

    return PromptSource(rows=rows(), reward=reward, data_source=f"reasoning_gym/{task}")


def extract_answer(response: str, answer_from: str = "auto") -> str | None:
    """The part of ``response`` that is scored (see the module docstring)."""
    from reasoning_gym.utils import extract_answer as tagged

    if answer_from == "response":
        return response.strip()
    found = tagged(response)
    if answer_from == "tag" or found is not None:
        return found
    return response.strip()
