"""Abandoning the calls of a step that a stop signal will not let finish (generation, scoring, log-probs).

Why: a scheduler's grace period after SIGTERM is ~30 s, and one generation of a real model can take
longer than that. The trainer (``rlcore.trainer.stop_signal``) therefore gives up a step that has not
yet changed any state: its workers stop what they are computing for it, and the step before it is
saved instead. Calls that read state are abandoned (``ABANDONABLE_METHODS``); so is an update
(``UPDATE_METHODS``) until its first optimizer step, when the driver permits it for that call (below);
a weight sync or a save always finishes.

How a worker stops mid-call. Its process marks itself abandoning (``request_abandon``): a flag, and,
when its main thread is inside a generation right now (``INTERRUPTIBLE_METHODS``), ``StepAbandoned``
raised there by the signal handler, so a generation stops after the engine step (or forward) under way, whatever engine
runs it (HF ``generate``, the in-process vLLM offline engine, a wait on an async engine's loop).
``WorkerHost.execute`` turns that into ``AbandonedCallError`` (an ordinary exception, which Ray and the
local group return to the driver like any worker error) after asking the worker to drop the engine's
unfinished requests (``Worker.abandon``). Every abandonable call made later in that process fails at
once: the process is about to be saved and shut down.

- A rank in its own process (a Ray actor) gets there by ``ABANDON_SIGNAL`` (SIGUSR2), which the driver
  sends to every rank of every live group on its machine (``signal_workers``), the same way it asks
  them for their stacks (``rlcore.single_controller.inflight``). Ranks on other machines cannot be
  signalled from here: their calls finish and the driver then stops at the next phase boundary.
- Ranks in the driver's process (the local group) are abandoned by the driver's own signal handler
  calling ``request_abandon()``.

Updates. Gradients accumulate over an update's micro-batches and nothing in the weights, the optimizer
or the LR schedule changes before its first ``optimizer.step``, so until then the update can be given
up: the worker's loop reads ``update_stop_requested()`` at each micro-batch boundary, drops the
accumulated gradients and raises ``AbandonedCallError`` (``rlcore.workers.update_stop``); after that
step it no longer asks, and the update finishes. Only the first update of a step may be given up (a
later one follows an update that changed state: PPO's actor update after the critic's), and a worker
cannot tell which one a call is (its abandon flag may have been set during the earlier one). So the
driver says, per call: ``permit_update(True)`` while the step is still abandonable; the group call
hands that to every rank as the keyword ``PERMIT_KWARG``, which ``WorkerHost.execute`` takes out
before calling the method. Without it (an older caller, a raw Ray call) an update always finishes.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

ABANDON_SIGNAL = getattr(signal, "SIGUSR2", None)

# Worker methods that only read state (weights, optimizer, RNG streams of the run are left as they were):
# giving one up leaves nothing to undo.
ABANDONABLE_METHODS = frozenset({
    "generate_sequences", "generate_episodes", "compute_log_prob", "compute_ref_log_prob", "compute_values",
    "compute_rm_score", "compute_reward",
})
# Of those, the ones stopped mid-call: generation, which runs on each rank's own engine copy. The others
# are forwards of a sharded model whose ranks meet in collectives (FSDP's all-gathers): a rank leaving one
# midway would leave the others waiting in it, so they finish (seconds) and only a call not yet started
# is refused.
INTERRUPTIBLE_METHODS = frozenset({"generate_sequences", "generate_episodes"})
# Updates: abandoned only between micro-batches, before their first optimizer step, when permitted (above).
UPDATE_METHODS = frozenset({"update_policy", "update_critic", "update_rm", "train_sft"})
PERMIT_KWARG = "_rlcore_update_abandonable"


class StepAbandoned(BaseException):  # noqa: N818 - raised by a signal handler: passes ``except Exception``
    """Raised in the thread running an abandonable call when its process is asked to abandon it."""


class AbandonedCallError(RuntimeError):
    """What a worker returns for a call it abandoned (or refused because its process is abandoning)."""


_requested = threading.Event()
_inside = 0  # abandonable calls the main thread is inside now (nested: a colocated role calling another)
_main = threading.main_thread()
_permitted = False  # driver side: whether an update called now may be abandoned (``permit_update``)
_update_open = False  # worker side: this process is inside an update it was permitted to abandon


def requested() -> bool:
    return _requested.is_set()


def request_abandon() -> None:
    """Mark this process abandoning; raise ``StepAbandoned`` when called in the main thread inside an
    abandonable call (i.e. from a signal handler that interrupted it)."""
    _requested.set()
    if _inside and threading.current_thread() is _main:
        raise StepAbandoned()


def reset() -> None:
    """Forget a request (the driver's process, when its run closes: a later run in it starts clean)."""
    global _permitted
    _requested.clear()
    _permitted = False


def permit_update(allowed: bool) -> None:
    """Driver side: whether the updates called from now on may be abandoned (the trainer sets it at each
    stage of a step: true only for the step's first update, while the step changed nothing yet)."""
    global _permitted
    _permitted = bool(allowed)


def update_permitted() -> bool:
    return _permitted


def update_open() -> bool:
    """Worker side: whether this process is inside an update it was permitted to abandon."""
    return _update_open


def update_stop_requested() -> bool:
    """Worker side, at an update's micro-batch boundary: whether this process is asked to abandon and the
    update under way was permitted to be (a flag read)."""
    return _update_open and _requested.is_set()


def run_abandonable(method: str, call: Any, workers: dict[str, Any], permit: bool = False) -> Any:
    """``call()``, abandonable when ``method`` is in ``ABANDONABLE_METHODS``, or in ``UPDATE_METHODS`` with
    ``permit`` (``WorkerHost.execute``)."""
    global _inside, _update_open
    if method in UPDATE_METHODS and permit:
        # Asked already or not, it starts: its ranks decide together at its first micro-batch boundary (a
        # rank refusing here while another, asked a moment later, went in would leave that one waiting in
        # the update's first collective).
        _update_open = True
        try:
            return call()  # raises AbandonedCallError itself at a micro-batch boundary (rlcore.workers.update_stop)
        finally:
            _update_open = False
    if method not in ABANDONABLE_METHODS:
        return call()
    if _requested.is_set():
        raise AbandonedCallError(f"{method} not started: this worker's run is stopping")
    in_main = threading.current_thread() is _main and method in INTERRUPTIBLE_METHODS
    try:
        try:
            if in_main:
                _inside += 1
            try:
                return call()
            finally:
                if in_main:
                    _inside -= 1
        except StepAbandoned:
            for worker in workers.values():
                drop = getattr(worker, "abandon", None)
                if drop is not None:
                    drop()
            raise AbandonedCallError(f"{method} abandoned: this worker's run is stopping") from None
    except StepAbandoned:  # the signal landed between the call's end and the bookkeeping: abandoned all the same
        raise AbandonedCallError(f"{method} abandoned: this worker's run is stopping") from None


def _handle(signum: int, frame: Any) -> None:
    request_abandon()


def install_worker_handler() -> bool:
    """In a rank's own process: abandon on ``ABANDON_SIGNAL``. False where it cannot be installed (no
    such signal, or not the main thread)."""
    if ABANDON_SIGNAL is None or threading.current_thread() is not _main:
        return False
    signal.signal(ABANDON_SIGNAL, _handle)
    return True


def signal_workers(groups: list[Any], here: str = "127.0.0.1") -> list[str]:
    """Send ``ABANDON_SIGNAL`` to every rank of ``groups`` that lives in a process of its own on this
    machine (``here``: its address as the ranks report theirs, ``worker.node_ip``) and installed the
    handler; returns a line for each rank that could not be reached."""
    me, missed = os.getpid(), []
    for group in groups:
        for info in list(getattr(group, "worker_info", []) or []):
            pid = info.get("pid")
            if not info.get("abandon_handler") or pid in (None, me):
                continue
            if info.get("node_ip") != here:
                missed.append(f"rank {info.get('rank')} runs on {info.get('node_ip')}: its calls finish")
                continue
            try:
                os.kill(pid, ABANDON_SIGNAL)
            except OSError as exc:
                missed.append(f"rank {info.get('rank')} (pid {pid}): {exc}")
    return missed
