"""Where reward calls run, and why (the manager's module docstring says when each is used).

A reward function is user code; the failure that matters is one that never returns (a catastrophic
regex, a symbolic simplification that explodes). A thread cannot be stopped, and a regex that never
releases the GIL would even starve the thread that waits for it. So ``run_forked`` forks worker
processes (``fork``: they inherit the prepared calls, lambdas and functions loaded from files
included, so nothing is pickled but call indices and scores), hands them one call at a time (one row,
or one TRL-style batch), and kills them when it returns. A call running longer than ``timeout_s``
(measured from the moment it is handed out) kills the workers and raises ``RewardError`` at once.
``run_in_process`` runs the calls one after another in a daemon thread that it waits on with the same
per-call ``timeout_s``: a function that sleeps, waits or loops in Python fails (naming the row)
instead of hanging the run, but the thread cannot be killed (it is abandoned) and a C call that never
releases the GIL still blocks the waiting thread too.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from typing import Any

from rlcore.rewards.calls import BadRow, Call, RowResult


class RewardError(RuntimeError):
    """A reward function failed on one row: raised, hung past the timeout, or returned a non-number.

    ``index`` is the row's position in the batch given to the manager (or to the worker group); for a
    TRL-style call that failed as a whole, its first row.
    """

    def __init__(self, message: str, index: int, data_source: Any, response: str) -> None:
        super().__init__(message)
        self.index, self.data_source, self.response = index, data_source, response


# fail(call, what happened, position among the call's rows or None, detail) -> the error to raise
Fail = Callable[[Call, str, "int | None", str], RewardError]


def _failure(call: Call, exc: BaseException, fail: Fail, detail: str = "") -> RewardError:
    if isinstance(exc, BadRow):
        return fail(call, exc.message, exc.position, detail)
    return fail(call, f"raised {type(exc).__name__}: {exc}", None, detail)


def run_in_process(calls: Sequence[Call], timeout_s: float, fail: Fail) -> list[list[RowResult]]:
    """The calls one after another in a daemon thread; a call past ``timeout_s`` fails them all."""
    results: queue.Queue = queue.Queue()

    def work() -> None:
        for call in calls:
            try:
                results.put((True, call.run()))
            except Exception as exc:
                results.put((False, exc))
                return

    threading.Thread(target=work, name="reward-scoring", daemon=True).start()
    out = []
    for call in calls:
        try:
            ok, value = results.get(timeout=timeout_s)  # the thread starts call i as call i-1 lands
        except queue.Empty:
            raise fail(call, f"did not return within timeout_s={timeout_s:g}s (num_workers=0: its thread is "
                             "abandoned; num_workers >= 1 kills hung calls)", None, "") from None
        if not ok:
            raise _failure(call, value, fail) from value
        out.append(value)
    return out


def run_forked(calls: Sequence[Call], timeout_s: float, num_workers: int, fail: Fail) -> list[list[RowResult]]:
    """Forked workers, one call at a time each; a call past its deadline kills them all."""
    context = multiprocessing.get_context("fork")
    out: list[list[RowResult]] = [[] for _ in calls]
    todo = iter(range(len(calls)))
    workers: dict[Connection, multiprocessing.Process] = {}
    busy: dict[Connection, tuple[int, float]] = {}  # connection -> (call, deadline)

    def hand_out(conn: Connection) -> None:
        i = next(todo, None)
        if i is not None:
            conn.send(i)
            busy[conn] = (i, time.monotonic() + timeout_s)

    try:
        for _ in range(min(num_workers, len(calls))):
            conn, child_conn = context.Pipe()
            process = context.Process(target=_serve, args=(child_conn, calls), daemon=True)
            process.start()
            child_conn.close()
            workers[conn] = process
            hand_out(conn)
        while busy:
            earliest = min(deadline for _, deadline in busy.values())
            ready = wait_for_connections(list(busy), timeout=max(0.0, earliest - time.monotonic()))
            if not ready:
                now = time.monotonic()
                for i, deadline in busy.values():
                    if deadline <= now:
                        raise fail(calls[i], f"did not return within timeout_s={timeout_s:g}s "
                                             "(its worker process was killed)", None, "")
                continue
            for conn in ready:
                i, _ = busy.pop(conn)
                try:
                    ok, payload = conn.recv()
                except EOFError:
                    workers[conn].join(timeout=5)
                    raise fail(calls[i], f"ended its worker process (exit code {workers[conn].exitcode})",
                               None, "") from None
                if not ok:
                    exc_bytes, summary, remote_tb = payload
                    exc = _unpickled(exc_bytes)
                    detail = f"\nremote traceback:\n{remote_tb}"
                    if isinstance(exc, BadRow):
                        raise _failure(calls[i], exc, fail, detail) from None
                    raise fail(calls[i], f"raised {summary}", None, detail) from exc
                out[i] = payload
                hand_out(conn)
    finally:
        for conn, process in workers.items():
            process.kill()  # idle ones wait in recv(); a hung one must go anyway
            process.join()
            conn.close()
    return out


def _serve(conn: Connection, calls: Sequence[Call]) -> None:
    """Worker process loop: receive a call index, reply (True, row results) or (False, failure)."""
    while True:
        try:
            i = conn.recv()
        except EOFError:
            return
        try:
            reply = (True, calls[i].run())
        except Exception as exc:
            try:
                exc_bytes = pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - an unpicklable exception still travels as text
                exc_bytes = None
            reply = (False, (exc_bytes, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        conn.send(reply)


def _unpickled(exc_bytes: bytes | None) -> BaseException | None:
    """The worker's original exception, when it survives a pickle round trip (custom __init__s may not)."""
    if exc_bytes is None:
        return None
    try:
        exc = pickle.loads(exc_bytes)
    except Exception:  # noqa: BLE001 - the message already carries its type, text and traceback
        return None
    return exc if isinstance(exc, BaseException) else None
