"""The run's best validation score: recorded, its weights kept, and said at the end.

Why: the greedy validation score of a small RL run wanders from one validation to the next (the
default PPO run's 80 prompts: one answer is 0.0125), so the last step is not always the best. Measured
on the default run: 0.70 at step 140, 0.5875 at step 150. A user's first number should not hang on
where the last step happened to land; so every validated row also logs the best score so far and its
step (``val/best``, ``val/best_step``: the trackers and ``python -m rlcore.inspect`` show them), and
with ``trainer.keep_best`` (and ``trainer.export_hf``) the policy of each new best is exported as a HF
model to ``<run>/hf_best`` (one export per improvement, not per validation), ``best.json`` in it
naming its step and score. The run ends with one line: the final score, the best, and where its
weights are.

The score judged is ``val/reward_mean`` (``val/pair_accuracy`` for a reward model); a tie keeps the
earlier step. A best picked by the validation score is an optimistic estimate of that step's quality
(the same prompts chose it): score ``hf_best`` on prompts it was not chosen on for an unbiased number
(``python -m rlcore.trainer.evaluate``).

A resumed run rebuilds the best from its metrics.jsonl rows up to the checkpoint; an ``hf_best`` of a
later step (logged after the checkpoint, so run again) is dropped, since that step's record is.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

JUDGED = ("val/reward_mean", "val/pair_accuracy")  # the first one a validation returns is the score
BEST_DIR = "hf_best"
MARKER = "best.json"


def judged_score(metrics: Mapping[str, Any]) -> tuple[str, float] | None:
    """The validation score ``metrics`` holds (name, value), or None for a row without validation."""
    for key in JUDGED:
        if key in metrics:
            return key, float(metrics[key])
    return None


class BestValidation:
    """Tracks the best validation score of a run and keeps its weights.

    ``export(folder)`` writes the policy as a HF model to ``folder`` and returns False when the run
    has nothing to export; None: the best is recorded and said, its weights are not kept.
    """

    def __init__(self, run_dir: Path, export: Callable[[Path], bool] | None) -> None:
        self.dir = Path(run_dir) / BEST_DIR
        self.export = export
        self.key: str | None = None
        self.score: float | None = None
        self.step: int | None = None
        self.last: tuple[int, float] | None = None  # the latest validation: (step, score)
        self.kept_step: int | None = None  # the step whose weights self.dir holds

    def resume(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """The best of the logged rows (a resumed run's, up to its checkpoint); an ``hf_best`` not of that
        best's step is deleted (its step was logged after the checkpoint, so it is run again)."""
        for row in rows:
            self._record(int(row["step"]), row)
        marker = self.dir / MARKER
        kept = json.loads(marker.read_text())["step"] if marker.exists() else None
        if kept is not None and kept == self.step:
            self.kept_step = kept
        elif self.dir.exists():
            shutil.rmtree(self.dir)
            if kept is not None:
                print(f"removed {self.dir}: its step {kept} is not in this run's record (logged after the "
                      "checkpoint it resumes from, or an earlier run's)", flush=True)

    def observe(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """After a validation at ``step``: ``val/best`` and ``val/best_step`` to log with it (nothing when
        ``metrics`` holds no validation score), and the weights exported when the score is a new best."""
        new_best = self._record(step, metrics)
        if new_best is None:
            return {}
        if new_best and self.export is not None:
            self._keep(step)
        return self.metrics()

    def _keep(self, step: int) -> None:
        """Export the weights now as ``hf_best``, replacing the earlier best's only once written."""
        partial = self.dir.with_name(BEST_DIR + ".partial")  # a cut-short export never replaces a whole one
        shutil.rmtree(partial, ignore_errors=True)
        if not self.export(partial):
            self.export = None  # nothing this run trains exports: nothing to keep later either
            return
        (partial / MARKER).write_text(json.dumps({"step": step, self.key: self.score}) + "\n")
        shutil.rmtree(self.dir, ignore_errors=True)
        partial.rename(self.dir)
        self.kept_step = step

    def _record(self, step: int, metrics: Mapping[str, Any]) -> bool | None:
        """Note a validation row; True when its score is a new best, None when it holds no score."""
        found = judged_score(metrics)
        if found is None:
            return None
        self.key, score = found
        self.last = (step, score)
        if self.score is not None and score <= self.score:
            return False
        self.score, self.step = score, step
        return True

    def metrics(self) -> dict[str, float]:
        return {"val/best": self.score, "val/best_step": float(self.step)}

    def summary(self) -> str | None:
        """One line: the final and the best score with their steps, and where the best weights are."""
        if self.last is None:
            return None
        step, score = self.last
        line = f"{self.key}: {score:.4g} at the last validation (step {step}), best {self.score:.4g} at step {self.step}"
        if self.kept_step == self.step:
            return f"{line}; its weights: {self.dir}"
        return f"{line}; its weights were not kept (trainer.keep_best and trainer.export_hf keep them)"
