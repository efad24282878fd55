"""The child side of the sandbox: the bootstrap that ``rlcore.rewards.sandbox`` starts by this file's path,
as ``python -I -S sandbox_child.py SPEC``, to set up the isolation and then run the program.

Why a script of the standard library only: it runs in the isolated interpreter (no site, no
environment, no script directory on the path), maybe as a fresh uid that cannot read the project, so
it may not import rlcore. The parent imports it for the constants below, which both sides must agree on.

Two modes, as ``SPEC["mode"]`` says:

* ``"namespace"``: new user, mount, network, PID, IPC and UTS namespaces. The new network namespace
  has no interface up, so nothing is reachable, not even the host's 127.0.0.1. Every mount is
  remounted read-only and the working directory is a private tmpfs of ``file_size_mb``, so the only
  writable place dies with the run. The program runs as PID 2 under a small init; when the init ends
  the kernel kills everything left in the namespace, and processes outside cannot be seen or
  signalled. A root trainer runs the program as a fresh uid (``outer_uid``), because ``RLIMIT_NPROC``
  does not bind root and a fresh uid owns no file; the interpreter's prefix is bind-mounted into view
  when a directory such as ``/root`` hides it (``hide``). A non-root trainer runs it as the namespace's
  root with every capability dropped; its process limit then counts the user's processes already running.
* ``"guard"`` (no user namespaces): the same rlimits, plus a prelude in this interpreter that replaces
  socket creation, refuses writes outside the working directory through ``open``/``os.*``, and, when
  the program runs as root, refuses to start processes; then the program runs here as ``__main__``.
  This is best effort: code that calls libc through ``ctypes`` gets past it.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import resource
import selectors
import signal
import sys
from pathlib import Path
from typing import Any, TypedDict

FRESH_UID_BASE = 2**31 - 2**24  # a root trainer's runs get uids from here up (owned by no file, no other user)
INNER_UID = 1000  # the program's uid inside the user namespace (a root trainer maps it to a fresh outer uid)
SETUP_FAILED = 125  # the exit code when the namespaces could not be set up, with SETUP_FAILED_MESSAGE on stderr
MESSAGE_PREFIX = "rlcore-sandbox: "  # what this bootstrap writes to stderr itself starts so
SETUP_FAILED_MESSAGE = MESSAGE_PREFIX + "setup failed"
# what the guard prelude's refusals say; the parent reads them in stderr as violations
NETWORK_REFUSED = "sandbox: network disabled"
WRITE_REFUSED = "sandbox: write outside the working directory refused"
PROCESS_REFUSED = "sandbox: process creation refused"


class Spec(TypedDict, total=False):
    """The bootstrap's one argument (as JSON): what the parent prepared and decided for this run."""

    mode: str  # "namespace" or "guard"
    prog: str  # the program's file
    work: str  # its working directory (also its HOME and TMPDIR)
    python: str  # the interpreter's real path (the namespace mode execs it for the program)
    limits: dict[str, Any]  # the fields of rlcore.rewards.sandbox.SandboxLimits
    outer_uid: int | None  # namespace: the fresh uid INNER_UID maps to (root trainer), else None
    hide: str | None  # namespace, fresh uid: the directory that hides the interpreter's prefix, if any
    stage: str  # namespace: an empty directory to stage the prefix's bind mount in
    as_root: bool  # guard: the program runs as root, so new processes are refused


CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 4, 24, 28
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SECURE_NOROOT_ALL_LOCKED = 0x1 | 0x2 | 0x4 | 0x8 | 0x20 | 0x40 | 0x80  # noroot, no setuid fixup, no ambient raise
# kernel filesystems whose remount may fail harmlessly: the program, without capabilities, cannot write them
_VIRTUAL_FS = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs",
               "pstore", "bpf", "configfs", "fusectl", "hugetlbfs", "binfmt_misc", "autofs", "efivarfs",
               "selinuxfs", "nsfs", "rpc_pipefs"}


def main(spec: Spec) -> None:
    if spec["mode"] == "namespace":
        _namespace_main(spec)
    else:
        _guard_main(spec)


