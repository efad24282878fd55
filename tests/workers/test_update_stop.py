"""rlcore.workers.update_stop and the update side of rlcore.single_controller.abandon: an update is given up
only when the driver permitted it for that call, at a micro-batch boundary before its first optimizer step,
with its gradients dropped and the RNG streams as it found them; with several ranks, all of them leave at
the same boundary, whichever rank was asked."""

import multiprocessing
import os
import signal
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rlcore.single_controller import abandon
from rlcore.single_controller.abandon import AbandonedCallError, run_abandonable
from rlcore.workers.update_stop import UpdateStop


@pytest.fixture(autouse=True)
def clean_process():
    abandon.reset()
    yield
    abandon.reset()


def test_an_update_without_the_drivers_permission_never_stops():
    abandon.request_abandon()

    def update():
        assert not abandon.update_open() and not abandon.update_stop_requested()
        return "updated"

    assert run_abandonable("update_policy", update, {}) == "updated"
    assert run_abandonable("update_critic", update, {}, permit=False) == "updated"


def test_a_permitted_update_sees_a_request_made_during_it_or_before_it():
    seen = []

    def update():
        seen.append((abandon.update_open(), abandon.update_stop_requested()))
        abandon.request_abandon()  # as the signal handler does, mid-call: a flag only (no StepAbandoned in an update)
        seen.append((abandon.update_open(), abandon.update_stop_requested()))
        return "updated"

    assert run_abandonable("update_policy", update, {}, permit=True) == "updated"
    assert seen == [(True, False), (True, True)] and not abandon.update_open()
    seen.clear()
    # asked before it began: it starts all the same (its ranks decide together at its first boundary)
    assert run_abandonable("update_critic", update, {}, permit=True) == "updated"
    assert seen == [(True, True), (True, True)]
    assert run_abandonable("save_checkpoint", lambda: "saved", {}, permit=True) == "saved"  # never abandoned


def test_the_driver_permission_is_reset_with_the_run():
    abandon.permit_update(True)
    assert abandon.update_permitted()
    abandon.reset()
    assert not abandon.update_permitted()


def backward_once(module: nn.Module) -> None:
    module(torch.ones(2, 3)).sum().backward()


def test_the_update_leaves_at_the_next_boundary_with_no_gradients_and_the_rng_as_found():
    module = nn.Linear(3, 2)
    outcome = {}

    def update():
        torch.manual_seed(7)
        stop = UpdateStop(module, torch.device("cpu"))
        expected = torch.rand(3)  # what the next draw is when the update is given up
        torch.manual_seed(7)
        stop.check()  # not asked: goes on
        backward_once(module)
        torch.rand(5)  # a dropout's draw
        abandon.request_abandon()
        try:
            stop.check()
        except AbandonedCallError as exc:
            outcome.update(error=str(exc), grads=[p.grad for p in module.parameters()], draw=torch.rand(3),
                           expected=expected)
            raise

    with pytest.raises(AbandonedCallError, match="micro-batch boundary 2, before its first optimizer step"):
        run_abandonable("update_policy", update, {}, permit=True)
    assert outcome["grads"] == [None, None]
    assert torch.equal(outcome["draw"], outcome["expected"])


def test_after_the_first_optimizer_step_the_update_finishes_whatever_is_asked():
    module = nn.Linear(3, 2)

    def update():
        stop = UpdateStop(module, torch.device("cpu"))
        stop.check()
        backward_once(module)
        stop.check()
        stop.stepped()  # optimizer.step() happened
        abandon.request_abandon()
        backward_once(module)
        stop.check()
        return "finished"

    assert run_abandonable("update_policy", update, {}, permit=True) == "finished"


def _rank(rank: int, init: str, out) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        module = nn.Linear(3, 2)
        left = []

        def update():
            stop = UpdateStop(module, torch.device("cpu"))
            for boundary in range(1, 5):
                try:
                    stop.check()
                except AbandonedCallError:
                    left.append(boundary)
                    raise
                backward_once(module)
                dist.barrier()  # a collective per micro-batch, as FSDP's are: a rank leaving alone would hang it
                if rank == 0 and boundary == 2:
                    os.kill(os.getpid(), abandon.ABANDON_SIGNAL)  # only rank 0 is asked
            return "finished"

        abandon.install_worker_handler()
        try:
            run_abandonable("update_policy", update, {}, permit=True)
        except AbandonedCallError:
            pass
        out.put((rank, (left, abandon.requested(), [p.grad is None for p in module.parameters()])))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, traceback.format_exc()))


@pytest.mark.skipif(abandon.ABANDON_SIGNAL is None, reason="no SIGUSR2 here")
def test_two_ranks_leave_at_the_same_boundary_when_only_one_is_asked(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'pg'}"
    procs = [ctx.Process(target=_rank, args=(rank, init, out)) for rank in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)  # a rank left alone would hang in its barrier: no answer
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    for rank in (0, 1):
        assert not isinstance(results[rank], str), results[rank]
    # both leave at boundary 3, the first after rank 0's request; only rank 0's flag was set; no gradients kept
    assert results[0] == ([3], True, [True, True])
    assert results[1] == ([3], False, [True, True])
