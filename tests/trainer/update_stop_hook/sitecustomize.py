"""Test hook (tests/trainer/test_stop_update.py), active only where RLCORE_TEST_UPDATE_STOP_AT is set: in the
process of rank 0 (or no rank) whose actor runs the chosen update call, at the chosen micro-batch's loss, send the chosen signal to the
pid written in the chosen file (the driver), then wait until this process is told to abandon (the driver's
SIGUSR2 sets its flag), so the update sees the request at the next micro-batch boundary whatever the machine's
speed. The losses that call ran are written to <pid file>.json. Python imports ``sitecustomize`` at start-up
from the path: this folder is put first on PYTHONPATH of the run under test (Ray's workers inherit it)."""

import json
import os
import sys
import time

SPEC = os.environ.get("RLCORE_TEST_UPDATE_STOP_AT")  # "<pid file>,<signal number>,<update call>,<micro-batch>"


def patch(module) -> None:
    from rlcore.single_controller import abandon

    pid_file, signum, at_update, at_micro = SPEC.split(",")
    real, record = module.ActorWorker._loss, {"micros": 0}

    def loss(worker, micro, scale):
        if worker.update_calls == int(at_update) - 1 and os.environ.get("RANK", "0") == "0":  # one signal only
            record["micros"] += 1
            if record["micros"] == int(at_micro):
                with open(pid_file) as f:
                    os.kill(int(f.read()), int(signum))
                deadline = time.monotonic() + 120  # a bound on a hang
                while not abandon.requested() and time.monotonic() < deadline:
                    time.sleep(0.01)
                record["asked"] = abandon.requested()
            with open(pid_file + ".json", "w") as f:
                json.dump(record, f)
        return real(worker, micro, scale)

    module.ActorWorker._loss = loss


if SPEC:
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/trainer: patch_on_import
    from patch_on_import import install

    install("rlcore.workers.actor", patch)
