"""init_ray: a given Ray address that nothing answers fails at once naming it (ray.init would retry
it for ever); one that answers like a Ray head (a gRPC server's HTTP/2 SETTINGS frame) is connected
to, without the local-instance options. (A listener that accepts and never answers: tests/faults.)"""

import socket
import threading

import pytest

from rlcore.trainer.builder import init_ray
from rlcore.trainer.config import load_config

ray = pytest.importorskip("ray")


@pytest.fixture
def fake_ray_init(monkeypatch):
    """Not connected, and ray.init records its call instead of starting or attaching to anything."""
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    return calls


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def trainer(**keys):
    return load_config({"trainer": {"ray_connect_timeout_s": 5, **keys}}, ["trainer"])


@pytest.mark.timeout(120)  # a connect that waited out its limit (600 s) instead of failing at once meets this
def test_a_dead_ray_address_fails_fast_naming_it(monkeypatch, fake_ray_init):
    address = f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(ConnectionError, match=rf"no Ray cluster answers at {address} \(from the RAY_ADDRESS "
                                              r"environment variable\) within 600s"):
        init_ray(trainer(ray_connect_timeout_s=600))
    assert fake_ray_init == []  # never handed to ray.init
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ConnectionError, match=rf"at ray://{address} \(from trainer.ray_address\)"):
        init_ray(trainer(ray_address=f"ray://{address}"))


def test_a_live_address_is_attached_to_and_none_starts_a_local_instance(monkeypatch, fake_ray_init):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"

        def answer_like_a_grpc_server():  # what a Ray GCS sends first: an HTTP/2 SETTINGS frame
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))

        thread = threading.Thread(target=answer_like_a_grpc_server, daemon=True)
        thread.start()
        init_ray(trainer(ray_address=address, ray_num_cpus=2))
        thread.join(5)
    assert fake_ray_init[0]["address"] == address and "num_cpus" not in fake_ray_init[0]
    init_ray(trainer(ray_num_cpus=2))
    assert fake_ray_init[1]["address"] == "local" and fake_ray_init[1]["num_cpus"] == 2  # never a cluster
    # some other program left in /tmp/ray/ray_current_cluster (ray.init(address=None) would attach to it)
