"""The PSS reader and the run's memory watch, on this process and children with a known allocation."""

import json
import os
import subprocess
import sys

import pytest

from rlcore.trainer.process_memory import GIB, MemoryWatch, finish_run_watch, process_label, process_tree, pss, \
    start_run_watch

MIB = 2**20
pytestmark = pytest.mark.skipif(pss(os.getpid()) is None, reason="needs Linux's /proc/<pid>/smaps_rollup")

# Writes 1 into every byte of 200 MiB (a zeroed bytearray could stay unmapped), starts a grandchild
# that holds nothing, then waits for stdin to close.
CHILD = """
import subprocess, sys
held = bytearray(b"\\x01") * (200 << 20)
grandchild = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
print(grandchild.pid, flush=True)
sys.stdin.read()
grandchild.stdin.close()
grandchild.wait()
"""


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    yield proc, grandchild
    proc.stdin.close()
    proc.wait(timeout=30)


def test_pss_of_this_process_and_a_child_holding_200_mib(child):
    proc, grandchild = child
    mine = pss(os.getpid())
    assert set(mine) == {"total", "anon", "file", "shmem"}
    assert mine["anon"] + mine["file"] + mine["shmem"] == pytest.approx(mine["total"], abs=64 * 1024)
    theirs = pss(proc.pid)
    assert 200 * MIB <= theirs["anon"] < 200 * MIB + 64 * MIB  # the bytes it wrote, plus a bare interpreter's heap
    assert pss(grandchild)["anon"] < 64 * MIB
    assert pss(2**22 + 12345) is None  # no such process (above the kernel's default pid_max)


def test_the_watch_sums_the_tree_and_keeps_the_peak_after_a_process_ends(child):
    proc, grandchild = child
    assert {proc.pid, grandchild} <= set(process_tree(os.getpid()))
    assert process_label(os.getpid(), os.getpid()) == "driver"
    assert process_label(proc.pid, os.getpid()) == os.path.basename(sys.executable) + " -c"
    watch = MemoryWatch(interval_s=0.05)
    reading = watch.sample()
    assert reading[proc.pid]["total"] >= 200 * MIB and grandchild in reading
    peak = watch.peaks.peak_total
    assert peak == sum(r["total"] for r in reading.values())
    proc.stdin.close()
    proc.wait(timeout=30)
    after = watch.sample()
    assert proc.pid not in after and grandchild not in after
    assert watch.peaks.now_total <= peak - 200 * MIB + 32 * MIB  # the child's 200 MiB went with it
    assert watch.peaks.peak_total == peak and watch.peaks.per_process[proc.pid] >= 200 * MIB
    summary = watch.peaks.summary()
    name = f"{os.path.basename(sys.executable)} -c[{proc.pid}]"
    assert summary["peak_pss_bytes"][name] == watch.peaks.per_process[proc.pid]
    assert list(summary["peak_pss_bytes"].values()) == sorted(summary["peak_pss_bytes"].values(), reverse=True)
    assert summary["at_total_peak_bytes"][name]["anon"] >= 200 * MIB
    assert watch.metrics()["memory/pss_peak_gib"] == peak / GIB


def test_the_run_watch_writes_memory_json_and_an_end_line(tmp_path, child):
    assert start_run_watch(0) is None  # trainer.memory_watch_s=0: off
    watch = start_run_watch(5.0)
    watch.sample()
    line = finish_run_watch(watch, tmp_path)
    assert line.startswith("memory: peak ") and " GiB PSS summed over the run's " in line
    assert "driver" in line and "python" in line
    record = json.loads((tmp_path / "memory.json").read_text())
    assert record["peak_pss_total_bytes"] >= 200 * MIB
    assert sum(record["peak_pss_bytes"].values()) >= record["peak_pss_total_bytes"]
    assert finish_run_watch(watch, None) == line  # stopped once: a second finish reads the same peaks
    assert finish_run_watch(None, tmp_path) is None


def test_a_start_that_fails_stops_its_watch(monkeypatch):
    """Workers that fail to start leave no watch running for the next run in this process."""
    from omegaconf import OmegaConf

    from rlcore.trainer import builder

    started = []

    def dies(cfg, roles, classes, watch):
        assert watch is not None and watch._thread.is_alive()  # started before the first worker
        started.append(watch)
        raise RuntimeError("init_model died")

    monkeypatch.setattr(builder, "preflight", lambda cfg: None)
    monkeypatch.setattr(builder, "_started_workers", dies)
    with pytest.raises(RuntimeError, match="init_model died"):
        builder.build_workers(OmegaConf.create({"trainer": {"memory_watch_s": 5.0}}), ["actor"])
    assert not started[0]._thread.is_alive()


def test_workers_shut_down_stop_the_watch_they_carry():
    """Workers built and used without a TrainingRun (a notebook) stop their memory watch with the group."""
    from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, Worker
    from rlcore.trainer.builder import Workers

    watch = start_run_watch(5.0)
    Workers(group=LocalWorkerGroup(ClassWithInitArgs(Worker), world_size=1), memory=watch).shutdown()
    assert not watch._thread.is_alive()
