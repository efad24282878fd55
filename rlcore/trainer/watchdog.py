"""The driver's stall watchdog: a phase that runs past its deadline says who is stuck, and where.

Why: a hung run (a collective one rank never joined, an engine that stopped answering, a reward
function in an endless loop) otherwise sits silent until someone notices hours later, and then
nobody knows which worker it was waiting for. Every ``with run.timer("gen")`` stage of a recipe
(and each training step as a whole, ``"step"``) is a phase with a deadline
(``trainer.watchdog``). One background thread sleeps until the earliest deadline of the phases
running now; a phase that ends before its deadline costs two lock round-trips (and a notify when
its deadline comes before the one the thread sleeps toward): no thread is made per phase.

When a phase runs late the watchdog
- logs one line naming the phase and step and, for every worker-group call still in flight, the
  group, the ranks still running it and the method (``rlcore.single_controller.in_flight_calls``);
- writes ``<run>/stalls/step_<N>_<phase>.txt``: that list, what the registered probes say (the
  rollout pool: its groups in flight and for how long), the Python stacks of every stuck rank's
  process and of the driver thread running the phase;
- with ``on_stall: warn`` goes on waiting, and reports again at 2x, 4x, ... the deadline
  (``..._2.txt``, ``..._3.txt``: two dumps show whether it moves); with ``on_stall: fail`` raises
  ``StallError`` naming phase, group, rank and method in the driver. The driver's main thread is
  interrupted by a signal (``SIGUSR2``) whose handler raises it, so a driver blocked waiting on a
  Ray call fails at the deadline; a phase run by another thread (or a main thread stuck in C code
  that never returns to Python) raises it when the phase ends.
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.single_controller.inflight import in_flight_calls, thread_stacks

logger = logging.getLogger(__name__)
INTERRUPT_SIGNAL = getattr(signal, "SIGUSR2", None)  # how the watchdog stops the main thread with on_stall=fail
STACK_TIMEOUT_S = 2.0  # how long to wait for a rank's process to write its stacks


class StallError(RuntimeError):
    """A phase ran past its deadline with ``trainer.watchdog.on_stall=fail``."""


@dataclass
class _Phase:
    name: str
    step: int
    started: float
    deadline_s: float
    thread: int
    reports: int = 0

    @property
    def next_report(self) -> float:  # at the deadline, then at 2x, 4x ... (warn mode)
        return self.started + self.deadline_s * (2 ** self.reports)


class Watchdog:
    """Watches phases (``phase(name)`` / ``begin``+``end``) against ``config``'s deadlines (a
    ``WatchdogConfig`` or a mapping with its keys), writing stall reports into ``stall_dir``."""

    def __init__(self, config: Any, stall_dir: Path) -> None:
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        self.enabled = bool(get("enable", True))
        self.default_s, self.on_stall = float(get("deadline_s", 1800.0)), get("on_stall", "warn")
        self.deadlines = {k: float(v) for k, v in dict(get("deadlines", None) or {}).items()}
        if self.on_stall not in ("warn", "fail"):
            raise ValueError(f"trainer.watchdog.on_stall must be 'warn' or 'fail', got {self.on_stall!r}")
        self.stall_dir = Path(stall_dir)
        self.step = 0  # the step the phases belong to (set by the run)
        self.reports: list[dict] = []  # every stall reported: phase, step, elapsed_s, file, stuck calls
        self.failure: StallError | None = None
        self._probes: dict[str, Callable[[], list[str]]] = {}
        self._active: dict[int, _Phase] = {}
        self._keys = itertools.count()
        self._cond = threading.Condition()
        self._wake_at = float("inf")  # when the thread will look next
        self._closed = False
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread().ident
        self._handler_installed, self._old_handler = False, None

    def deadline(self, name: str) -> float:
        """The phase's deadline in seconds (0: not watched)."""
        return self.deadlines.get(name, self.default_s)

    def add_probe(self, name: str, probe: Callable[[], list[str]]) -> None:
        """``probe()`` returns lines that explain what a stall waits for (e.g. the rollout pool's groups)."""
        self._probes[name] = probe

    # ------------------------------------------------------------------ phases
    def begin(self, name: str) -> int | None:
        deadline = self.deadline(name)
        if not self.enabled or deadline <= 0 or self._closed:
            return None
        phase = _Phase(name, self.step, time.monotonic(), deadline, threading.get_ident())
        with self._cond:
            if self._thread is None:
                self._start()
            key = next(self._keys)
            self._active[key] = phase
            if phase.next_report < self._wake_at:  # earlier than the thread's next look: wake it
                self._cond.notify()
        return key

    def end(self, key: int | None) -> None:
        if key is None:
            return
        with self._cond:
            self._active.pop(key, None)
        if self.failure is not None:
            raise self.failure

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        key = self.begin(name)
        try:
            yield
        finally:
            self.end(key)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._active.clear()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._handler_installed and threading.get_ident() == self._main:
            signal.signal(INTERRUPT_SIGNAL, self._old_handler if self._old_handler is not None else signal.SIG_DFL)
            self._handler_installed = False

    # ------------------------------------------------------------------ the thread
    def _start(self) -> None:
        if self.on_stall == "fail" and INTERRUPT_SIGNAL is not None and threading.get_ident() == self._main:
            self._old_handler = signal.signal(INTERRUPT_SIGNAL, self._interrupted)
            self._handler_installed = True
        self._thread = threading.Thread(target=self._watch, name="rlcore-watchdog", daemon=True)
        self._thread.start()

    def _interrupted(self, signum, frame) -> None:
        if self.failure is not None:
            raise self.failure

    def _watch(self) -> None:
        while True:
            with self._cond:
                if self._closed or self.failure is not None:
                    return
                now = time.monotonic()
                late = min(self._active.values(), key=lambda p: p.next_report, default=None)
                if late is None or late.next_report > now:
                    self._wake_at = float("inf") if late is None else late.next_report
                    self._cond.wait(None if late is None else late.next_report - now)
                    continue
                late.reports += 1
                self._wake_at = float("inf")
            try:
                self._report(late)
            except Exception:  # noqa: BLE001 - a report that fails must not kill the watchdog
                logger.exception("the watchdog could not write its stall report")

    def _report(self, phase: _Phase) -> None:
        elapsed = time.monotonic() - phase.started
        calls = in_flight_calls()  # every group's: a call made in an earlier phase or another thread may be the one
        stuck = [f"group {call.group} {_ranks(call.pending)} in {call.method} ({call.age_s():.1f}s)" if call.pending
                 else f"group {call.group} {call.method}: every rank finished, the driver has not collected it"
                 for _, call in calls]
        suffix = "" if phase.reports == 1 else f"_{phase.reports}"
        path = self.stall_dir / f"step_{phase.step}_{phase.name}{suffix}.txt"
        probed = {}
        for name, probe in self._probes.items():
            try:
                probed[name] = list(probe())
            except Exception as exc:  # noqa: BLE001 - a probe's failure is part of the report
                probed[name] = [f"the probe failed: {exc!r}"]
        what = "; ".join(stuck) if stuck else "no worker-group call in flight"
        # The probes' first lines (e.g. the rollout pool: how many groups, the oldest) belong in the one line too.
        what += "".join(f"; {name}: {' / '.join(lines[:2])}" for name, lines in probed.items() if lines)
        if not stuck and not probed:
            what += " (the driver itself is busy: see its stack)"
        line = (f"STALL: phase '{phase.name}' of step {phase.step} has run {elapsed:.1f}s (deadline "
                f"{phase.deadline_s:g}s): {what}; stacks in {path}")
        sections = [line, ""]
        for name, lines in probed.items():
            sections += [f"== {name}", *lines, ""]
        dumped = set()
        for group, call in calls:
            ranks = [r for r in call.pending if (id(group), r) not in dumped]
            dumped.update((id(group), r) for r in ranks)
            for rank, text in (group.dump_stacks(ranks, STACK_TIMEOUT_S) if ranks else {}).items():
                sections += [f"== group {call.group} rank {rank} ({call.method}, {call.age_s():.1f}s): Python stacks",
                             text, ""]
        others = {t.ident for t in threading.enumerate()} - {phase.thread, threading.get_ident()}
        sections += [f"== the driver thread running phase '{phase.name}'", thread_stacks({phase.thread}),
                     "== the driver's other threads", thread_stacks(others)]
        self.stall_dir.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(sections))
        logger.warning(line)
        self.reports.append({"phase": phase.name, "step": phase.step, "elapsed_s": elapsed, "file": str(path),
                             "stuck": stuck})
        if self.on_stall == "fail":
            self._fail(phase, elapsed, what, path)

    def _fail(self, phase: _Phase, elapsed: float, what: str, path: Path) -> None:
        self.failure = StallError(f"phase '{phase.name}' of step {phase.step} ran {elapsed:.1f}s, past its deadline "
                                  f"of {phase.deadline_s:g}s (trainer.watchdog.on_stall=fail): {what}. Stacks: {path}")
        if phase.thread == self._main and self._handler_installed:
            signal.pthread_kill(self._main, INTERRUPT_SIGNAL)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"
