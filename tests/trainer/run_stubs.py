"""Stand-ins for what a TrainingRun is built with, for tests of its bookkeeping alone."""

from rlcore.trainer.builder import Workers
from rlcore.trainer.config import load_config
from rlcore.trainer.loop import TrainingRun


class EmptyLoader:
    """A prompt loader with no batches and no state: the run's steps never ask it for one."""

    def __iter__(self):
        return iter(())

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class NoGroup:
    def shutdown(self):
        pass


def bookkeeping_run(tmp_path, **trainer) -> TrainingRun:
    """A run of 10 steps with no workers and no data, logging to jsonl, validating and checkpointing never
    (but when stopped): what the stop-signal tests drive step by step."""
    cfg = load_config({"trainer": {"output_dir": str(tmp_path), "loggers": ["jsonl"], "val_freq": 0, "save_freq": 0,
                                   "total_steps": 10, **trainer}}, ["trainer"])
    return TrainingRun(cfg, Workers(group=NoGroup()), EmptyLoader(), validate=dict)
