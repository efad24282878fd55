"""A single-box group opens no port reachable from outside the machine: its ranks meet through a
file and gloo binds loopback, where torch's TCP rendezvous would listen on every interface."""

import os

import psutil
import torch
import torch.distributed as dist

from rlcore.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    LocalWorkerGroup,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    register,
)
from rlcore.single_controller.worker import RENDEZVOUS_FILE_ENV

LOOPBACK = {"127.0.0.1", "::1"}


def listening() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


class ListenProbe(Worker):
    """Joins the group's process group and reports the sockets this process began listening on."""

    def __init__(self, forget_rendezvous_file: bool = False):
        if forget_rendezvous_file:  # the TCP rendezvous every rank used before: the contrast case
            self._rendezvous_file = ""
            os.environ.pop(RENDEZVOUS_FILE_ENV, None)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join(self) -> dict:
        before = listening()
        self.init_distributed()
        total = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(total)
        opened = sorted(listening() - before)
        dist.destroy_process_group()
        return {"opened": opened, "sum": total.item(), "file": self._rendezvous_file}


def test_a_one_node_ray_group_listens_on_loopback_only(ray_cluster):
    pool = RayResourcePool([2], name_prefix="loopback")
    group = RayWorkerGroup(pool, ClassWithInitArgs(ListenProbe))
    try:
        results = group.join()
    finally:
        group.shutdown()
        pool.shutdown()
    assert [r["sum"] for r in results] == [3.0, 3.0]  # the two ranks met and reduced
    assert results[0]["file"] and results[0]["file"] == results[1]["file"]  # one rendezvous file per group
    assert not os.path.exists(results[0]["file"])  # torch removes it when every rank's store closes, or shutdown does
    for r in results:
        assert r["opened"], "gloo opens a listener per rank"
        assert {ip for ip, _ in r["opened"]} <= LOOPBACK, r["opened"]


def test_the_tcp_rendezvous_would_listen_on_every_interface(ray_cluster):
    """What the file rendezvous avoids (and the proof the check above can fail): torch's TCPStore
    binds all interfaces whatever MASTER_ADDR says."""
    pool = RayResourcePool([1], name_prefix="tcp_contrast")
    group = RayWorkerGroup(pool, ClassWithInitArgs(ListenProbe, forget_rendezvous_file=True))
    try:
        [result] = group.join()
    finally:
        group.shutdown()
        pool.shutdown()
    assert result["file"] == "" and result["sum"] == 1.0
    assert {ip for ip, _ in result["opened"]} - LOOPBACK, result["opened"]


IN_PROCESS = """
import sys
sys.path.insert(0, {here!r})
from test_loopback_rendezvous import ListenProbe
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
print(LocalWorkerGroup(ClassWithInitArgs(ListenProbe)).join())
"""


def test_an_in_process_group_listens_on_loopback_only(preloaded_python):
    """In a process of its own (this one's process group may be in use: in-process vLLM engines), forked from an
    interpreter that imported torch once and made no process group."""
    script = IN_PROCESS.format(here=os.path.dirname(os.path.abspath(__file__)))
    out = preloaded_python.run(None, code=script, cwd=os.getcwd(), timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    [result] = eval(out.stdout.strip().splitlines()[-1])
    assert result["sum"] == 1.0 and result["file"]
    assert result["opened"], "gloo opens a listener"
    assert {ip for ip, _ in result["opened"]} <= LOOPBACK, result["opened"]


LOCAL_RAY = """
import os, time, psutil, ray
from omegaconf import OmegaConf
from rlcore.trainer.builder import init_ray
init_ray(OmegaConf.create({"trainer": {"ray_address": None, "ray_num_cpus": 1, "ray_connect_timeout_s": 5}}))
niceness = ray.get(ray.remote(lambda: os.nice(0)).remote())  # a worker process too, and its priority
def name(p):
    try:
        return p.name()
    except psutil.NoSuchProcess:  # exited since it was listed
        return None
def listeners():
    ours = {p.pid: name(p) for p in psutil.Process().children(recursive=True)} | {os.getpid(): "driver"}
    ours = {pid: n for pid, n in ours.items() if n}
    return sorted({(ours[c.pid], c.laddr.ip) for c in psutil.net_connections("inet")
                   if c.status == psutil.CONN_LISTEN and c.pid in ours})
deadline = time.monotonic() + 120  # a hang guard: the agents open their ports after ray.init returns
while not any("Agent" in n for n, _ in listeners()) and time.monotonic() < deadline:
    time.sleep(0.2)
time.sleep(1)  # their other ports, if any, a moment later (a shorter wait only sees fewer, never fails)
print(sorted(n for n in map(name, psutil.Process().children(recursive=True)) if n and n.startswith("ray::")
             and "Agent" not in n))  # Ray's worker processes: the task's own only, none prestarted for nothing
print(niceness)
print(listeners())
ray.shutdown()
"""


def test_a_local_ray_instance_listens_on_loopback_only(preloaded_python):
    """The Ray a recipe starts for itself (no trainer.ray_address): GCS, raylet, workers, agents and
    Ray's unauthenticated metrics endpoints all on loopback (by default they take every interface); its
    workers at the driver's priority (Ray's default: nice 15)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_worker_niceness")}
    out = preloaded_python.run(None, code=LOCAL_RAY, cwd=os.getcwd(), timeout=180, env=env)  # a driver of its own
    assert out.returncode == 0, out.stderr[-2000:]
    workers, niceness, listeners = out.stdout.strip().splitlines()[-3:]
    assert eval(workers) == ["ray::IDLE"], workers  # the task's worker, idle since; Ray prestarts one a CPU otherwise
    assert int(niceness) == os.nice(0), niceness  # the driver's own (this test's process, unless run niced)
    listeners = eval(listeners)  # [(process name, address)]
    names = {name for name, _ in listeners}
    assert {"gcs_server", "raylet"} <= names and any("Agent" in n for n in names), listeners  # it saw Ray's servers
    assert {ip for _, ip in listeners} <= LOOPBACK | {"::ffff:127.0.0.1"}, listeners