def _set_limits(limits: dict[str, Any], nproc: int) -> None:
    cpu = math.ceil(limits["cpu_s"])
    memory, file_size = limits["memory_mb"] << 20, limits["file_size_mb"] << 20
    for which, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),
                              (resource.RLIMIT_AS, memory, memory),
                              (resource.RLIMIT_FSIZE, file_size, file_size),
                              (resource.RLIMIT_CORE, 0, 0),
                              (resource.RLIMIT_NPROC, nproc, nproc)):
        _, current_hard = resource.getrlimit(which)
        if current_hard != resource.RLIM_INFINITY:
            hard = min(hard, current_hard)
        resource.setrlimit(which, (min(soft, hard), hard))


def _count_tasks(uid: int) -> int:
    """Threads of `uid` now running: what RLIMIT_NPROC counts against a user who is not a fresh uid."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = dict(line.split(":", 1) for line in Path(entry.path, "status").read_text().splitlines()
                              if ":" in line)
            except OSError:
                continue
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
    return count


# ----------------------------------------------------------------------------- namespace mode
def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    def encode(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    _check(libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def _prctl(libc: ctypes.CDLL, option: int, arg: int = 0) -> None:
    _check(libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)),
           f"prctl {option}")


def _namespace_main(spec: Spec) -> None:
    """Outside the new PID namespace: enter the namespaces, fork the init, report how the program ended."""
    init = None

    def stop(*_):  # the parent's SIGTERM at the wall clock: kill the init (and so the namespace), reap it
        if init is None:
            os._exit(128 + signal.SIGTERM)
        os.kill(init, signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    libc = ctypes.CDLL(None, use_errno=True)
    limits, outer = spec["limits"], spec["outer_uid"]
    nproc = limits["max_processes"] + 1 if outer is not None else \
        _count_tasks(os.getuid()) + limits["max_processes"] + 2
    _set_limits(limits, nproc)
    try:
        helper = _map_helper(outer) if outer is not None else None
        unshared = libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC
                                | CLONE_NEWUTS)
        errno = ctypes.get_errno()
        if helper is not None:
            if unshared == 0:
                os.write(helper[1], b"g")
            os.close(helper[1])  # without the "g" the helper just exits
            mapped = os.waitpid(helper[0], 0)[1] == 0
        if unshared != 0:
            raise OSError(errno, f"unshare: {os.strerror(errno)}")
        if helper is not None and not mapped:
            raise OSError("the uid/gid maps could not be written")
        if outer is None:  # an unprivileged user may map only itself
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {os.getuid()} 1"),
                               ("gid_map", f"0 {os.getgid()} 1")):
                Path("/proc/self", name).write_text(text)
    except OSError as exc:
        _setup_failed(str(exc))
    life_r, life_w = os.pipe()  # the init sees EOF on life_r once this process is gone
    status_r, status_w = os.pipe()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    init = os.fork()
    if init == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        os.close(life_w)
        os.close(status_r)
        try:
            _init(spec, libc, life_r, status_w)
        except BaseException as exc:  # noqa: BLE001 - any failure of the setup is reported, not raised
            os.write(status_w, f"x{type(exc).__name__}: {exc}".encode()[:2000])
        os._exit(SETUP_FAILED)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.close(status_w)
    _, init_status = os.waitpid(init, 0)
    init = None  # reaped: a late SIGTERM must not signal a pid that may be reused
    report = b""
    while chunk := os.read(status_r, 4096):
        report += chunk
    if report[:1] == b"e":
        os._exit(int(report[1:]))
    if report[:1] == b"s":
        _die_by(int(report[1:]))
    if os.WIFSIGNALED(init_status):
        _die_by(os.WTERMSIG(init_status))
    _setup_failed(report[1:].decode(errors="replace") or "the init ended without a report")


def _map_helper(outer: int) -> tuple[int, int]:
    """A process left outside the new user namespace to write its uid/gid maps: mapping a uid other than
    one's own takes CAP_SETUID in the parent namespace, which the unshared process no longer has."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(w)
            if os.read(r, 1) == b"g":
                for name in ("uid_map", "gid_map"):
                    Path(f"/proc/{os.getppid()}/{name}").write_text(f"0 0 1\n{INNER_UID} {outer} 1\n")
                code = 0
        finally:
            os._exit(code)
    os.close(r)
    return pid, w


