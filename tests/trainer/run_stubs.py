"""Stand-ins for what a TrainingRun is built with, for tests of its bookkeeping alone."""


class EmptyLoader:
    """A prompt loader with no batches and no state: the run's steps never ask it for one."""

    def __iter__(self):
        return iter(())

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass
