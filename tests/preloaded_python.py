"""``python -m MODULE ARGS`` without paying the interpreter's imports each time: one Python process imports
the heavy libraries once (torch, transformers, Ray, Hydra, rlcore; ~6 s of CPU each time a fresh interpreter
does it) and runs each command in a child forked from it, so every command still gets a process of its own
(its own globals, Ray driver, torch settings, exit status; nothing it changes reaches the next one), started
with those modules already in ``sys.modules``. Nothing of vLLM is imported up front (it changes torch's
process-wide settings on import); commands that import it do so themselves, as on the command line.
The one difference from a fresh interpreter: what the preloaded libraries read from the environment when
imported comes from the server's environment (the test session's), not the command's; Ray's cached config
(token authentication) is read again from the command's. Give it commands whose environment differs only in
what is read later (PYTHONPATH, RAY_ADDRESS, a test hook's variable), not, e.g., HF_HOME or HF_ENDPOINT.

Used by tests whose point is what a command does, not how an interpreter starts (the benchmarks' quick modes);
tests of the command line itself (error output, exit codes, a hook in the command's own ``sitecustomize``) keep
``subprocess``. A hook in the ``sitecustomize`` of the processes a command starts (Ray's workers, which get the
command's PYTHONPATH) works here too: those are fresh interpreters (tests/trainer/hooked_runs.py).

Run as a script it is the server: one JSON job a line on stdin, one JSON reply a line on stdout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PRELOAD = ["numpy", "torch", "transformers", "ray", "hydra", "omegaconf", "hydra.compose", "recipes.grpo",
           "recipes.ppo", "rlcore.workers", "rlcore.trainer.loop", "rlcore.engines.server", "rlcore.models"]
HERE = Path(__file__).resolve().parent


def run_job(job: dict) -> None:
    """The child's side: become ``python -m job['module'] *job['args']`` (or ``python -c job['code']``, or
    ``python job['script']``) in ``job['cwd']`` with ``job['env']``."""
    import atexit
    import runpy
    import traceback

    os.setsid()  # a group of its own: a timeout kills what it started too
    if job.get("pid_file"):  # where a test looks for the command's pid (to signal it)
        Path(job["pid_file"]).write_text(str(os.getpid()))
    os.chdir(job["cwd"])
    stdin = os.open(os.devnull, os.O_RDONLY)  # not the job pipe
    os.dup2(stdin, 0)
    os.close(stdin)
    os.environ.clear()
    os.environ.update(job["env"])
    if "ray" in sys.modules:  # Ray caches its config (token authentication, ...) from the environment it imported in
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    given = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    first = str(Path(job["script"]).resolve().parent) if job.get("script") else job["cwd"]
    sys.path[:] = [first, *given, *[p for p in sys.path[1:] if p not in given and p != str(HERE)]]
    code = 0
    try:
        if job.get("script"):
            sys.argv = [job["script"], *job["args"]]
            runpy.run_path(job["script"], run_name="__main__")
        elif job.get("code") is not None:
            sys.argv = ["-c", *job["args"]]
            exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = [job["module"], *job["args"]]
            sys.modules.pop(job["module"], None)  # as under -m: only its package is imported first
            runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # what the interpreter makes of it
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught exception: the traceback and exit status 1, as python prints it
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what an import prints later never mixes with the replies
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                run_job(job)
            finally:
                os._exit(70)
        deadline = time.monotonic() + job["timeout"]
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = None
                break
            time.sleep(0.05)
        reply = {"timed_out": True} if status is None else {
            "returncode": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    os._exit(0)  # no interpreter teardown of everything preloaded: nothing is left to flush


class PreloadedPython:
    """The client: ``run(module, args, ...)`` answers like ``subprocess.run([sys.executable, "-m", module, *args],
    capture_output=True, text=True)``."""

    def __init__(self, workdir: Path, start_timeout_s: float = 600.0):
        self.workdir = Path(workdir)
        self.count = 0
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=HERE.parent, env=env)
        self._reply(start_timeout_s)

    def _reply(self, timeout_s: float) -> dict:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                self.close()
                raise TimeoutError(f"the preloaded interpreter did not answer within {timeout_s:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the preloaded interpreter exited (status {self.proc.wait()})")
        return json.loads(line)

    def run(self, module: str | None, *args: str, cwd: Path | str, env: dict | None = None, code: str | None = None,
            script: Path | str | None = None, timeout: float = 600.0,
            pid_file: Path | str | None = None) -> subprocess.CompletedProcess:
        """``python -m module *args``; with ``module=None``, ``python -c code *args`` or ``python script *args``.
        ``pid_file``: the command's process writes its pid there before anything else."""
        self.count += 1
        out, err = self.workdir / f"{self.count}.out", self.workdir / f"{self.count}.err"
        job = {"module": module, "code": code, "script": str(script) if script else None, "args": list(args),
               "cwd": str(cwd), "env": dict(os.environ if env is None else env), "stdout": str(out), "stderr": str(err),
               "timeout": timeout, "pid_file": str(pid_file) if pid_file else None}
        module = module or ("-c" if code is not None else str(script))
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout + 60)
        if reply.get("timed_out"):
            raise subprocess.TimeoutExpired([module, *args], timeout, out.read_text(), err.read_text())
        self.last_cpu_s = reply["cpu_s"]  # the command's user + system CPU seconds (its own and its waited children's)
        return subprocess.CompletedProcess([module, *args], reply["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    serve()
