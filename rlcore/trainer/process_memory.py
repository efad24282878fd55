"""The memory a run holds: PSS of the driver and every process it started, sampled over time.

A run is several processes: the driver, Ray's daemons (GCS, raylet, agents: all started by the
driver's ``ray.init``), the ranks' workers (the raylet's children) and whatever a worker starts in turn
(a vLLM engine core in its own process). They share pages: the libraries each maps, Ray's object
store in ``/dev/shm``. Summing RSS counts a shared page once per process that maps it; PSS
(proportional set size, ``/proc/<pid>/smaps_rollup``) splits it among them, so the sum of the
processes' PSS is the memory the run takes from the machine, what decides whether it fits a laptop.

Linux keeps no high-water mark of PSS (``VmHWM`` is RSS's), so ``MemoryWatch`` samples the process
tree from a thread (every ``interval_s``: a peak shorter than that can be missed) and keeps the peak
of the sum, each process's own peak, and what each held at the moment of the sum's peak, split into
anonymous memory (heaps, tensors), file pages (libraries, memory-mapped weights) and shared memory
(Ray's object store), plus each process's exact ``VmHWM``. A reading walks every page table: ~20 ms of
CPU per GiB resident (measured on the 2-core EPYC), ~80 ms for a SmolLM2 run, hence a run's default
of one reading per 5 s (``trainer.memory_watch_s``; ``benchmarks/memory.py`` samples every 0.5 s).
``start_run_watch`` starts a run's watch: the builder starts it before any worker and hands it on with
the workers (``Workers.memory``), ``TrainingRun`` reports it at the end of the run. Elsewhere than
Linux, or where ``/proc`` is unreadable, the readings are empty and nothing is reported.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30
PARTS = {"Pss_Anon": "anon", "Pss_File": "file", "Pss_Shmem": "shmem"}  # smaps_rollup's split of Pss


def pss(pid: int) -> dict[str, int] | None:
    """``pid``'s proportional set size in bytes (``total``) and its split (``anon``, ``file``, ``shmem``),
    from ``/proc/<pid>/smaps_rollup``; None for a process gone or unreadable (another user's)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        name = "total" if key == "Pss" else PARTS.get(key)
        if name:
            out[name] = int(rest.split()[0]) * 1024
    return out if "total" in out else None


def rss_high_water(pid: int) -> int | None:
    """``pid``'s peak resident set in bytes (``VmHWM``: exact, unlike a sampled PSS, but it counts
    every shared page in full); None for a process gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def parent_pids() -> dict[int, int]:
    """Every live process's parent, read from ``/proc/<pid>/stat`` (its 4th field, after the name in
    parentheses, which may itself hold spaces or parentheses)."""
    parents = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    return parents


def process_tree(root: int) -> list[int]:
    """``root`` and all its live descendants, root first."""
    children: dict[int, list[int]] = {}
    for pid, parent in parent_pids().items():
        children.setdefault(parent, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def process_label(pid: int, root: int) -> str | None:
    """A short name: ``driver`` for the run's own process, Ray's process titles as they are
    (``ray::WorkerHost``: a rank), a Python script by its file name (Ray's agents), a binary by its
    name (``raylet``, ``gcs_server``); None while unreadable (a process exiting has no command line)."""
    if pid == root:
        return "driver"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = []
    if not argv:
        return None
    if argv[0].startswith("ray::"):  # a Ray worker's title: ray::<class>.<method> or ray::IDLE
        return argv[0].split(" ")[0].split(".")[0]
    name = os.path.basename(argv[0])
    if name.startswith("python"):  # by its module or script (Ray's agents: dashboard/agent.py, ...)
        for i, arg in enumerate(argv[1:], 1):
            if arg == "-c":
                return f"{name} -c"
            if arg == "-m" and i + 1 < len(argv):
                return argv[i + 1]
            if not arg.startswith("-"):
                return os.path.basename(arg)
    return name


@dataclass
class MemoryPeaks:
    """What the samples saw: the largest sum of PSS over the run's processes, each process's largest
    PSS, and what each held (total and split) when the sum peaked. Keyed ``label[pid]``, the label as
    last read (a Ray worker takes its actor's name after it starts)."""

    samples: int = 0
    peak_total: int = 0
    now_total: int = 0
    at_peak: dict[int, dict[str, int]] = field(default_factory=dict)
    per_process: dict[int, int] = field(default_factory=dict)
    labels: dict[int, str] = field(default_factory=dict)
    rss_hwm: dict[int, int] = field(default_factory=dict)  # each process's VmHWM as last read

    def add(self, reading: dict[int, dict[str, int]], labels: dict[int, str], hwm: dict[int, int]) -> None:
        self.samples += 1
        self.labels.update(labels)
        self.rss_hwm.update(hwm)
        self.now_total = sum(r["total"] for r in reading.values())
        for pid, r in reading.items():
            self.per_process[pid] = max(self.per_process.get(pid, 0), r["total"])
        if self.now_total >= self.peak_total:
            self.peak_total, self.at_peak = self.now_total, reading

    def _order(self) -> list[int]:
        return sorted(self.per_process, key=self.per_process.get, reverse=True)

    def name(self, pid: int) -> str:
        return f"{self.labels.get(pid, 'pid')}[{pid}]"

    def summary(self) -> dict:
        """A JSON-ready record (bytes), largest processes first."""
        order = self._order()
        return {"samples": self.samples, "peak_pss_total_bytes": self.peak_total,
                "peak_pss_bytes": {self.name(p): self.per_process[p] for p in order},
                "peak_rss_bytes": {self.name(p): self.rss_hwm[p] for p in order if p in self.rss_hwm},
                "at_total_peak_bytes": {self.name(p): self.at_peak[p] for p in order if p in self.at_peak}}

    def line(self, largest: int = 4) -> str:
        """One line for the end of a run: the peak of the sum and the largest processes' own peaks."""
        order = self._order()
        shown = ", ".join(f"{self.labels.get(p, 'pid')} {self.per_process[p] / GIB:.2f}" for p in order[:largest])
        rest = order[largest:]
        more = f", {len(rest)} more {sum(self.per_process[p] for p in rest) / GIB:.2f}" if rest else ""
        return (f"memory: peak {self.peak_total / GIB:.2f} GiB PSS summed over the run's {len(order)} processes "
                f"(each one's own peak, GiB: {shown}{more}; sampled, <run>/memory.json)")


class MemoryWatch:
    """Samples the PSS of ``root`` (default: this process) and its descendants every ``interval_s`` on a
    daemon thread until ``stop``; ``sample`` takes one reading now (the thread's work, callable by hand)."""

    def __init__(self, root: int | None = None, interval_s: float = 5.0) -> None:
        self.root = os.getpid() if root is None else root
        self.interval_s = interval_s
        self.peaks = MemoryPeaks()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[int, dict[str, int]]:
        """One reading: each live process of the tree's PSS (``pss``), by pid."""
        reading, labels, hwm = {}, {}, {}
        for pid in process_tree(self.root):
            got, high = pss(pid), rss_high_water(pid)
            if got is not None:
                reading[pid] = got
                label = process_label(pid, self.root)
                if label:  # the latest readable one: a Ray worker is renamed once it hosts an actor
                    labels[pid] = label
            if high is not None:
                hwm[pid] = high
        with self._lock:
            self.peaks.add(reading, labels, hwm)
        return reading

    def start(self) -> "MemoryWatch":
        if self._thread is None and pss(self.root) is not None:
            self._thread = threading.Thread(target=self._run, name="rlcore-memory-watch", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.is_set():
            self.sample()
            self._stopped.wait(self.interval_s)

    def stop(self) -> MemoryPeaks:
        """Stop sampling (after one last reading) and return the peaks; again: the same peaks."""
        if self._stopped.is_set():
            return self.peaks
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self.sample()
        return self.peaks

    def metrics(self) -> dict[str, float]:
        """The sum's PSS at the last reading and its peak so far, GiB (a step's ``memory/`` metrics)."""
        with self._lock:
            if not self.peaks.samples:
                return {}
            return {"memory/pss_gib": self.peaks.now_total / GIB, "memory/pss_peak_gib": self.peaks.peak_total / GIB}


def start_run_watch(interval_s: float) -> MemoryWatch | None:
    """A run's watch (``trainer.memory_watch_s``; 0: none), started: by the builder, before any worker
    starts, so that their start-up is seen too."""
    return MemoryWatch(interval_s=interval_s).start() if interval_s > 0 else None


def finish_run_watch(watch: MemoryWatch | None, run_dir: Path | None) -> str | None:
    """Stop ``watch``, write ``<run_dir>/memory.json`` and return the end-of-run line (None when
    nothing was sampled)."""
    if watch is None:
        return None
    peaks = watch.stop()
    if not peaks.samples:
        return None
    if run_dir is not None and run_dir.is_dir():
        record = {"interval_s": watch.interval_s, **peaks.summary()}
        try:
            (run_dir / "memory.json").write_text(json.dumps(record, indent=1) + "\n")
        except OSError as exc:  # a full disk at the run's end: the line below still says it, and the run's own error stays
            print(f"warning: could not write {run_dir / 'memory.json'}: {exc}", flush=True)
    return peaks.line()


def report_run_watch(watch: MemoryWatch | None, run_dir: Path) -> None:
    """At the run's end: ``finish_run_watch`` and its line printed (the run's peak memory, per process)."""
    line = finish_run_watch(watch, run_dir)
    if line:
        print(line, flush=True)
