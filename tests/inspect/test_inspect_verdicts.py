"""The consistency check's verdicts (``<run>/check.jsonl``) in the inspector's data: read with the run,
served as JSON by ``--serve`` at /data.json behind the same token as the page."""

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlcore.inspect import load_run
from rlcore.inspect.server import DATA_PATH, InspectorServer
from rlcore.trainer.verdicts import CHECK_FILE, VerdictLog


def make_run(folder: Path) -> Path:
    """A run whose check warned at step 2 (written by the run's own writer)."""
    folder.mkdir(parents=True)
    rows = [{"step": s, "check/tokens": 1500.0, "check/logprob_abs_diff_mean": 1e-7 if s != 2 else 0.3} for s in (1, 2, 3)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = VerdictLog(folder)
    for r in rows:
        log.begin(r["step"], r)
        if r["step"] == 2:
            log.warning(2, "weights_partial", "weights partly synced", ["model.layers.1.mlp.up_proj.weight"])
        log.verdict(r["step"], r)
    return folder


def test_load_run_has_the_check_rows_and_none_without_the_file(tmp_path):
    run = make_run(tmp_path / "run")
    checks = load_run(run)["checks"]
    assert [(c["step"], c["kind"], c["cause"]) for c in checks] == [
        (1, "verdict", "ok"), (2, "warning", "weights_partial"), (2, "verdict", "weights_partial"), (3, "verdict", "ok")]
    assert checks[1]["tensors"] == ["model.layers.1.mlp.up_proj.weight"]
    assert checks[1]["numbers"] == {"check/tokens": 1500.0, "check/logprob_abs_diff_mean": 0.3}
    (run / CHECK_FILE).unlink()
    assert load_run(run)["checks"] == []


def test_served_data_has_the_verdicts_behind_the_token(tmp_path):
    run = make_run(tmp_path / "run")
    server = InspectorServer(run)
    server.start()
    try:
        base, token = server.url.split("?")
        with urllib.request.urlopen(f"{base.rstrip('/')}{DATA_PATH}?{token}", timeout=10) as reply:
            assert reply.headers["Content-Type"] == "application/json"
            data = json.loads(reply.read())
        assert data == json.loads(json.dumps(load_run(run)))
        assert [c["cause"] for c in data["checks"] if c["kind"] == "warning"] == ["weights_partial"]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base.rstrip('/')}{DATA_PATH}", timeout=10)
        assert refused.value.code == 403
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{base.rstrip('/')}/other.json?{token}", timeout=10)
        assert missing.value.code == 404
    finally:
        server.shutdown()
        server.server_close()
