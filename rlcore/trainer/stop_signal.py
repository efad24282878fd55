"""SIGTERM / SIGINT during training: finish the step, save it, exit with the signal's code.

``timeout``, batch schedulers (SLURM, Kubernetes) and ctrl-C stop a run with SIGTERM or SIGINT,
usually with a grace period before SIGKILL. Python's defaults (and Ray's driver handler, which calls
``sys.exit``) end the run wherever it is, leaving no model when checkpoints are off. While a
``TrainingRun`` is open, ``StopSignals`` replaces those handlers: the first signal only records
itself and prints what will happen; the run checks it at step boundaries (``TrainingRun.end_step``),
checkpoints the step that just finished and exits with ``128 + signum`` (143 for SIGTERM, 130 for
SIGINT, as a shell reports a process killed by them). A second signal exits at once. The previous
handlers come back when the run closes.

Only the main thread can install handlers; elsewhere (a run driven from a thread) nothing changes.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(SystemExit):
    """Raised at a step boundary after a stop signal: exits the process with ``128 + signum``."""


def exit_during_startup() -> None:
    """Before a run's loop exists (its workers starting), SIGTERM / SIGINT end the process at once with
    128 + signum and a message, replacing Ray's driver handler (``sys.exit(signum)``: exit code 15,
    read as an ordinary failure). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum: int, frame: Any) -> None:
        print(f"\n{signal.Signals(signum).name} during start-up: exiting (nothing trained yet)", file=sys.stderr,
              flush=True)
        raise RunStopped(128 + signum)

    signal.signal(signal.SIGTERM, handle)


class StopSignals:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def exit_code(self) -> int:
        return 128 + int(self.signum)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:  # the second one: stop now, whatever is running
            print(f"\n{name} again: exiting now without saving", file=sys.stderr, flush=True)
            raise RunStopped(128 + signum)
        self.signum = signum
        print(f"\n{name} received: finishing the current step, saving a checkpoint of it, then exiting "
              f"(send {name} again to exit at once without saving)", file=sys.stderr, flush=True)
