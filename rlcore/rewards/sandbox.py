"""Run untrusted Python (a policy's answer) in a child process that cannot harm the trainer: the parent side.

Why a process with kernel limits and not a thread or ``exec``: the code is written by the policy being
trained, and RL finds whatever pays, loops, fork bombs and stray writes included. So each run gets
CPU time, address space, process count, file size and core limits (``setrlimit``), a wall clock
enforced from outside (the whole process group is killed), stdout/stderr capped in bytes while they
are read (a flood is killed, never buffered), a scrubbed environment, an isolated interpreter
(``python -I -S``) and one fresh directory as its working directory, HOME and TMPDIR.

This module prepares a run, starts the bootstrap ``rlcore.rewards.sandbox_child`` by its file path,
supervises it and says how it ended (``SandboxResult``). How network and filesystem are closed is
chosen once per process by a probe (``network_isolation()``): ``"namespace"`` where Linux user
namespaces work (the kernel isolates the run), else ``"guard"`` (a best-effort prelude in the child's
interpreter); sandbox_child describes both. Checking a program against tests is
``rlcore.rewards.code_checks``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.rewards import sandbox_child
from rlcore.rewards.sandbox_child import (
    FRESH_UID_BASE,
    MESSAGE_PREFIX,
    NETWORK_REFUSED,
    PROCESS_REFUSED,
    SETUP_FAILED,
    SETUP_FAILED_MESSAGE,
    WRITE_REFUSED,
    Spec,
)

_CHILD = os.path.abspath(sandbox_child.__file__)  # the bootstrap, run by path: it may not import rlcore
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use; a run that hits any of them scores 0 in the code reward."""

    cpu_s: float = 2.0  # CPU seconds of each process (RLIMIT_CPU, rounded up to whole seconds)
    wall_s: float = 6.0  # seconds from start to kill, measured by the parent (generous: busy cores stretch it)
    memory_mb: int = 512  # address space of each process (RLIMIT_AS)
    output_bytes: int = 65536  # bytes kept of stdout and of stderr; one more byte kills the run
    max_processes: int = 8  # processes (threads included) the program may have at once, itself counted
    file_size_mb: int = 8  # largest file (RLIMIT_FSIZE); also the size of the namespace mode's tmpfs

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SandboxLimits.{f.name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended. ``violation`` names what stopped or refused it (None: nothing did)."""

    returncode: int | None  # negative: killed by that signal
    stdout: str  # at most output_bytes of it, decoded as UTF-8 with replacement
    stderr: str
    timed_out: bool  # the wall clock ran out
    reason: str  # "" for a clean exit 0, else e.g. "wall time 6s exceeded", "exit code 1"
    violation: str | None  # wall_time, cpu_time, memory, processes, output, file_size, network, filesystem, setup
    mode: str  # "namespace" or "guard"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.violation is None


# ----------------------------------------------------------------------------- reasons
_STDERR_SIGNS = [  # (violation, pattern in stderr or in an exception message); the first match wins
    ("memory", re.compile(r"\bMemoryError\b|Cannot allocate memory")),
    ("processes", re.compile(r"BlockingIOError|Resource temporarily unavailable|" + re.escape(PROCESS_REFUSED))),
    ("network", re.compile(r"Network is unreachable|Network is down|" + re.escape(NETWORK_REFUSED) +
                           r"|gaierror|Temporary failure in name resolution|Name or service not known")),
    ("file_size", re.compile(r"File too large|No space left on device")),
    ("filesystem", re.compile(r"Read-only file system|" + re.escape(WRITE_REFUSED) + "|Permission denied")),
]


def violation_in(text: str) -> str | None:
    """The limit or isolation a traceback or error message shows was hit, or None."""
    for violation, pattern in _STDERR_SIGNS:
        if pattern.search(text):
            return violation
    return None


def describe(violation: str, limits: SandboxLimits) -> str:
    """The reason text of a violation, naming the limit's value."""
    return {
        "wall_time": f"wall time {limits.wall_s:g}s exceeded",
        "cpu_time": f"cpu time {limits.cpu_s:g}s exceeded",
        "memory": f"memory limit {limits.memory_mb} MB exceeded",
        "processes": f"process limit {limits.max_processes} exceeded",
        "output": f"output limit {limits.output_bytes} bytes exceeded",
        "file_size": f"file size limit {limits.file_size_mb} MB exceeded",
        "network": "network disabled",
        "filesystem": "write outside the sandbox refused",
    }.get(violation, violation)


def _classify(returncode: int, stderr: str, cpu_used: float, limits: SandboxLimits) -> tuple[str, str | None]:
    """(reason, violation) of a run that ended on its own or by a signal."""
    if returncode == SETUP_FAILED and SETUP_FAILED_MESSAGE in stderr:
        return "sandbox " + stderr.split(MESSAGE_PREFIX, 1)[1].strip()[:300], "setup"
    if returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= math.ceil(limits.cpu_s)):
            return describe("cpu_time", limits), "cpu_time"
        if sig == signal.SIGXFSZ:
            return describe("file_size", limits), "file_size"
        name = signal.Signals(sig).name if sig in signal.valid_signals() else "?"
        violation = "memory" if sig in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS) and \
            violation_in(stderr) == "memory" else None
        return (describe(violation, limits) if violation else f"killed by signal {sig} ({name})"), violation
    if returncode == 0:
        return "", None
    violation = violation_in(stderr)
    return (describe(violation, limits) if violation else f"exit code {returncode}"), violation


