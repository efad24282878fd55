"""``scripts/setup.sh`` prints one line per phase with its time and keeps apt's and pip's output in a log
(``scripts/setup_phase.sh``); a failing phase names the log and prints its last lines, and the set-up
stops with that phase's exit status. Real bash, real commands; nothing is installed."""

import re
import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def bash(script: str, log: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail; SETUP_LOG={log}; . {SCRIPTS / 'setup_phase.sh'}\n"
                           + script], capture_output=True, text=True, timeout=60)


def test_the_setup_script_parses():
    for name in ("setup.sh", "setup_phase.sh"):
        subprocess.run(["bash", "-n", str(SCRIPTS / name)], check=True, timeout=60)


def test_a_phase_is_one_line_and_its_output_goes_to_the_log(tmp_path):
    log = tmp_path / "setup.log"
    proc = bash("noisy() { seq 300; echo 'a warning' >&2; }\n"
                "phase 'a noisy step' noisy\n"
                "phase 'a step reading a here-document' cat <<'END'\nfrom stdin\nEND\n"
                "echo after", log)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and lines[2] == "after", proc.stdout
    assert re.fullmatch(r"a noisy step +ok +\d+\.\ds", lines[0]) and "ok" in lines[1], lines
    assert proc.stderr == ""
    logged = log.read_text()
    assert "300\n" in logged and "a warning\n" in logged and "from stdin\n" in logged


def test_a_failing_phase_names_the_log_shows_its_end_and_stops(tmp_path):
    log = tmp_path / "setup.log"
    proc = bash("broken() { seq 100; echo 'ERROR: no matching distribution' >&2; return 3; }\n"
                "phase 'fine' true\nphase 'a failing step' broken\necho 'never printed'", log)
    assert proc.returncode == 3
    assert "never printed" not in proc.stdout
    assert re.search(r"a failing step +FAILED \(exit 3\) after \d+\.\ds", proc.stdout), proc.stdout
    err = proc.stderr.splitlines()
    assert err[0] == 'setup failed in "a failing step" (broken)'
    assert err[1] == f"the full log: {log}; its last 25 lines:"
    assert err[2:] == [f"  | {i}" for i in range(77, 101)] + ["  | ERROR: no matching distribution"]