def _die_by(sig: int) -> None:
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def _setup_failed(why: str) -> None:
    os.write(2, f"{SETUP_FAILED_MESSAGE}: {why}\n".encode())
    os._exit(SETUP_FAILED)


def _init(spec: Spec, libc: ctypes.CDLL, life_r: int, status_w: int) -> None:
    """PID 1 of the new namespace: mounts, drop privileges, run the program as PID 2, report, exit (which
    kills whatever the program left in the namespace)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # an init ignores the signals it has no handler for
    work, mapped = spec["work"], spec["outer_uid"] is not None
    owner = INNER_UID if mapped else 0
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    try:
        _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass  # a container's masked /proc forbids a new one; the PID namespace still hides the host's processes
    _mount(libc, "tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={spec['limits']['file_size_mb']}m,mode=0700,uid={owner},gid={owner}")
    if spec["hide"]:
        _reveal_prefix(libc, spec["hide"], spec["stage"])
    _remount_read_only(libc, keep=work)
    for cap in range(64):  # no capability can come back, not even through a file's capabilities
        if libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) != 0:
            break  # EINVAL: past the last capability
    _prctl(libc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    if mapped:
        os.setgroups([])
        os.setresgid(INNER_UID, INNER_UID, INNER_UID)
        os.setresuid(INNER_UID, INNER_UID, INNER_UID)  # leaves no capability
    else:
        _prctl(libc, PR_SET_SECUREBITS, SECURE_NOROOT_ALL_LOCKED)  # uid 0 gains nothing at exec
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)
    _prctl(libc, PR_SET_DUMPABLE, 0)  # the program may not ptrace its init
    _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # armed after setresuid, which would clear it
    if _readable(life_r):
        os._exit(SETUP_FAILED)  # the bootstrap died before the death signal was armed
    program = os.fork()
    if program == 0:
        os.close(status_w)
        os.close(life_r)
        try:
            os.chdir(work)
            os.execv(spec["python"], [spec["python"], "-I", "-S", spec["prog"]])
        except OSError as exc:
            os.write(2, f"{MESSAGE_PREFIX}could not start the program: {exc}\n".encode())
        os._exit(127)
    _, status = os.waitpid(program, 0)
    report = f"s{os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"e{os.WEXITSTATUS(status)}"
    os.write(status_w, report.encode())
    os._exit(0)


def _readable(fd: int) -> bool:
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ)
    return bool(selector.select(timeout=0))


def _reveal_prefix(libc: ctypes.CDLL, hidden: str, stage: str) -> None:
    """Let the fresh uid run the interpreter although `hidden` (e.g. /root) may not be entered: cover
    `hidden` with an empty tmpfs and bind the interpreter's prefix back at its own path (the binary's
    RUNPATH names that path)."""
    prefix = os.path.realpath(sys.base_prefix)
    _mount(libc, prefix, stage, None, MS_BIND | MS_REC)
    _mount(libc, "tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    os.makedirs(prefix, exist_ok=True)
    _mount(libc, stage, prefix, None, MS_BIND | MS_REC)


def _mounts() -> list[tuple[str, set[str], str]]:
    """(mount point, per-mount options, filesystem type) of each line of /proc/self/mountinfo."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fields = before.split()
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # "\040" is a space
        found.append((point, set(fields[5].split(",")), after.split()[0]))
    return found


