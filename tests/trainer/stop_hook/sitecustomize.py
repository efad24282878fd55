"""Test hook (tests/trainer/test_stop_abandon.py), active only where RLCORE_TEST_STOP_AT is set: in the process
whose vLLM engine runs the chosen generate call, at the chosen engine step, send the chosen signal to the pid
written in the chosen file (the driver), then block until this process is told to abandon the call (which
raises out of the sleep below). What happened is written to <pid file>.json. Python imports
``sitecustomize`` at start-up from the path: this folder is put first on PYTHONPATH of the run under test."""

import json
import os
import sys
import time

SPEC = os.environ.get("RLCORE_TEST_STOP_AT")  # "<pid file>,<signal number>,<generate call>,<engine step>"


def patch(module) -> None:
    pid_file, signum, at_call, at_step = SPEC.split(",")
    engine_cls, record = module.VLLMEngine, {"calls": 0}
    real_generate, real_abandon = engine_cls.generate, engine_cls.abandon

    def generate(self, *args, **kwargs):
        record["calls"] += 1
        if record["calls"] != int(at_call):
            return real_generate(self, *args, **kwargs)
        engine, real_step = self.llm.llm_engine, self.llm.llm_engine.step

        def step():
            record["engine_steps"] = record.get("engine_steps", 0) + 1
            if record["engine_steps"] == int(at_step):
                with open(pid_file) as f:
                    os.kill(int(f.read()), int(signum))
                deadline = time.monotonic() + 120  # a bound on a hang: the abandon signal raises in here
                while time.monotonic() < deadline:
                    time.sleep(0.01)
                record["never_abandoned"] = True
            return real_step()

        engine.step = step
        try:
            return real_generate(self, *args, **kwargs)
        finally:
            del engine.step
            with open(pid_file + ".json", "w") as f:
                json.dump(record, f)

    def abandon(self):
        record["unfinished_before_abort"] = self.llm.llm_engine.get_num_unfinished_requests()
        real_abandon(self)
        record["unfinished_after_abort"] = self.llm.llm_engine.get_num_unfinished_requests()
        with open(pid_file + ".json", "w") as f:
            json.dump(record, f)

    engine_cls.generate, engine_cls.abandon = generate, abandon


if SPEC:
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/trainer: patch_on_import
    from patch_on_import import install

    install("rlcore.engines.vllm_engine", patch)
