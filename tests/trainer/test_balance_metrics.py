"""TrainingRun logs, per trained role, max / min tokens per DP rank of its last balanced call."""

from types import SimpleNamespace

from rlcore.trainer.loop import TrainingRun


def test_balance_metrics_are_max_over_min_and_read_once():
    actor = SimpleNamespace(last_balance={"tokens_max_before": 41, "tokens_min_before": 15,
                                          "tokens_max_after": 28, "tokens_min_after": 28})
    critic = SimpleNamespace(last_balance=None)  # one rank, or no balanced call this step
    run = object.__new__(TrainingRun)
    run.workers = SimpleNamespace(trained={"actor": actor, "critic": critic})
    assert run.balance_metrics() == {"balance/actor/tokens_max_min_before": 41 / 15,
                                     "balance/actor/tokens_max_min_after": 1.0}
    assert actor.last_balance is None and run.balance_metrics() == {}  # a later step without an update logs none
