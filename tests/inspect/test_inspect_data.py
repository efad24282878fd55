"""Reading a run folder for the inspector (rlcore.inspect.run_data), the page's embedding of it, the
loopback server's token check and the command line's errors."""

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlcore.inspect import RunFolderError, load_run, render_page
from rlcore.inspect.page import script_json
from rlcore.inspect.run_data import sample_metrics
from rlcore.inspect.server import InspectorServer

REPO = Path(__file__).resolve().parents[2]


def make_run(folder: Path, steps=(1, 2, 3)) -> Path:
    (folder / "trajectories").mkdir(parents=True)
    rows = [{"step": s, "reward/score/mean": s / 10, "check/logprob_abs_diff_mean": float("nan") if s == 2 else 0.01}
            for s in steps]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for s in steps:
        record = {"step": s, "row": 0, "group": "0", "pieces": ["a"], "reward": 1.0}
        (folder / "trajectories" / f"step_{s:06d}.jsonl").write_text(json.dumps(record) + "\n")
    (folder / "config.yaml").write_text("rollout:\n  n: 4\nactor:\n  lr: 0.001\n")
    return folder


def test_load_run_reads_metrics_steps_and_config(tmp_path):
    data = load_run(make_run(tmp_path / "run"))
    assert data["run"] == f"{tmp_path.name}/run" and [s["step"] for s in data["steps"]] == [1, 2, 3]
    assert data["config"] == {"rollout.n": 4, "actor.lr": 0.001}
    assert [r["check/logprob_abs_diff_mean"] for r in data["metrics"]] == [0.01, None, 0.01]  # NaN: a gap
    assert [s["step"] for s in load_run(tmp_path / "run", last=2)["steps"]] == [2, 3]
    json.dumps(data, allow_nan=False)  # strict JSON for the browser


def test_sample_metrics_over_policy_tokens_in_the_loss():
    episode = {"policy_version": 3, "versions": [3, -1, 2, 1], "mask": [1, 0, 1, 0],  # env token; a masked stale one
               "sampler_logprob": [-1.0, 0.0, -2.0, -9.0], "trainer_logprob": [-1.25, 0.0, -1.5, 0.0]}
    single = {"policy_version": 3, "versions": [3], "mask": [1], "sampler_logprob": [-0.5], "trainer_logprob": None}
    out = sample_metrics(7, [episode, single])
    assert out == {"step": 7, "sample/logprob_abs_diff_mean": 0.375, "sample/logprob_abs_diff_max": 0.5,
                   "sample/version_lag_mean": 1 / 3}  # lags 0, 1, 0; diffs 0.25, 0.5
    assert sample_metrics(1, [single]) == {"step": 1, "sample/version_lag_mean": 0.0}  # no trainer log-probs: no diff


def test_a_live_runs_half_written_last_line_is_left_out_a_bad_line_elsewhere_named(tmp_path):
    run = make_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "critic/sc')
    assert [r["step"] for r in load_run(run)["metrics"]] == [1, 2, 3]
    (run / "trajectories" / "step_000002.jsonl").write_text('{"step": 2\n{"step": 2, "row": 1}\n')
    with pytest.raises(RunFolderError, match=r"step_000002.jsonl:1: not valid JSON"):
        load_run(run)


def test_not_a_run_folder_is_refused_naming_what_is_missing(tmp_path):
    with pytest.raises(RunFolderError, match="not a directory"):
        load_run(tmp_path / "nowhere")
    with pytest.raises(RunFolderError, match=r"neither metrics.jsonl nor trajectories/step_\*.jsonl"):
        load_run(tmp_path)


def test_embedded_data_cannot_close_its_script_element():
    text = script_json({"pieces": ["</script><script>alert(1)</script>", "a&b"]})
    assert "</" not in text and "<" not in text and "&" not in text
    assert json.loads(text) == {"pieces": ["</script><script>alert(1)</script>", "a&b"]}


def test_page_is_self_contained(tmp_path):
    page = render_page(load_run(make_run(tmp_path / "run")))
    for fetches in ("<script src", 'rel="stylesheet"', 'src="http', 'href="http', "url(", "fetch(", "XMLHttpRequest",
                    "import("):
        assert fetches not in page, fetches  # the browser test also blocks and counts every request


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_server_binds_loopback_and_refuses_requests_without_the_token(tmp_path):
    server = InspectorServer(make_run(tmp_path / "run"))
    server.start()
    try:
        host, port = server.server_address
        assert host == "127.0.0.1"
        base = f"http://127.0.0.1:{port}"
        assert get(base + "/")[0] == 403
        assert get(base + "/?token=" + "x" * len(server.token))[0] == 403
        status, body = get(server.url)
        assert status == 200 and '"reward/score/mean":0.3' in body
        assert get(f"{base}/data?token={server.token}")[0] == 404
        with open(tmp_path / "run" / "metrics.jsonl", "a") as f:  # a live run: each load reads the folder again
            f.write(json.dumps({"step": 4, "reward/score/mean": 0.875}) + "\n")
        assert '"reward/score/mean":0.875' in get(server.url)[1]
    finally:
        server.shutdown()
        server.server_close()


def test_command_line_serves_at_the_url_it_prints(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "rlcore.inspect", str(make_run(tmp_path / "run")), "--serve"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "serving <folder> at <url>  (Ctrl-C stops)"
        url = re.search(r"at (http://127\.0\.0\.1:\d+/\?token=\S+)", line).group(1)
        assert get(url)[0] == 200 and get(url.split("?")[0])[0] == 403
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    busy = InspectorServer(tmp_path / "run")  # a port in use: an error naming it, not a traceback
    try:
        port = busy.server_address[1]
        out = subprocess.run([sys.executable, "-m", "rlcore.inspect", str(tmp_path / "run"), "--serve", "--port", str(port)],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and f"cannot serve on 127.0.0.1:{port}" in out.stderr
    finally:
        busy.server_close()


def test_command_line_writes_the_page_or_names_the_bad_folder(tmp_path):
    run = make_run(tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "rlcore.inspect", str(run), "--last", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == run / "inspector.html" and (run / "inspector.html").stat().st_size > 1000
    proc = subprocess.run([sys.executable, "-m", "rlcore.inspect", str(tmp_path / "missing")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is not a directory" in proc.stderr
