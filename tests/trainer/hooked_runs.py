"""A recipe run in a subprocess with a test hook (a folder whose ``sitecustomize.py`` patches rlcore on
import, first on PYTHONPATH so Ray's workers inherit it), told by one environment variable where to
signal: the driver's pid (written to a file the hook reads) and the rest of the hook's spec."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_hooked(recipe: str, hook_dir: Path, env_var: str, tmp_path: Path, args: list[str],
               stop_at: str | None = None) -> subprocess.CompletedProcess:
    """``python -m recipes.<recipe> *args`` with the hook armed by ``env_var=<pid file>,<stop_at>``
    (disarmed when ``stop_at`` is None)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook_dir), str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop(env_var, None)
    pid_file = tmp_path / "driver.pid"
    if stop_at:
        env[env_var] = f"{pid_file},{stop_at}"
    proc = subprocess.Popen([sys.executable, "-m", f"recipes.{recipe}", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file.write_text(str(proc.pid))
    out_text, err_text = proc.communicate(timeout=500)  # a bound on a hang only
    return subprocess.CompletedProcess(proc.args, proc.returncode, out_text, err_text)
