"""Data building from config (arithmetic files written once, given files used as they are, batches
for validation), and the in-process worker group of a recipe's roles."""

import json

import pytest
import torch

from rlcore.models.tiny import build_char_tokenizer, build_tiny_model
from rlcore.trainer.builder import build_data, build_workers, data_files
from rlcore.trainer.config import load_config

SECTIONS = ("model", "actor", "rollout", "data", "trainer")
TOK = build_char_tokenizer()


def cfg(tmp_path, **sections):
    base = {"trainer": {"output_dir": str(tmp_path), "backend": "local"},
            "data": {"train_batch_size": 4, "arithmetic": {"n_train": 12, "n_val": 5}}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return load_config(base, SECTIONS)


def test_arithmetic_split_is_written_once_per_setting(tmp_path):
    train, val = data_files(cfg(tmp_path))
    rows = [json.loads(line) for line in open(train)]
    assert len(rows) == 12 and len(open(val).readlines()) == 5
    assert {r["data_source"] for r in rows} == {"arithmetic"}
    stamp = (tmp_path / train).stat().st_mtime_ns
    assert data_files(cfg(tmp_path)) == (train, val)  # same setting: same files, not rewritten
    assert (tmp_path / train).stat().st_mtime_ns == stamp
    other, _ = data_files(cfg(tmp_path, data={"arithmetic": {"n_train": 12, "n_val": 5, "max_operand": 9}}))
    assert other != train


def test_given_files_are_used_and_half_given_is_an_error(tmp_path):
    assert data_files(cfg(tmp_path, data={"train_files": ["a.jsonl", "b.jsonl"], "val_files": "c.jsonl"})) == (
        ["a.jsonl", "b.jsonl"], "c.jsonl")
    with pytest.raises(ValueError, match="data.val_files is required"):
        data_files(cfg(tmp_path, data={"train_files": "a.jsonl"}))
    with pytest.raises(ValueError, match="data.val_files is set but data.train_files is not"):
        data_files(cfg(tmp_path, data={"val_files": "c.jsonl"}))


def test_build_data_left_pads_names_prompts_and_splits_validation(tmp_path):
    loader, val = build_data(cfg(tmp_path, data={"val_batch_size": 2}), TOK)
    tensors, non_tensors = next(iter(loader))
    assert tensors["input_ids"].shape[0] == 4 and bool(tensors["attention_mask"][:, -1].all())
    assert [len(b) for b in val] == [2, 2, 1]
    assert all(b.meta_info == {"validate": True} for b in val)
    assert list(val[0].non_tensor_batch["uid"]) == ["0", "1"]
    first = val[0].non_tensor_batch["raw_prompt"][0]
    ids = val[0].batch["input_ids"][0][val[0].batch["attention_mask"][0].bool()]
    assert TOK.decode(ids) == first and first.endswith("=")


def test_build_workers_local_colocates_the_roles_in_this_process(tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "m", hidden_size=64, num_heads=2, num_kv_heads=1)
    threads = torch.get_num_threads()
    torch._C.set_num_threads(2)
    # What a vLLM CPU engine started earlier in this process does: torch.set_num_threads becomes a no-op.
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    workers = build_workers(cfg(tmp_path, model={"path": model}, trainer={"cpus_per_proc": 1}), ["actor", "rollout"])
    try:
        assert workers.ref is None and workers.critic is None and set(workers.trained) == {"actor"}
        actor, rollout = workers.group.worker(0, "actor"), workers.group.worker(0, "rollout")
        assert rollout.colocated_workers["actor"] is actor  # the hybrid engine: one process, in-memory sync
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="roles must include 'actor'"):
            build_workers(cfg(tmp_path, model={"path": model}), ["rollout"])
        with pytest.raises(ValueError, match="trainer.procs_per_node=1"):
            build_workers(cfg(tmp_path, model={"path": model}, trainer={"procs_per_node": 2}), ["actor"])
    finally:
        workers.shutdown()
        torch._C.set_num_threads(threads)  # the builtin: an earlier vLLM engine may have patched the wrapper


def test_the_reward_extra_keys_columns_reach_the_batches(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "data_source": "arithmetic", "level": i} for i in range(4)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config({"trainer": {"output_dir": str(tmp_path), "backend": "local"},
                          "data": {"train_files": str(path), "val_files": str(path), "train_batch_size": 4},
                          "reward": {"extra_keys": ["level"]}}, (*SECTIONS, "reward"))
    _, val = build_data(config, TOK)
    assert sorted(val[0].non_tensor_batch["level"]) == [0, 1, 2, 3]  # what the reward function is given by name
