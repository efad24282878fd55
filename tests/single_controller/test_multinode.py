"""A worker group placed across two Ray nodes (two raylets on this machine)."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_group_spans_two_nodes(preloaded_python):
    """``python multinode_check.py``, forked from an interpreter that imported torch and Ray once."""
    # Ray's Cluster writes its address to <RAY_TMPDIR or /tmp>/ray/ray_current_cluster, and every
    # ray.init() without an address on this machine attaches to it while it lives: a private RAY_TMPDIR
    # keeps this test's cluster from capturing the local instances other tests start beside it.
    ray_tmp = tempfile.mkdtemp(prefix="rc")  # short: Ray's socket paths live under it (108-byte limit)
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent)]))
    try:
        proc = preloaded_python.run(None, script=HERE / "multinode_check.py", cwd=HERE, timeout=300, env=env)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"multinode check failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["nodes"] == 2
    assert [w["rank"] for w in result["where"]] == [0, 1]
    assert result["where"][0]["node_id"] != result["where"][1]["node_id"]  # one rank per node
    assert [w["sum"] for w in result["where"]] == [3.0, 3.0]  # gloo all-reduce across the nodes
    assert result["x"] == [0, 1, 102, 103]
