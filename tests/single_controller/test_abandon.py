"""rlcore.single_controller.abandon: a worker process told to abandon (SIGUSR2, as the driver sends it) stops the
abandonable call its main thread is in, has its workers drop their engine requests, refuses later abandonable
calls, and leaves other methods (updates, saves) alone."""

import os
import signal

import pytest

from rlcore.single_controller import abandon
from rlcore.single_controller.abandon import AbandonedCallError, run_abandonable


class Rollout:
    def __init__(self):
        self.dropped = 0

    def abandon(self):
        self.dropped += 1


@pytest.fixture
def worker_process():
    before = signal.getsignal(abandon.ABANDON_SIGNAL)
    assert abandon.install_worker_handler()
    yield
    signal.signal(abandon.ABANDON_SIGNAL, before)
    abandon.reset()


def test_the_signal_stops_the_call_under_way_and_refuses_the_next(worker_process):
    workers = {"rollout": Rollout()}
    reached = []

    def generate():
        reached.append("before")
        os.kill(os.getpid(), abandon.ABANDON_SIGNAL)  # its handler raises at the next bytecode
        reached.append("after")  # never reached

    with pytest.raises(AbandonedCallError, match="generate_sequences abandoned"):
        run_abandonable("generate_sequences", generate, workers)
    assert reached == ["before"] and workers["rollout"].dropped == 1
    with pytest.raises(AbandonedCallError, match="compute_log_prob not started"):
        run_abandonable("compute_log_prob", lambda: reached.append("log-probs"), workers)
    assert run_abandonable("save_checkpoint", lambda: "saved", workers) == "saved"  # never abandoned
    assert reached == ["before"]
    abandon.reset()
    assert run_abandonable("compute_log_prob", lambda: "fresh", workers) == "fresh"


def test_a_signal_outside_an_abandonable_call_only_marks_the_process(worker_process):
    def update():
        os.kill(os.getpid(), abandon.ABANDON_SIGNAL)
        return "updated"  # an update always finishes

    assert run_abandonable("update_policy", update, {}) == "updated"
    assert abandon.requested()


def test_the_driver_signals_only_ranks_with_a_handler_in_a_process_of_their_own():
    class Group:
        worker_info = [{"rank": 0, "pid": os.getpid(), "node_ip": "127.0.0.1", "abandon_handler": True},  # itself
                       {"rank": 1, "pid": 1, "node_ip": "127.0.0.1", "abandon_handler": False},
                       {"rank": 2, "pid": 12345, "node_ip": "10.9.9.9", "abandon_handler": True}]

    assert abandon.signal_workers([Group()]) == ["rank 2 runs on 10.9.9.9: its calls finish"]


def test_a_sharded_forward_under_way_finishes_its_collectives_and_the_next_is_refused(worker_process):
    def forward():
        os.kill(os.getpid(), abandon.ABANDON_SIGNAL)
        return "log-probs"  # other ranks may be waiting in this forward's all-gathers: it is not cut

    assert run_abandonable("compute_log_prob", forward, {}) == "log-probs"
    with pytest.raises(AbandonedCallError, match="compute_ref_log_prob not started"):
        run_abandonable("compute_ref_log_prob", forward, {})
