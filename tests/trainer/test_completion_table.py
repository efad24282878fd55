"""The completion table (rlcore.trainer.completion_table): which rows, each cell the batch's value (hand-built
batch, the tiny model's character tokenizer), when it is logged, and what TensorBoard, MLflow and W&B hold
afterwards, read back from their own files. trackio: tests/trainer/test_trackio_backend.py."""

import json

import mlflow.tracking as mlflow_tracking
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlcore.protocol import DataProto
from rlcore.trainer.completion_table import CompletionTable, pick_rows, reward_components, table_of
from rlcore.trainer.config import CompletionTableConfig
from rlcore.trainer.tracking import Tracker
from rlcore.trainer.tracking_backends.mlflow_backend import table_artifact
from rlcore.trainer.tracking_backends.tensorboard_backend import markdown_cell, markdown_table
from rlcore.trainer.trajectories import TokenPieces

COLUMNS = ["step", "data_source", "policy_version", "prompt", "response", "reward", "reward/format", "reward/note",
           "advantage"]
# step 7's table of the batch below at 3 rows, by hand: 2 groups of 2 (the first and the last), cut at 3
ROWS = [[7, "arith", 6, "1+", "2</s>", 1.0, 0.5, "ok", 0.75],
        [7, "arith", 6, "1+", "3", 0.0, None, "no answer", -0.75],
        [7, "other", 6, "7+1", "8</s>", 0.0, None, None, 0.0]]  # its format component is NaN: empty


def build_batch(tok):
    ids = lambda text: tok.convert_tokens_to_ids(list(text))  # noqa: E731 (character tokenizer)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    prompts = torch.tensor([[pad, *ids("1+")], [pad, *ids("1+")], ids("12+"), ids("12+"), ids("7+1"), ids("7+1")])
    responses = torch.tensor([[*ids("2"), eos, pad], [*ids("3"), pad, pad], ids("999"), [*ids("4"), eos, pad],
                              [*ids("8"), eos, pad], [*ids("9"), eos, pad]])
    resp_attn = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    scores = torch.zeros(6, 3)
    scores[0, 1], scores[2, 2] = 1.0, 0.5
    components = np.array([{"format": 0.5, "note": "ok"}, {"note": "no answer"}, None, 1.0, {"format": float("nan")},
                           {}], dtype=object)
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "response_mask": resp_attn,
                 "attention_mask": torch.cat([(prompts != pad).long(), resp_attn], 1),
                 "advantages": torch.tensor([[0.75] * 3, [-0.75] * 3, [0.5] * 3, [-0.5] * 3, [0.0] * 3, [0.0] * 3]),
                 "token_level_scores": scores},
        non_tensors={"uid": np.array(["g0", "g0", "g1", "g1", "g2", "g2"], dtype=object),
                     "data_source": np.array(["arith"] * 4 + ["other"] * 2, dtype=object),
                     "reward_components": components})


def test_pick_rows_takes_whole_groups_spread_over_the_batch_cut_at_n():
    uids = ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e"]
    assert pick_rows(uids, 3) == [0, 1, 8]  # 2 groups of 2 rows: the first and the last, cut at 3
    assert pick_rows(uids, 4) == [0, 1, 8, 9]
    assert pick_rows(uids, 16) == list(range(10))
    assert pick_rows(uids, 1) == [0] and pick_rows([], 4) == [] and pick_rows(uids, 0) == []


def test_reward_components_are_read_tolerantly():
    column = np.array([{"a": 1, "b": True}, None, 2.0, {"c": "x", "a": float("inf")}], dtype=object)
    names, rows = reward_components(column, [0, 1, 2, 3])
    assert names == ["a", "b", "c"]
    assert rows == [{"a": 1.0, "b": 1.0}, {}, {}, {"c": "x", "a": None}]
    assert reward_components(None, [0, 1]) == ([], [{}, {}])
    # one function per row (the reward manager's column with a single reward function): its score is the
    # reward column already, so no component columns
    assert reward_components(np.array([{"arithmetic": 1.0}, {"arithmetic": 0.0}], dtype=object), [0, 1]) == (
        [], [{"arithmetic": 1.0}, {"arithmetic": 0.0}])


