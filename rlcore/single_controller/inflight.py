"""What every worker group is running right now, and the Python stacks of the ranks running it.

Why: a run that hangs says nothing by itself; the question at 3 a.m. is "which group, which rank,
which method, and where in it". Each group records its calls as they are made (a dict insert and a
pop under a lock per group call, nothing per rank or per row), and ``in_flight_calls()`` lists the
calls of every live group of this process with the ranks that have not finished. A watchdog (the
trainer's) asks only when a phase runs late, so the questions cost nothing on a healthy step.

Stacks. A rank in its own process (a Ray actor) registers ``faulthandler`` for ``SIGUSR1`` at start,
writing into a file of its own (``WorkerHost.build``); ``dump_stacks`` signals the rank's pid and
reads what it wrote. That works however the rank is stuck (sleeping, in a collective, in C code
holding the GIL released), since the dump runs in the signal handler, not in the busy thread. A
rank on another machine than the driver cannot be signalled from here: its entry says so. In-process
ranks run in a driver thread: their stacks come from ``sys._current_frames()``.
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any

STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # what a rank's faulthandler listens to (None: not on this OS)


@dataclass
class InFlightCall:
    """One group call the driver made and has not collected yet."""

    group: str  # the group's name (its role, or its worker class)
    method: str  # the group method (role-prefixed in a colocated group)
    ranks: list[int]  # the ranks it was sent to
    started: float  # time.monotonic() when it was made
    thread: int  # the driver thread that made it
    handles: Any = None  # what the group's _submit returned (Ray: object refs)
    pending: list[int] = field(default_factory=list)  # filled by in_flight_calls(): ranks not finished

    def age_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.started


class CallTracker:
    """The calls in flight of one group and of its per-role views (they share it)."""

    def __init__(self, group: Any) -> None:
        self._group = weakref.ref(group)
        self._calls: dict[int, InFlightCall] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        _TRACKERS.add(self)

    def begin(self, group: str, method: str, ranks: list[int]) -> int:
        call = InFlightCall(group, method, ranks, time.monotonic(), threading.get_ident())
        with self._lock:
            key = next(self._keys)
            self._calls[key] = call
        return key

    def attach(self, key: int, handles: Any) -> None:
        call = self._calls.get(key)
        if call is not None:
            call.handles = handles

    def end(self, key: int) -> None:
        with self._lock:
            self._calls.pop(key, None)

    def calls(self) -> list[InFlightCall]:
        with self._lock:
            return list(self._calls.values())

    @property
    def group(self) -> Any:
        return self._group()


_TRACKERS: "weakref.WeakSet[CallTracker]" = weakref.WeakSet()


def in_flight_calls() -> list[tuple[Any, InFlightCall]]:
    """``(group, call)`` for every call in flight in every live group of this process, oldest first,
    each call's ``pending`` set to the ranks still running it (empty: all ranks are done and the
    driver has not collected the results yet)."""
    out = []
    for tracker in list(_TRACKERS):
        group = tracker.group
        if group is None:
            continue
        for call in tracker.calls():
            try:
                call.pending = group._pending_ranks(call)
            except Exception:  # noqa: BLE001 - a group shutting down: report the call with all its ranks
                call.pending = list(call.ranks)
            out.append((group, call))
    return sorted(out, key=lambda pair: pair[1].started)


def live_groups() -> list[Any]:
    """Every live worker group of this process (each once, views sharing a tracker counted once)."""
    return [group for group in (tracker.group for tracker in list(_TRACKERS)) if group is not None]


# ------------------------------------------------------------------ stacks
def thread_stacks(idents: set[int] | None = None) -> str:
    """The Python stacks of this process's threads (those in ``idents``; None: all), most recent call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if idents is not None and ident not in idents:
            continue
        parts.append(f"Thread {ident:#x} ({names.get(ident, '?')}), most recent call last:\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts) if parts else "(no such thread is running)\n"


def register_stack_dump(path: str) -> Any:
    """In a rank's own process: dump every thread's stack into ``path`` on ``STACK_SIGNAL``. Returns the
    open file (keep it: faulthandler writes to its descriptor), or None where the OS has no such signal."""
    if STACK_SIGNAL is None:
        return None
    out = open(path, "w")  # noqa: SIM115 - held open for the process's life
    faulthandler.register(STACK_SIGNAL, file=out, all_threads=True, chain=False)
    return out


def signal_stacks(targets: dict[int, tuple[int, str]], timeout_s: float = 2.0) -> dict[int, str]:
    """Signal each rank's process (``rank -> (pid, stack file)``, on this machine) to dump its stacks,
    and return what each wrote within ``timeout_s``."""
    sizes, out = {}, {}
    for rank, (pid, path) in targets.items():
        try:
            sizes[rank] = os.path.getsize(path)
            os.kill(pid, STACK_SIGNAL)
        except (OSError, TypeError) as exc:
            out[rank] = f"(could not ask pid {pid} for its stacks: {exc})\n"
    deadline, last = time.monotonic() + timeout_s, {}
    while len(out) < len(targets) and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank, (_, path) in targets.items():
            if rank in out:
                continue
            try:
                size = os.path.getsize(path)
                if size > sizes[rank] and last.get(rank) == size:  # grew, and stopped growing
                    with open(path, errors="replace") as f:
                        f.seek(sizes[rank])
                        out[rank] = f.read()
                last[rank] = size
            except OSError as exc:
                out[rank] = f"(could not read the stacks of pid {targets[rank][0]} from {path}: {exc})\n"
    for rank, (pid, _) in targets.items():
        out.setdefault(rank, f"(pid {pid} wrote no stacks within {timeout_s:g}s)\n")
    return out