# ----------------------------------------------------------------------------- which isolation
_mode_lock = threading.Lock()
_mode: tuple[str, str] | None = None  # (mode, why), decided once per process


def network_isolation() -> str:
    """"namespace" where the kernel isolates runs (namespaces work here), else "guard" (a prelude)."""
    return _decide_mode()[0]


def isolation_note() -> str:
    """One line on the mode in use and, for "guard", why the namespaces were not usable."""
    mode, why = _decide_mode()
    return f"{mode}: {why}"


def _decide_mode() -> tuple[str, str]:
    global _mode
    with _mode_lock:
        if _mode is None:
            _mode = _probe()
        return _mode


_PROBE = """
import os, socket, sys
here = os.path.dirname(os.path.abspath(__file__))
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1).close()
    sys.exit("probe: network reachable")
except OSError:
    pass
for target in (os.path.join(here, "outside"), "/tmp/{name}", "/dev/shm/{name}", "/var/tmp/{name}"):
    try:
        open(target, "w").close()
        sys.exit("probe: wrote " + target)
    except OSError:
        pass
open("inside", "w").close()
print("probe ok")
"""


def _probe() -> tuple[str, str]:
    """Run a probe program in the namespace mode: it must reach no network and write only its directory."""
    if not sys.platform.startswith("linux"):
        return "guard", f"no Linux namespaces on {sys.platform}"
    name = f"rlcore-sandbox-probe-{secrets.token_hex(6)}"
    try:
        result = _run(_PROBE.format(name=name), "", SandboxLimits(wall_s=20.0, cpu_s=5.0), "namespace")
    except OSError as exc:
        return "guard", f"the namespace bootstrap did not start ({exc})"
    leaked = [p for p in (f"/tmp/{name}", f"/dev/shm/{name}", f"/var/tmp/{name}") if os.path.exists(p)]
    for path in leaked:
        os.unlink(path)
    if result.returncode != 0 or "probe ok" not in result.stdout or leaked:
        last_line = (result.stderr.strip().splitlines() or [""])[-1]
        detail = "; ".join(filter(None, [result.reason, last_line, *(f"wrote {p}" for p in leaked)]))
        return "guard", f"the namespace probe failed ({detail})"
    owner = "a fresh uid" if os.geteuid() == 0 else "the namespace's root without capabilities"
    return "namespace", (f"user/mount/network/PID namespaces, mounts read-only, tmpfs working directory, "
                         f"program as {owner}")


# ----------------------------------------------------------------------------- running
def run_sandboxed(code: str, stdin: str = "", limits: SandboxLimits | None = None, *,
                  mode: str | None = None) -> SandboxResult:
    """Run ``code`` as a Python program (``__main__``) with ``stdin`` as its input; never hangs.

    ``mode`` forces "namespace" or "guard" (tests use it); None: the mode ``network_isolation()`` picked.
    """
    limits = limits or SandboxLimits()
    mode = mode or network_isolation()
    if mode not in ("namespace", "guard"):
        raise ValueError(f"sandbox mode must be 'namespace' or 'guard', got {mode!r}")
    return _run(code, stdin, limits, mode)


