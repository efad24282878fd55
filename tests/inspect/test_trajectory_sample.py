"""The per-step trajectory sample (rlcore.trainer.trajectories): which rows, and that every field is the
batch's value for that row (hand-built batch, the tiny model's character tokenizer)."""

import json
import math

import numpy as np
import pytest
import torch

from rlcore.agentic.multi_turn import PER_CALL_VERSIONS
from rlcore.protocol import DataProto
from rlcore.trainer.config import TrainerConfig
from rlcore.trainer.trajectories import TrajectoryWriter, file_step, pick_groups, segments, step_file


def test_pick_groups_spreads_over_the_batch_first_and_last_always():
    uids = ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e"]
    assert pick_groups(uids, 2) == [[0, 1], [8, 9]]
    assert pick_groups(uids, 3) == [[0, 1], [4, 5], [8, 9]]
    assert pick_groups(uids, 1) == [[0, 1]]
    assert pick_groups(uids, 9) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert pick_groups(["x", "y", "x"], 1) == [[0, 2]]  # a group's rows wherever they are


def test_segments_from_versions_then_the_mask():
    # an episode: 2 policy tokens, 3 env tokens, 2 policy tokens of which one masked for staleness
    mask, versions = [1, 1, 0, 0, 0, 0, 1], [3, 3, -1, -1, -1, 2, 3]
    assert segments(mask, versions) == [["policy", 0, 2], ["env", 2, 5], ["policy", 5, 7]]
    assert segments(mask, None) == [["policy", 0, 2], ["env", 2, 6], ["policy", 6, 7]]  # no versions: the mask
    assert segments([], None) == []


def test_file_step_reads_only_step_files(tmp_path):
    assert file_step(step_file(tmp_path, 12)) == 12
    assert [file_step(tmp_path / n) for n in ("step_x.jsonl", "step_000001.tmp", "notes.jsonl")] == [None] * 3


def build_batch(tok):
    ids = lambda text: tok.convert_tokens_to_ids(list(text))  # noqa: E731 (character tokenizer)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    prompts = torch.tensor([[pad, *ids("1+")], [pad, *ids("1+")], ids("12+"), ids("12+"), ids("7+1"), ids("7+1")])
    prompt_attn = (prompts != pad).long()
    responses = torch.tensor([[*ids("2"), eos, pad], [*ids("3"), pad, pad], ids("999"), [*ids("4"), eos, pad],
                              [*ids("8"), eos, pad], [*ids("9"), eos, pad]])
    resp_attn = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    sampler = torch.tensor([[-0.5, -1.0, 0], [-2.0, 0, 0], [-0.1, -0.2, -0.3], [-1.5, -0.25, 0], [-1, -1, 0], [-1, -1, 0]])
    sampler[3, 1] = float("nan")
    scores = torch.zeros(6, 3)
    scores[0, 1], scores[2, 2] = 1.0, 0.5
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "response_mask": resp_attn,
                 "attention_mask": torch.cat([prompt_attn, resp_attn], 1),
                 "rollout_log_probs": sampler, "old_log_probs": sampler + 0.125,
                 "advantages": torch.tensor([[0.75] * 3, [-0.75] * 3, [0.5] * 3, [-0.5] * 3, [0.0] * 3, [0.0] * 3]),
                 "token_level_scores": scores},
        non_tensors={"uid": np.array(["g0", "g0", "g1", "g1", "g2", "g2"], dtype=object),
                     "data_source": np.array(["arith"] * 4 + ["other"] * 2, dtype=object),
                     "ground_truth": np.array(["3", "3", "15", "15", "8", "8"], dtype=object)})


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_writer_records_are_the_batch_values(tmp_path, model_dir, tok):
    writer = TrajectoryWriter(tmp_path / "trajectories", 2, model_dir)
    assert writer.write(5, build_batch(tok)) == 4  # groups g0 and g2: first and last
    rows = read(tmp_path / "trajectories" / "step_000005.jsonl")
    assert [(r["row"], r["group"], r["data_source"]) for r in rows] == [(0, "g0", "arith"), (1, "g0", "arith"),
                                                                        (4, "g2", "other"), (5, "g2", "other")]
    r0, r1 = rows[0], rows[1]
    assert r0["prompt_pieces"] == ["1", "+"] and r0["prompt_ids"] == tok.convert_tokens_to_ids(["1", "+"])
    assert r0["pieces"] == ["2", tok.decode([tok.eos_token_id])] and r0["length"] == 2 and r1["length"] == 1
    assert r0["sampler_logprob"] == [-0.5, -1.0] and r0["trainer_logprob"] == [-0.375, -0.875]
    assert r0["advantages"] == [0.75, 0.75] and r0["advantage"] == 0.75 and r1["advantage"] == -0.75
    assert r0["reward"] == 1.0 and r1["reward"] == 0.0 and r0["ground_truth"] == "3"
    assert r0["mask"] == [1, 1] and r0["segments"] == [["policy", 0, 2]]
    assert r0["versions"] == [4, 4] and r0["policy_version"] == 4  # synchronous: the policy after step 4
    assert not r0["truncated"] and not r1["truncated"]  # ended by eos / shorter than the longest


