"""``python -m rlcore.trainer.evaluate`` scores with the user's reward (a file's function, per-source
functions, a run's reward section) and refuses a data source no function scores before loading a model."""

import json

import pytest

import rlcore.trainer.evaluate as evaluate


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "data_source": "words_arith"})
                            + "\n" for a, b in ((1, 2), (3, 4), (5, 6))))
    return str(path)


@pytest.fixture
def reward_file(tmp_path):
    """A verl-style function: 1 for a response with a digit in it, and how long it is as an extra."""
    path = tmp_path / "my_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    assert data_source == 'words_arith'\n"
                    "    return float(any(c.isdigit() for c in solution_str))\n")
    return str(path)


def test_an_unknown_data_source_is_refused_before_any_model_loads(data, model_dir, monkeypatch):
    monkeypatch.setattr(evaluate, "build_engine", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(ValueError, match=r"no reward function for data_source \['words_arith'\]"):
        evaluate.main([model_dir, "--data", data, "--backend", "hf"])


def test_the_users_reward_file_scores_each_answer(data, model_dir, reward_file, tmp_path, capsys):
    out = tmp_path / "acc.json"
    evaluate.main([model_dir, "--data", data, "--backend", "hf", "--max-new-tokens", "4",
                   "--reward-fn", f"{reward_file}:compute_score", "--json", str(out)])
    [result] = json.loads(out.read_text())
    expected = [float(any(c.isdigit() for c in text)) for text in result["answers"]]
    assert result["accuracy"] == pytest.approx(sum(expected) / 3)
    assert "evaluating on 3 prompts (3 plain-string prompts through the tokenizer's chat template)" in \
        capsys.readouterr().out


def test_per_source_functions_and_a_runs_config(data, model_dir, reward_file, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("reward:\n  reward_fn_by_source:\n    words_arith: " + f"{reward_file}:compute_score\n"
                      "data:\n  apply_chat_template: false\n  prompt_key: prompt\n")
    out = tmp_path / "acc.json"
    args = [model_dir, "--data", data, "--backend", "hf", "--max-new-tokens", "4", "--json", str(out), "--show", "0"]
    evaluate.main([*args, "--run-config", str(config)])
    from_config = json.loads(out.read_text())[0]
    evaluate.main([*args, "--reward-fn-by-source", f"words_arith={reward_file}:compute_score"])
    from_flag = json.loads(out.read_text())[0]
    for result in (from_config, from_flag):
        assert result["accuracy"] == pytest.approx(sum(any(c.isdigit() for c in t) for t in result["answers"]) / 3)
    with pytest.raises(ValueError, match="--reward-fn-by-source takes SOURCE=FUNCTION"):
        evaluate.main([*args, "--reward-fn-by-source", "words_arith"])
    with pytest.raises(FileNotFoundError, match="--run-config .*nope.yaml: no such file"):
        evaluate.main([*args, "--run-config", str(tmp_path / "nope.yaml")])
