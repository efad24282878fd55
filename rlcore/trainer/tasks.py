"""Episode tasks from a run's prompt loader: what the agentic recipes hand their rollout pool.

Why from the loader: it is the run's resumable, seeded data order, so the tasks an agentic run
plays after a resume are the ones it would have played, as with the single-turn recipes.
"""

from __future__ import annotations

from collections.abc import Iterator

from rlcore.trainer.loop import TrainingRun


def episode_tasks(run: TrainingRun) -> Iterator[dict]:
    """Endless tasks ``{"prompt": the prompt as the policy sees it, "answer": ground truth}``, batch
    after batch; with a chat template also ``"messages"``, the prompt's messages before it (what a
    chat agent sends); with the data's ``data_source`` column, ``"data_source"`` (what the rollout
    pool's drop accounting groups by)."""
    while True:
        columns = run.next_prompts().non_tensor_batch
        messages, sources = columns.get("messages"), columns.get("data_source")
        for i, (prompt, answer) in enumerate(zip(columns["raw_prompt"], columns["ground_truth"])):
            yield {"prompt": prompt, "answer": answer, **({"messages": messages[i]} if messages is not None else {}),
                   **({"data_source": str(sources[i])} if sources is not None else {})}