def test_writer_marks_cut_responses_and_non_finite_values(tmp_path, model_dir, tok):
    writer = TrajectoryWriter(tmp_path, 3, model_dir)
    writer.write(1, build_batch(tok))
    row2, row3 = [r for r in read(step_file(tmp_path, 1)) if r["group"] == "g1"]
    assert row2["truncated"] and row2["reward"] == 0.5  # full width, no eos: cut at the limit
    assert not row3["truncated"]
    assert row3["sampler_logprob"][1] is None and math.isclose(row3["sampler_logprob"][0], -1.5)


def test_async_rows_carry_the_version_that_sampled_them(tmp_path, model_dir, tok):
    batch = build_batch(tok)
    batch.non_tensor_batch["policy_version"] = np.array([2, 2, 2, 2, 1, 1], dtype=np.int64)
    TrajectoryWriter(tmp_path, 2, model_dir).write(4, batch)
    rows = read(step_file(tmp_path, 4))
    assert [(r["policy_version"], r["versions"]) for r in rows] == [(3, [2, 2]), (3, [2]), (3, [1, 1]), (3, [1, 1])]


def test_episode_rows_keep_their_versions_turns_and_source(tmp_path, model_dir, tok):
    batch = build_batch(tok)
    batch.batch["token_versions"] = torch.tensor([[2, -1, -1]] * 6)
    batch.non_tensor_batch["truncated"] = np.array([True] * 6)
    batch.non_tensor_batch["num_turns"] = np.array([2] * 6)
    batch.non_tensor_batch["episode"] = np.array(["e1"] * 6, dtype=object)
    del batch.non_tensor_batch["data_source"]
    TrajectoryWriter(tmp_path, 1, model_dir, default_source="arithmetic_retry").write(3, batch)
    r0 = read(step_file(tmp_path, 3))[0]
    assert r0["versions"] == [2, -1] and r0["segments"] == [["policy", 0, 1], ["env", 1, 2]]
    assert r0["truncated"] and r0["num_turns"] == 2 and r0["episode"] == "e1"
    assert r0["data_source"] == "arithmetic_retry"
    batch.meta_info[PER_CALL_VERSIONS] = True  # turn-lockstep episodes: version 0 is the call's weights
    batch.batch["token_versions"] = torch.tensor([[0, -1, -1]] * 6)
    TrajectoryWriter(tmp_path, 1, model_dir).write(3, batch)
    assert read(step_file(tmp_path, 3))[0]["versions"] == [2, -1]


def test_off_skips_and_resume_deletes_the_steps_run_again(tmp_path, model_dir, tok):
    folder = tmp_path / "trajectories"
    assert TrajectoryWriter(folder, 0, model_dir).write(1, build_batch(tok)) == 0 and not folder.exists()
    writer = TrajectoryWriter(folder, 1, model_dir)
    for step in (1, 2, 3):
        writer.write(step, build_batch(tok))
    pairs = DataProto.from_dict(tensors={"chosen_input_ids": torch.ones(2, 3, dtype=torch.long)})
    assert writer.write(4, pairs) == 0  # a reward model's pairs: no sampled responses
    TrajectoryWriter(folder, 1, model_dir, start_step=1)  # resumed from the step-1 checkpoint
    assert sorted(p.name for p in folder.iterdir()) == ["step_000001.jsonl"]


def test_negative_groups_are_refused_by_name():
    with pytest.raises(ValueError, match="trainer.trajectory_groups"):
        TrainerConfig(trajectory_groups=-1)
