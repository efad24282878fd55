"""A user's mistake at start-up is a few lines naming the key, the value and the fix, exit status 2, no
traceback (``rlcore.trainer.cli``); ``--debug`` or ``HYDRA_FULL_ERROR=1`` shows the traceback.

The recipe runs as a user runs it (``python -m recipes.ppo ...`` in a subprocess); each command fails in
its first seconds, before any worker, model or warm start (the pre-flight and the argument check come first).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.errors import UserError
from rlcore.trainer.cli import user_errors
from rlcore.trainer.config import ConfigError, load_config
from rlcore.trainer.preflight import PreflightError, preflight

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "data_source": "arithmetic"} for i in range(6)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def folder(tmp_path):
    """train.jsonl (good), words.jsonl (row 4 names a source nothing scores), bad.jsonl (row 2 has no prompt),
    reward.py (defines compute_score)."""
    write_jsonl(tmp_path / "data" / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "data" / "words.jsonl", [*ROWS[:4], {**ROWS[4], "data_source": "my_words"}, ROWS[5]])
    write_jsonl(tmp_path / "data" / "bad.jsonl", [ROWS[0], ROWS[1], {"answer": "3", "data_source": "arithmetic"}])
    (tmp_path / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return 0.0\n")
    return tmp_path


def ppo(folder: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RLCORE_DEBUG")}
    clean["PYTHONPATH"] = os.pathsep.join([str(ROOT), clean.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "recipes.ppo", f"trainer.output_dir={folder / 'out'}", *overrides],
                          cwd=folder, env={**clean, **env}, capture_output=True, text=True, timeout=300)


def assert_user_error(proc: subprocess.CompletedProcess, *lines: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr
    for line in lines:
        assert line in proc.stderr, proc.stderr
    assert proc.stderr.rstrip().endswith("(the traceback: run again with --debug)"), proc.stderr


def test_argument_problems_unknown_keys_a_refused_verl_key_a_bad_value_all_at_once(folder):
    proc = ppo(folder, "actor.lrr=1e-5", "trainer.totl_steps=3", "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
               "rollout.do_sample=maybe")
    assert_user_error(proc, "error: 4 problems:",
                      "  - actor_rollout_ref.rollout.val_kwargs.temperature is verl's key, which rlcore has no "
                      "counterpart for: validation decodes greedily",
                      "  - actor.lrr: no such key in actor (did you mean 'lr'?)",
                      "  - trainer.totl_steps: no such key in trainer (did you mean 'total_steps'?)",
                      "  - config key rollout.do_sample: Value 'maybe' is not a valid bool")


def test_preflight_problems_a_missing_file_a_bad_row_a_reward_typo_all_at_once(folder):
    proc = ppo(folder, "data.train_files=data/bad.jsonl", "data.val_files=data/trian.jsonl",
               "reward.reward_fn=reward.py:compute_scor")
    assert_user_error(proc, "error: 3 problems found before start-up:",
                      "  - data.train_files: data/bad.jsonl: column(s) ['prompt'] missing in row 2",
                      "  - data.val_files: dataset file not found: data/trian.jsonl "
                      f"(did you mean {folder / 'data' / 'train.jsonl'}?)",
                      "  - reward.reward_fn: 'reward.py' defines no 'compute_scor' (did you mean 'compute_score'?)")


def test_debug_shows_the_traceback(folder):
    proc = ppo(folder, "data.train_files=data/words.jsonl", "data.val_files=data/train.jsonl", "--debug")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr, proc.stderr
    assert "PreflightError: reward: no reward function for the data's data_source 'my_words'" in proc.stderr


def test_only_a_user_error_loses_its_traceback(capsys, monkeypatch):
    @user_errors
    def bad_key():
        raise ConfigError("actor.lrr: no such key in actor (did you mean 'lr'?)")

    @user_errors
    def bug():
        raise KeyError("an internal mistake")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("RLCORE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        bad_key()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == "error: actor.lrr: no such key in actor (did you mean 'lr'?)"
    with pytest.raises(KeyError, match="an internal mistake"):
        bug()
    for name in ("HYDRA_FULL_ERROR", "RLCORE_DEBUG"):  # either asks for the traceback: the error goes on up
        monkeypatch.setenv(name, "1")
        with pytest.raises(ConfigError):
            bad_key()
        monkeypatch.delenv(name)
    assert issubclass(PreflightError, UserError) and issubclass(PreflightError, ValueError)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_preflight_checks_every_data_source_not_only_the_first_rows(tmp_path, suffix):
    rows = [*ROWS, {**ROWS[0], "data_source": "my_words"}, {**ROWS[1], "data_source": "my_words"},
            {**ROWS[2], "data_source": "openai/gsm8k"}]  # verl's gsm8k source: scored by the built-in gsm8k
    path = tmp_path / f"train.{suffix}"
    if suffix == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        write_jsonl(path, rows)
    cfg = load_config({"data": {"train_files": str(path), "val_files": str(path)},
                       "trainer": {"output_dir": str(tmp_path / "out")}}, ["data", "reward", "trainer"])
    with pytest.raises(PreflightError) as err:
        preflight(cfg)
    assert err.value.problems == [  # the source once per file, at the first row that names it
        f"reward: no reward function for the data's data_source 'my_words' ({path}, first in row 6): set "
        "reward.reward_fn=<file.py>:<function> (or a registered name), or reward.reward_fn_by_source.my_words=<function>"]
    cfg.reward.reward_fn_by_source = {"my_words": "arithmetic"}
    preflight(cfg)
