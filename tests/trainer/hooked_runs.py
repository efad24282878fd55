"""A recipe run in a process of its own with a test hook (a folder whose ``sitecustomize.py`` patches rlcore
on import, first on PYTHONPATH so Ray's workers inherit it), told by one environment variable where to
signal: the driver's pid (written to a file the hook reads) and the rest of the hook's spec.

The hooks act in Ray's worker processes, which start fresh interpreters from the run's environment, so the
driver itself is a child of the preloaded interpreter (tests/preloaded_python.py): the run's own process,
exit status and signals, without paying torch's, Ray's and rlcore's imports once more."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_hooked(preloaded_python, recipe: str, hook_dir: Path, env_var: str, tmp_path: Path, args: list[str],
               stop_at: str | None = None) -> subprocess.CompletedProcess:
    """``python -m recipes.<recipe> *args`` with the hook armed by ``env_var=<pid file>,<stop_at>``
    (disarmed when ``stop_at`` is None)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook_dir), str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop(env_var, None)
    pid_file = tmp_path / "driver.pid"
    if stop_at:
        env[env_var] = f"{pid_file},{stop_at}"
    return preloaded_python.run(f"recipes.{recipe}", *args, cwd=REPO, env=env, pid_file=pid_file,
                                timeout=500)  # a bound on a hang only