def _remount_read_only(libc: ctypes.CDLL, keep: str) -> None:
    """Every mount but `keep` read-only, keeping the flags a user namespace may not clear (nosuid,
    nodev, noexec, atime); a real filesystem that stays writable fails the setup."""
    failed = []
    for point, options, fstype in _mounts():
        if point == keep or point.startswith(keep + "/"):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        flags |= sum(bit for name, bit in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC),
                                           ("nodiratime", MS_NODIRATIME)) if name in options)
        flags |= MS_NOATIME if "noatime" in options else MS_RELATIME if "relatime" in options else MS_STRICTATIME
        try:
            _mount(libc, None, point, None, flags)
        except OSError as exc:
            if fstype not in _VIRTUAL_FS and "ro" not in options and exc.errno != 2:  # ENOENT: covered by another
                failed.append(f"{point} ({fstype}): {exc.strerror}")
    if failed:
        raise OSError("could not make read-only: " + ", ".join(failed))


# ----------------------------------------------------------------------------- guard mode
def _guard_main(spec: Spec) -> None:
    """Without namespaces: limits, then the guards, then the program in this interpreter as __main__."""
    limits = spec["limits"]
    fresh = os.getuid() >= FRESH_UID_BASE
    nproc = limits["max_processes"] if fresh else _count_tasks(os.getuid()) + limits["max_processes"] + 1
    _set_limits(limits, nproc)
    prog = spec["prog"]
    code = compile(Path(prog).read_text(), prog, "exec")
    _install_guards(os.getcwd(), block_processes=spec["as_root"])
    sys.argv = [prog]
    exec(code, {"__name__": "__main__", "__file__": prog, "__builtins__": __builtins__})


def _install_guards(work: str, block_processes: bool) -> None:
    """Refuse sockets, name lookups and writes outside `work` (and new processes where RLIMIT_NPROC does not
    bind, as root) at the Python level."""
    import _posixsubprocess
    import _socket
    import builtins
    import errno
    import io
    import socket

    work = os.path.realpath(work)

    def inside(path: Any, dir_fd: int | None = None) -> bool:
        if isinstance(path, int):
            return True
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        real = os.path.realpath(path)
        return real == work or real.startswith(work + os.sep) or real == os.devnull

    def refuse(path: Any) -> None:
        raise PermissionError(errno.EACCES, WRITE_REFUSED,
                              os.fsdecode(path) if not isinstance(path, int) else str(path))

    real_open, real_os_open = builtins.open, os.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and not inside(file):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND) and not inside(path, dir_fd):
            refuse(path)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    builtins.open = io.open = guarded_open
    os.open = guarded_os_open
    for name in ("remove", "unlink", "rmdir", "mkdir", "rename", "replace", "link", "symlink", "truncate",
                 "chmod", "chown", "lchown", "utime", "mkfifo", "mknod", "removexattr", "setxattr"):
        if hasattr(os, name):
            setattr(os, name, _path_guard(getattr(os, name), 2 if name in ("rename", "replace", "link", "symlink")
                                          else 1, inside, refuse))

    def no_network(*args, **kwargs):
        raise PermissionError(errno.EACCES, NETWORK_REFUSED)

    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            no_network()

    for module in (socket, _socket):
        for name in ("socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo", "gethostbyname",
                     "gethostbyname_ex", "gethostbyaddr", "getnameinfo"):
            if hasattr(module, name):
                setattr(module, name, no_network)
        module.socket = module.SocketType = NoSocket
    if block_processes:
        def no_process(*args, **kwargs):
            raise BlockingIOError(errno.EAGAIN, PROCESS_REFUSED)

        for name in ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv", "execve",
                     "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnvp",
                     "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe"):
            if hasattr(os, name):
                setattr(os, name, no_process)
        _posixsubprocess.fork_exec = no_process  # a later `import subprocess` copies this one
        if "subprocess" in sys.modules:  # imported already: it holds its own copy
            sys.modules["subprocess"]._fork_exec = no_process


def _path_guard(real, n_paths: int, inside, refuse):
    def guarded(*args, **kwargs):
        for i, path in enumerate(args[:n_paths]):
            dir_fd = kwargs.get("dir_fd") if n_paths == 1 else kwargs.get(("src_dir_fd", "dst_dir_fd")[i])
            if not inside(path, dir_fd):
                refuse(path)
        return real(*args, **kwargs)
    return guarded


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
