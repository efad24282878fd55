"""The trackio backend against the real trackio, read back through trackio's own storage reader. trackio fixes
its folder at import, so each check runs in a fresh Python process: the first run's records must land in
<run>/trackio, with the scalars, config and completion table as logged, and no request to the Hugging Face Hub
though a token is set (a loopback listener standing in for the Hub counts connections)."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from rlcore.trainer.tracking import Tracker

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    from pathlib import Path
    from rlcore.trainer.tracking import Tracker
    root = Path(sys.argv[1])
    config = {"actor": {"lr": 0.001}, "trainer": {"project": "proj"}}
    columns = ["step", "prompt", "response", "reward", "reward/format"]
    rows = [[2, "1+1", "2</s>", 1.0, 0.5], [2, "2+2", "5", 0.0, None]]
    with Tracker(["jsonl", "trackio"], project="proj", experiment="run-a", log_dir=root / "a", config=config) as tracker:
        tracker.log({"loss": 1 / 3, "n": 4}, step=1)
        tracker.log({"loss": -2.5e-7, "n": 2}, step=2)
        tracker.log_table("completions", columns, rows, step=2)
    env_after = os.environ.get("TRACKIO_DIR")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Tracker(["trackio"], project="proj", experiment="run-b", log_dir=root / "b") as second:
            second.log({"loss": 5.0}, step=1)
    from trackio.sqlite_storage import SQLiteStorage
    import trackio
    print(json.dumps({
        "dir": str(trackio.utils.TRACKIO_DIR), "env_after": env_after,
        "runs": SQLiteStorage.get_runs("proj"),
        "logs": SQLiteStorage.get_logs("proj", "run-a"),
        "logs_b": SQLiteStorage.get_logs("proj", "run-b"),
        "config": SQLiteStorage.get_run_config("proj", "run-a"),
        "warnings": [str(w.message) for w in caught],
        "current_run": trackio.context_vars.current_run.get() is not None,
    }))
""")


def listener():
    """A loopback TCP listener counting the connections it gets (each closed at once)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    count, stop = [0], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            count[0] += 1
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server.getsockname()[1], count, lambda: (stop.set(), thread.join(5), server.close())


def test_trackio_records_scalars_config_and_table_under_the_run_folder_without_the_hub(tmp_path):
    port, connections, stop = listener()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKIO_", "HF_", "HUGGING"))}
    env.update(PYTHONPATH=str(REPO), HF_HOME=str(tmp_path / "hf_home"), HF_TOKEN="hf_not_a_real_token",
               HF_ENDPOINT=f"http://127.0.0.1:{port}")  # a whoami would connect here
    try:
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    finally:
        stop()
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["dir"] == str((tmp_path / "a" / "trackio").resolve()) and (tmp_path / "a" / "trackio" / "proj.db").is_file()
    assert out["env_after"] is None  # TRACKIO_DIR was set for the import only
    assert connections[0] == 0, "trackio.init reached the Hub endpoint"
    assert out["runs"] == ["run-a", "run-b"]
    logged = [{k: v for k, v in row.items() if k != "timestamp"} for row in out["logs"]]
    assert logged == [
        {"loss": 1 / 3, "n": 4, "step": 1},
        {"loss": -2.5e-7, "n": 2, "step": 2},
        {"completions": {"_type": "trackio.table", "_value": [
            {"step": 2, "prompt": "1+1", "response": "2</s>", "reward": 1.0, "reward/format": 0.5},
            {"step": 2, "prompt": "2+2", "response": "5", "reward": 0.0, "reward/format": None}]}, "step": 2}]
    config = out["config"]
    assert config["actor"] == {"lr": 0.001} and config["trainer"] == {"project": "proj"}
    assert config["_Username"] is None  # no whoami answer: the Hub was never asked
    # the second run of the process: trackio's folder is the first run's, and a warning says so
    assert [{k: v for k, v in r.items() if k != "timestamp"} for r in out["logs_b"]] == [{"loss": 5.0, "step": 1}]
    assert any(str((tmp_path / "a" / "trackio").resolve()) in w and "run-b" in w for w in out["warnings"])
    assert not (tmp_path / "b" / "trackio").exists()
    assert not out["current_run"]  # closed runs are not trackio's current run: its exit hook has nothing to do


@pytest.mark.parametrize("variable", ["TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"])
def test_a_remote_trackio_destination_is_refused_by_name(tmp_path, monkeypatch, variable):
    monkeypatch.setenv(variable, "user/space" if variable.endswith("ID") else "http://127.0.0.1:9")
    with pytest.raises(ValueError, match=rf"'trackio' logs locally.*{variable} is set"):
        Tracker(["jsonl", "trackio"], log_dir=tmp_path)
    (tmp_path / "metrics.jsonl").unlink()  # the jsonl backend opened first was closed, not leaked
