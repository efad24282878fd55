"""SIGTERM / SIGINT during training: save the last finished step within a grace period, exit with the signal's code.

``timeout``, batch schedulers (SLURM, Kubernetes) and ctrl-C stop a run with SIGTERM or SIGINT,
usually with a grace period (~30 s) before SIGKILL. Python's defaults (and Ray's driver handler, which
calls ``sys.exit``) end the run wherever it is, leaving no model when checkpoints are off. While a
``TrainingRun`` is open, ``StopSignals`` replaces those handlers. What the first signal does depends
on where the step is:

- before the step changed any state (generating, scoring, computing log-probs: the step's
  *abandonable* part, ``TrainingRun`` tracks it), the step is given up: the workers abandon the calls
  they are running for it (``rlcore.single_controller.abandon``: a generation stops after its current
  engine step), the run checkpoints the step before it (its loader position, RNG and controller
  states as they were when this step began) and exits. A resumed run redoes the abandoned step
  exactly: same prompts, same sampling seeds;
- during the step's first update (``UPDATE_STAGES``), likewise while that update has not made its
  first optimizer step: the workers drop the gradients accumulated so far and the step is given up
  (``rlcore.workers.update_stop``; GRPO's default, one optimizer step per batch, is abandonable over its
  whole update). An update past that step ignores the request and finishes; so does the step;
- once the state has changed (an optimizer step, a weight sync, logging: seconds), the step finishes
  and is saved.

Either way the process exits with ``128 + signum`` (143 for SIGTERM, 130 for SIGINT, as a shell
reports a process killed by them). A second signal exits at once; the checkpoint being written then
has no marker file and is never resumed from (``rlcore.trainer.run_checkpoint``). The previous
handlers come back when the run closes.

Only the main thread can install handlers; elsewhere (a run driven from a thread) nothing changes.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rlcore.single_controller import abandon
from rlcore.single_controller.abandon import AbandonedCallError, StepAbandoned, signal_workers
from rlcore.single_controller.inflight import in_flight_calls, live_groups
from rlcore.single_controller.worker import node_ip

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The recipes' timed stages (``run.timer``) that only read state: a step whose stages so far were all of
# these can be given up and redone. ``adv`` changes only the batch and the driver's registered ``state``
# (a KL controller), which an abandoned step's checkpoint takes from when the step began. The first other
# stage (an update past its first optimizer step, sync_weights) ends that part.
ABANDONABLE_STAGES = frozenset({"gen", "gen_greedy", "reward", "old_log_prob", "ref", "values", "adv"})
# Stages whose update may still be given up when it is the step's first (until its first optimizer step).
UPDATE_STAGES = frozenset({"update_actor", "update_critic", "update_rm"})
DRAIN_TIMEOUT_S = 15.0  # how long the abandoned calls may take to end (an engine step, a forward) before saving


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
    """``abandonable()``: whether the step under way can still be given up (see the module's docstring);
    ``on_abandon()``: asks the workers to abandon their calls, before this process abandons its own."""

    def __init__(self, abandonable: Callable[[], bool] = lambda: False,
                 on_abandon: Callable[[], None] = lambda: None, what: Callable[[], str] = lambda: "generation") -> None:
        self.signum: int | None = None
        self.abandoning = False  # the step under way is being given up
        self.asked = False  # the workers were asked to abandon (their later abandonable calls are refused)
        self.missed: list[str] = []  # ranks the abandon signal could not reach
        self.received_at = 0.0  # time.monotonic() of the first signal
        self._abandonable, self._on_abandon, self._what = abandonable, on_abandon, what
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
        abandon.reset()  # this process may host workers (the local group): a later run starts clean

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def exit_code(self) -> int:
        return 128 + int(self.signum)

    def since(self) -> str:
        return f"{time.monotonic() - self.received_at:.1f}s after the signal"

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:  # the second one: stop now, whatever is running
            print(f"\n{name} again: exiting now without saving", file=sys.stderr, flush=True)
            raise RunStopped(128 + signum)
        self.signum, self.received_at = signum, time.monotonic()
        if not self._abandonable():
            print(f"\n{name} received: finishing the current step, saving a checkpoint of it, then exiting "
                  f"(send {name} again to exit at once without saving)", file=sys.stderr, flush=True)
            return
        self.abandoning = self.asked = True
        print(f"\n{name} received: abandoning the current step's {self._what()}, saving a checkpoint of the step "
              f"before it, then exiting (send {name} again to exit at once without saving)", file=sys.stderr,
              flush=True)
        self._on_abandon()
        abandon.request_abandon()  # raises StepAbandoned when this thread is inside an in-process worker's call


def abandon_workers() -> list[str]:
    """Ask every rank of every live worker group in a process of its own on this machine to abandon its
    calls (``rlcore.single_controller.abandon``); the lines name the ranks that could not be asked."""
    return signal_workers(live_groups(), node_ip())


def drain_calls(timeout_s: float = DRAIN_TIMEOUT_S) -> list[str]:
    """Wait (at most ``timeout_s``) until no rank is still running a group call, however the calls end
    (abandoned ones end with an error), so that the workers are free to save. Returns the calls still
    running then, as ``group.method``."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [f"{call.group}.{call.method}" for _, call in in_flight_calls() if call.pending]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.05)


def abandoned_call(error: BaseException) -> bool:
    """Whether ``error`` is a worker's reply that it abandoned its call (the worker group's error wraps it:
    as its cause in-process, in its text from Ray)."""
    seen = error
    while seen is not None:
        if isinstance(seen, AbandonedCallError):
            return True
        seen = seen.__cause__
    return "AbandonedCallError" in str(error)
