"""Pre-flight: a typo in any path, file or folder a run names fails before any worker or engine starts.

The recipe tests spy on the builder's placement (``_placed_group``, where every worker group is
built) and the warm start's SFT launch: the error must come with neither having been called, which
does not depend on how fast the machine is.
"""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import recipes.grpo
import rlcore.trainer.builder as builder
import rlcore.trainer.warmstart as warmstart
from rlcore.trainer.config import load_config
from rlcore.trainer.preflight import PreflightError, preflight

CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"

SECTIONS = recipes.grpo.SECTIONS


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def data(tmp_path):
    rows = [{"prompt": "1+2=", "answer": "3", "data_source": "arithmetic"}]
    return write_jsonl(tmp_path / "train.jsonl", rows), write_jsonl(tmp_path / "val.jsonl", rows)


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(solution_str.strip() == ground_truth)\n")
    return path


def cfg(tmp_path, data, model_dir, **sections):
    given = {"model": {"path": model_dir}, "data": {"train_files": data[0], "val_files": data[1]},
             "trainer": {"output_dir": str(tmp_path / "out"), "loggers": ["jsonl"]}}
    for name, values in sections.items():
        given.setdefault(name, {}).update(values)
    return load_config(given, SECTIONS)


def test_a_good_config_passes(tmp_path, data, model_dir, reward_file):
    preflight(cfg(tmp_path, data, model_dir, reward={"reward_fn": f"{reward_file}:compute_score"}))
    preflight(cfg(tmp_path, data, model_dir))  # no reward_fn: the rows' data_source "arithmetic" is registered


@pytest.mark.parametrize("reward_fn, message", [
    ("{dir}/my_rewrd.py:compute_score", r"reward.reward_fn: reward function file '.*my_rewrd.py' does not exist"),
    ("{dir}/my_reward.py:compute_scor", r"reward.reward_fn: '.*my_reward.py' defines no 'compute_scor'"),
    ("gsm8", r"reward.reward_fn: unknown reward function 'gsm8'"),
])
def test_each_reward_typo_is_named(tmp_path, data, model_dir, reward_file, reward_fn, message):
    with pytest.raises((FileNotFoundError, ValueError), match=message):
        preflight(cfg(tmp_path, data, model_dir, reward={"reward_fn": reward_fn.format(dir=tmp_path)}))


def test_data_typos_are_named(tmp_path, data, model_dir):
    with pytest.raises(PreflightError, match=r"data.train_files: dataset file not found: .*trian.jsonl"):
        preflight(cfg(tmp_path, (str(tmp_path / "trian.jsonl"), data[1]), model_dir))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"data.val_files: .*bad.jsonl:1: not a JSON object per line"):
        preflight(cfg(tmp_path, (data[0], str(bad)), model_dir))
    no_answer = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+2=", "answer": "3", "data_source": "arithmetic"}])
    with pytest.raises(ValueError, match=r"column\(s\) \['prompt'\] missing in the first row.*"
                                         r"columns present: \['answer', 'data_source', 'question'\]"):
        preflight(cfg(tmp_path, (no_answer, data[1]), model_dir))
    mine = write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "1+2=", "answer": "3", "data_source": "words_arith"}])
    with pytest.raises(ValueError, match=r"no reward function for the data's data_source 'words_arith' \(.*mine.jsonl, first in row 0\): set "
                                         r"reward.reward_fn"):
        preflight(cfg(tmp_path, (mine, mine), model_dir))


def test_folder_and_resume_typos_are_named(tmp_path, data, model_dir):
    c = cfg(tmp_path, data, model_dir)
    folder = tmp_path / "out" / c.trainer.project / c.trainer.run_name
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(PreflightError, match=r"run folder: .*holds another run \(metrics.jsonl\)"):
        preflight(c)
    assert (folder / "metrics.jsonl").exists()  # checked, nothing deleted
    preflight(cfg(tmp_path, data, model_dir, trainer={"overwrite": True}))
    assert (folder / "metrics.jsonl").exists()  # overwrite deletes when the run claims the folder, not here
    with pytest.raises(PreflightError, match=r"trainer.resume: resume path '.*global_step_7' is not a complete"):
        preflight(cfg(tmp_path, data, model_dir, trainer={"resume": str(folder / "checkpoints/global_step_7")}))


def test_several_problems_are_listed_together(tmp_path, data, model_dir):
    c = cfg(tmp_path, (str(tmp_path / "nope.jsonl"), data[1]), model_dir,
            reward={"reward_fn": f"{tmp_path}/nope.py:f"}, trainer={"resume": str(tmp_path / "global_step_1")})
    with pytest.raises(PreflightError) as err:
        preflight(c)
    message = str(err.value)
    assert message.startswith("3 problems found before start-up:")
    for part in ("data.train_files: dataset file not found", "reward.reward_fn: reward function file",
                 "trainer.resume: resume path"):
        assert part in message, message


def test_agent_path_typo_is_named(tmp_path, data, model_dir):
    given = {"model": {"path": model_dir}, "data": {"train_files": data[0], "val_files": data[1]},
             "trainer": {"output_dir": str(tmp_path / "out")}, "agent": {"path": f"{tmp_path}/agent.py:Agent"}}
    with pytest.raises(PreflightError, match=r"agent.path: agent file '.*agent.py' does not exist"):
        preflight(load_config(given, ["model", "data", "reward", "trainer", "agent"]))


@pytest.fixture
def no_workers(monkeypatch):
    """Records any worker group placement or warm-start launch: there must be none."""
    started = []
    monkeypatch.setattr(builder, "_placed_group", lambda *a, **k: started.append("workers") or pytest.fail("built"))
    monkeypatch.setattr(warmstart, "_run_recipe", lambda *a, **k: started.append("warm start") or pytest.fail("ran"))
    return started


def compose_grpo(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("grpo", overrides=[f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]",
                                          "trainer.backend=local", *overrides])


@pytest.mark.parametrize("with_model", [True, False])  # False: the warm start would come first
def test_recipe_fails_on_a_reward_typo_before_any_worker(tmp_path, model_dir, no_workers, with_model):
    model = [f"model.path={model_dir}"] if with_model else [f"warmstart.dir={tmp_path}/ws"]
    c = compose_grpo(tmp_path, *model, f"reward.reward_fn={tmp_path}/my_rewrd.py:compute_score")
    with pytest.raises(PreflightError, match="my_rewrd.py' does not exist"):
        recipes.grpo.train(c)
    assert no_workers == []


def test_recipe_fails_on_a_reused_run_folder_before_any_worker(tmp_path, model_dir, no_workers):
    folder = tmp_path / "grpo" / "default"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(PreflightError, match="holds another run"):
        recipes.grpo.train(compose_grpo(tmp_path, f"model.path={model_dir}"))
    assert no_workers == []


def test_each_entry_of_a_reward_list_is_checked(tmp_path, data, model_dir, reward_file):
    good = f"{reward_file}:compute_score"
    preflight(cfg(tmp_path, data, model_dir, reward={"reward_fn": [good, "gsm8k"], "weights": [1.0, 0.5]}))
    with pytest.raises(ValueError, match=r"reward.reward_fn\[1\]: unknown reward function 'gsm8'"):
        preflight(cfg(tmp_path, data, model_dir, reward={"reward_fn": [good, "gsm8"]}))
