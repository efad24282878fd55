"""The run's best validation score (rlcore.trainer.best_val): which step is best, what is logged, what
``hf_best`` holds after new bests, ties, a resume and a run with nothing to export."""

import json

from rlcore.trainer.best_val import BEST_DIR, MARKER, BestValidation


class Exports:
    """The export hook: writes a file naming the step it was called at, like a model export would a model."""

    def __init__(self, exports: bool = True) -> None:
        self.calls: list[int] = []
        self.step = 0
        self.exports = exports

    def __call__(self, folder):
        self.calls.append(self.step)
        if not self.exports:
            return False
        folder.mkdir(parents=True)
        (folder / "weights.txt").write_text(str(self.step))
        return True


def observe_all(best: BestValidation, export: Exports, scores: dict[int, float]) -> list[dict]:
    logged = []
    for step, score in scores.items():
        export.step = step
        logged.append(best.observe(step, {"val/reward_mean": score, "val/reward_std": 0.5}))
    return logged


def test_the_best_is_logged_kept_and_said(tmp_path):
    export = Exports()
    best = BestValidation(tmp_path, export)
    logged = observe_all(best, export, {0: 0.2, 10: 0.5, 20: 0.4, 30: 0.5, 40: 0.3})
    assert [(m["val/best"], m["val/best_step"]) for m in logged] == [(0.2, 0), (0.5, 10), (0.5, 10), (0.5, 10), (0.5, 10)]
    assert export.calls == [0, 10]  # one export per new best; the tie at step 30 keeps step 10
    assert (tmp_path / BEST_DIR / "weights.txt").read_text() == "10"
    assert json.loads((tmp_path / BEST_DIR / MARKER).read_text()) == {"step": 10, "val/reward_mean": 0.5}
    assert not (tmp_path / (BEST_DIR + ".partial")).exists()
    assert best.summary() == (f"val/reward_mean: 0.3 at the last validation (step 40), best 0.5 at step 10; "
                              f"its weights: {tmp_path / BEST_DIR}")


def test_rows_without_a_validation_log_nothing_and_change_nothing(tmp_path):
    best = BestValidation(tmp_path, None)
    assert best.observe(1, {"actor/pg_loss": 0.1}) == {} and best.summary() is None
    assert best.observe(2, {"val/pair_accuracy": 0.75}) == {"val/best": 0.75, "val/best_step": 2.0}  # a reward model's
    assert best.observe(3, {"reward/score/mean": 0.9}) == {}
    assert best.summary().endswith("its weights were not kept (trainer.keep_best and trainer.export_hf keep them)")


def test_a_run_with_nothing_to_export_asks_once(tmp_path):
    export = Exports(exports=False)
    best = BestValidation(tmp_path, export)
    observe_all(best, export, {0: 0.1, 10: 0.2, 20: 0.3})
    assert export.calls == [0] and not (tmp_path / BEST_DIR).exists()
    assert best.metrics() == {"val/best": 0.3, "val/best_step": 20.0}


def test_resume_rebuilds_the_best_and_drops_a_later_steps_weights(tmp_path):
    export = Exports()
    first = BestValidation(tmp_path, export)
    observe_all(first, export, {0: 0.2, 10: 0.4, 20: 0.6})  # hf_best: step 20
    rows = [{"step": 0, "val/reward_mean": 0.2}, {"step": 5, "actor/pg_loss": 1.0}, {"step": 10, "val/reward_mean": 0.4}]
    resumed = BestValidation(tmp_path, export)
    resumed.resume(rows)  # the checkpoint is of step 10: step 20 runs again, its weights are not this record's
    assert resumed.metrics() == {"val/best": 0.4, "val/best_step": 10.0}
    assert not (tmp_path / BEST_DIR).exists()
    assert resumed.summary().endswith("its weights were not kept (trainer.keep_best and trainer.export_hf keep them)")
    export.step = 20
    assert resumed.observe(20, {"val/reward_mean": 0.3}) == {"val/best": 0.4, "val/best_step": 10.0}
    assert export.calls == [0, 10, 20]  # no new best: nothing exported

    kept = BestValidation(tmp_path / "b", export)
    observe_all(kept, export, {0: 0.2, 10: 0.4})
    again = BestValidation(tmp_path / "b", export)
    again.resume(rows)  # hf_best is of step 10, the record's best: kept
    assert (tmp_path / "b" / BEST_DIR / "weights.txt").read_text() == "10"
    assert again.summary().endswith(f"its weights: {tmp_path / 'b' / BEST_DIR}")

    fresh = BestValidation(tmp_path / "b", export)
    fresh.resume([])  # a fresh run in a folder an earlier run's hf_best was left in
    assert not (tmp_path / "b" / BEST_DIR).exists() and fresh.summary() is None