def _run(code: str, stdin: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    root = Path(tempfile.mkdtemp(prefix="rlcore-sandbox-"))
    try:
        return _run_in(root, code, stdin, limits, mode)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_in(root: Path, code: str, stdin: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    inputs, work = root / "in", root / "work"
    inputs.mkdir()
    work.mkdir()
    (inputs / "prog.py").write_text(code)
    (inputs / "stdin").write_text(stdin)
    root.chmod(0o755)
    inputs.chmod(0o755)
    outer_uid = _fresh_uid() if os.geteuid() == 0 else None
    python = os.path.realpath(sys.executable)
    spec: Spec = {"mode": mode, "prog": str(inputs / "prog.py"), "work": str(work), "python": python,
                  "limits": dataclasses.asdict(limits)}
    popen: dict[str, Any] = {}
    if mode == "namespace":
        spec.update(outer_uid=outer_uid, hide=_hidden_ancestor(python) if outer_uid is not None else None,
                    stage=str(root / "py"))
        (root / "py").mkdir()
    elif outer_uid is not None and _guard_may_drop_root(python):
        os.chown(work, outer_uid, outer_uid)
        popen.update(user=outer_uid, group=outer_uid, extra_groups=[])
        spec["as_root"] = False
    else:
        spec["as_root"] = os.geteuid() == 0
    env = {**_ENV, "HOME": str(work), "TMPDIR": str(work)}
    with open(inputs / "stdin", "rb") as stdin_file:
        proc = subprocess.Popen([python, "-I", "-S", _CHILD, json.dumps(spec)],
                                stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=work, env=env, start_new_session=True, close_fds=True, **popen)
    out, err, timed_out, flooded, status, cpu_used = _supervise(proc, limits, mode == "namespace")
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    if timed_out:
        reason, violation = describe("wall_time", limits), "wall_time"
    elif flooded:
        reason, violation = describe("output", limits), "output"
    else:
        reason, violation = _classify(status, stderr, cpu_used, limits)
    return SandboxResult(status, stdout, stderr, timed_out, reason, violation, mode)


def _fresh_uid() -> int:
    """A uid no other run is likely to share, so RLIMIT_NPROC counts this run's processes only."""
    return FRESH_UID_BASE + random.SystemRandom().randrange(2**24)


def _hidden_ancestor(python: str) -> str | None:
    """The topmost directory above the interpreter's prefix that others may not enter, if any."""
    prefix = Path(os.path.realpath(sys.base_prefix))
    if not Path(python).is_relative_to(prefix):
        return None
    for parent in reversed(prefix.parents[:-1]):  # from the top down, "/" excluded
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return str(parent)
    return None


def _guard_may_drop_root(python: str) -> bool:
    """Guard mode can run a root trainer's program as a fresh uid only if that uid can run Python."""
    paths = [python, *map(str, Path(python).parents), *map(str, Path(_CHILD).parents)]
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in paths) and \
        all(os.stat(p).st_mode & stat.S_IROTH for p in (python, _CHILD))


def _supervise(proc: subprocess.Popen, limits: SandboxLimits, namespace: bool):
    """Read both pipes under their byte caps until the run ends or its wall clock runs out, then kill
    its process group (whatever it left behind goes too).

    Returns (stdout, stderr, timed_out, flooded, returncode or None, CPU seconds of its process tree).
    """
    deadline = time.monotonic() + limits.wall_s
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    selector = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    timed_out = flooded = False
    status = rusage = exited_at = None
    try:
        while not flooded:
            if status is None:
                status, rusage = _reap(proc, block=False)
                exited_at = time.monotonic() if status is not None else None
            now = time.monotonic()
            if status is not None and (not selector.get_map() or now - exited_at > 0.5):
                break  # done; or a process it left behind still holds a pipe
            if now >= deadline:
                timed_out = status is None
                break
            if not selector.get_map():
                time.sleep(min(0.02, deadline - now))
                continue
            for key, _ in selector.select(timeout=min(0.05, deadline - now)):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                room = limits.output_bytes - len(buffer)
                buffer += chunk[:room]
                flooded = flooded or len(chunk) > room
    finally:
        if status is None and namespace:
            status, rusage = _stop_namespace(proc)
        _kill_group(proc.pid)
        if status is None:
            status, rusage = _reap(proc, block=True)
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
    cpu_used = rusage.ru_utime + rusage.ru_stime if rusage is not None else 0.0
    return bytes(buffers[out_fd]), bytes(buffers[err_fd]), timed_out, flooded, status, cpu_used


def _reap(proc: subprocess.Popen, block: bool):
    """(exit code as Popen writes it, rusage) of the run's process, or (None, None) while it lives.

    os.wait4 instead of Popen.wait, for the CPU time of the whole tree (a SIGKILL at the hard CPU
    limit reads as "cpu time exceeded" only with it). Blocking waits at most 5 s after the kill.
    """
    give_up = time.monotonic() + 5.0
    while True:
        try:
            pid, wait_status, rusage = os.wait4(proc.pid, os.WNOHANG)
        except ChildProcessError:
            return proc.returncode, None
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(wait_status)
            return proc.returncode, rusage
        if not block or time.monotonic() > give_up:
            return None, None
        time.sleep(0.01)


def _stop_namespace(proc: subprocess.Popen):
    """Ask the bootstrap to kill its init and reap it (SIGTERM), so that nothing of the run outlives it,
    not even a zombie init; a SIGKILL to the group (the caller's next step) would orphan that init."""
    try:
        os.kill(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    give_up = time.monotonic() + 2.0
    while time.monotonic() < give_up:
        status, rusage = _reap(proc, block=False)
        if status is not None:
            return status, rusage
        time.sleep(0.005)
    return None, None


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