def test_table_cells_are_the_batch_values(model_dir, tok):
    batch = build_batch(tok)
    columns, rows = table_of(batch, 7, 3, TokenPieces(tok), tok.eos_token_id)
    assert columns == COLUMNS and rows == ROWS
    batch.non_tensor_batch["policy_version"] = np.array([2, 2, 3, 3, 3, 3], dtype=np.int64)  # async: the sampler's
    del batch.non_tensor_batch["reward_components"], batch.non_tensor_batch["data_source"]
    columns, rows = table_of(batch, 7, 2, TokenPieces(tok), tok.eos_token_id, default_source="env")
    assert columns == ["step", "data_source", "policy_version", "prompt", "response", "reward", "advantage"]
    assert rows == [[7, "env", 2, "1+", "2</s>", 1.0, 0.75], [7, "env", 2, "1+", "3", 0.0, -0.75]]


def test_markdown_cells_show_model_text_as_written():
    assert markdown_cell("a|b\n<c> *x* _y_ [z](u) # &") == r"a\|b<br>&lt;c&gt; \*x\* \_y\_ \[z\](u) \# &amp;"
    assert markdown_cell(None) == "" and markdown_cell(1 / 3) == "0.3333" and markdown_cell(7) == "7"
    assert markdown_table(["a", "b_c"], [[1, None]]) == "| a | b\\_c |\n|---|---|\n| 1 |  |"


class Calls:
    """A stand-in for the writer's tokenizer loader that counts its calls."""

    def __init__(self, tok):
        self.tok, self.n = tok, 0

    def __call__(self):
        self.n += 1
        return TokenPieces(self.tok), self.tok.eos_token_id


def test_logged_every_n_steps_only_to_backends_that_show_tables(tmp_path, model_dir, tok):
    calls = Calls(tok)
    with Tracker(["jsonl"], log_dir=tmp_path / "plain") as tracker:
        table = CompletionTable(2, 3, tracker, calls)
        assert [table.log(step, build_batch(tok)) for step in (1, 2)] == [0, 0]
    assert calls.n == 0  # nothing shows tables: no tokenizer loaded, no table made
    with Tracker(["tensorboard"], log_dir=tmp_path / "tb") as tracker:
        table = CompletionTable(2, 3, tracker, calls)
        assert [table.log(step, build_batch(tok)) for step in (1, 2, 3, 4)] == [0, 3, 0, 3]
        pairs = DataProto.from_dict(tensors={"chosen_input_ids": torch.ones(2, 3, dtype=torch.long)})
        assert table.log(6, pairs) == 0 and table.log(8, None) == 0  # no sampled responses
        assert CompletionTable(0, 3, tracker, calls).log(2, build_batch(tok)) == 0  # off
    with pytest.raises(ValueError, match="trainer.completion_table.every"):
        CompletionTableConfig(every=-1)
    with pytest.raises(ValueError, match="trainer.completion_table.rows"):
        CompletionTableConfig(rows=0)


def test_a_row_of_the_wrong_width_is_refused(tmp_path):
    with Tracker(["tensorboard"], log_dir=tmp_path) as tracker:
        with pytest.raises(ValueError, match="table 't': row 1 has 1 cells for 2 columns"):
            tracker.log_table("t", ["a", "b"], [[1, 2], [3]], step=1)


def test_tensorboard_and_mlflow_hold_the_table(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with Tracker(["tensorboard", "mlflow"], project="proj", log_dir=tmp_path) as tracker:
        tracker.log({"loss": 1.0}, step=7)
        tracker.log_table("completions", COLUMNS, ROWS, step=7)
        tracker.log_table("completions", COLUMNS, ROWS[:1], step=9)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("completions/text_summary")
    assert [t.step for t in texts] == [7, 9]
    markdown = texts[0].tensor_proto.string_val[0].decode()
    assert markdown == markdown_table(COLUMNS, ROWS)
    assert markdown.splitlines()[2] == "| 7 | arith | 6 | 1+ | 2&lt;/s&gt; | 1 | 0.5 | ok | 0.75 |"  # by hand
    client = mlflow_tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "completions")) == [
        "completions/step_000007.json", "completions/step_000009.json"]
    assert table_artifact("completions", 7) == "completions/step_000007.json"
    local = client.download_artifacts(run.info.run_id, "completions/step_000007.json", str(tmp_path / "dl"))
    assert json.loads(open(local).read()) == {"columns": COLUMNS, "data": ROWS}


def test_wandb_offline_run_holds_the_table(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    with Tracker(["wandb"], project="proj", log_dir=tmp_path) as tracker:
        run_dir = tracker.backends["wandb"].run_dir
        tracker.log({"loss": 1.0}, step=7)
        tracker.log_table("completions", COLUMNS, ROWS, step=7)
    [table_file] = (run_dir / "files" / "media" / "table").glob("completions_7_*.table.json")
    assert json.loads(table_file.read_text()) == {"columns": COLUMNS, "data": ROWS}
