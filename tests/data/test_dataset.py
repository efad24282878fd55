import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlcore.data.dataset import (
    PromptDataset,
    PromptLoader,
    ResumableBatchSampler,
    collate_prompts,
)
from rlcore.models.tiny import build_char_tokenizer

# build_char_tokenizer: <pad>=0, digits '0'..'9' = 4..13, '+'=14, '='=18, ' '=19, 'a'=20 ...


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def plain_tok():
    tok = build_char_tokenizer()
    tok.chat_template = None
    return tok


def test_string_prompts_without_template(tmp_path, plain_tok):
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1+2=", "answer": "3", "data_source": "arith"},
        {"prompt": "12=", "answer": "12", "data_source": "arith"},
    ])
    ds = PromptDataset(f, plain_tok, max_prompt_length=8)
    assert len(ds) == 2 and ds.num_filtered == 0
    assert ds[0]["input_ids"].tolist() == [5, 14, 6, 18]
    assert ds[0]["input_ids"].dtype == torch.long
    assert ds[1]["input_ids"].tolist() == [5, 6, 18]
    assert ds[0]["raw_prompt"] == "1+2=" and ds[0]["ground_truth"] == "3"
    assert ds[1]["data_source"] == "arith"


def test_chat_template_applied_to_chat_lists_and_strings(tmp_path):
    tok = build_char_tokenizer()  # template: "<role>: <content>\n" ... "assistant: "
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": [{"role": "user", "content": "1+1"}], "answer": "2", "data_source": "a"},
        {"prompt": "2+2", "answer": "4", "data_source": "a"},
    ])
    ds = PromptDataset(f, tok, max_prompt_length=64)
    assert ds[0]["raw_prompt"] == "user: 1+1\nassistant: "
    assert ds[1]["raw_prompt"] == "user: 2+2\nassistant: "
    assert len(ds[0]["input_ids"]) == len("user: 1+1\nassistant: ")
    assert tok.decode(ds[0]["input_ids"]) == "user: 1+1\nassistant: "


def test_chat_list_without_template_is_an_error(tmp_path, plain_tok):
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": [{"role": "user", "content": "1"}], "answer": "1", "data_source": "a"}])
    with pytest.raises(ValueError, match="chat_template"):
        PromptDataset(f, plain_tok)
    with pytest.raises(ValueError, match="chat_template"):
        PromptDataset(f, plain_tok, apply_chat_template=True)


def test_missing_column_names_column_file_and_present_columns(tmp_path, plain_tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"question": "1", "answer": "1", "data_source": "a"}])
    with pytest.raises(ValueError) as err:
        PromptDataset(f, plain_tok)
    msg = str(err.value)
    assert "'prompt'" in msg and "d.jsonl" in msg and "question" in msg
    g = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "1", "answer": "1"}])
    with pytest.raises(ValueError, match="'data_source'"):
        PromptDataset(g, plain_tok)
    assert len(PromptDataset(g, plain_tok, extra_keys=())) == 1


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+2=", "answer": None}, "row 1: 'answer' is null"),
    ({"prompt": "1+2=", "answer": float("nan")}, "row 1: 'answer' is null"),
    ({"prompt": "1+2=", "answer": "  "}, "row 1: 'answer' is an empty string"),
    ({"prompt": "1+2=", "answer": {"x": 1}}, "row 1: 'answer' must be a string or a number"),
    ({"prompt": "1+2=", "answer": True}, "row 1: 'answer' must be a string or a number"),
    ({"prompt": "1+2=", "answer": []}, "row 1: 'answer' is an empty list"),
    ({"prompt": "", "answer": "3"}, "row 1: the prompt is empty"),
    ({"prompt": None, "answer": "3"}, "row 1: prompt must be a string or a list"),
])
def test_bad_rows_fail_when_read_naming_file_and_row(tmp_path, plain_tok, row, message):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=message) as err:
        PromptDataset(f, plain_tok, extra_keys=())
    assert "d.jsonl" in str(err.value)


def test_numbers_and_lists_of_answers_are_fine(tmp_path, plain_tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+2=", "answer": 3}, {"prompt": "a", "answer": ["x", "y"]}])
    assert [r["ground_truth"] for r in PromptDataset(f, plain_tok, extra_keys=())] == [3, ["x", "y"]]


def test_overlong_prompts_filtered_and_counted_or_raise(tmp_path, plain_tok, caplog):
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1", "answer": "1", "data_source": "a"},
        {"prompt": "12345", "answer": "1", "data_source": "a"},
        {"prompt": "1234", "answer": "2", "data_source": "a"},
    ])
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset(f, plain_tok, max_prompt_length=4)
    assert ds.num_filtered == 1 and len(ds) == 2
    assert [it["raw_prompt"] for it in ds] == ["1", "1234"]
    assert "dropped 1 of 3" in caplog.text
    with pytest.raises(ValueError, match="prompt 1 has 5 tokens"):
        PromptDataset(f, plain_tok, max_prompt_length=4, filter_overlong=False)


def test_parquet_and_several_files(tmp_path, plain_tok):
    pq.write_table(pa.Table.from_pylist([
        {"q": "7", "sol": "7", "data_source": "p", "level": 3}]), tmp_path / "a.parquet")
    write_jsonl(tmp_path / "b.jsonl", [{"q": "8", "sol": "8", "data_source": "j", "level": 1}])
    ds = PromptDataset([tmp_path / "a.parquet", str(tmp_path / "b.jsonl")], plain_tok,
                       prompt_key="q", answer_key="sol", extra_keys=("data_source", "level"))
    assert [it["input_ids"].tolist() for it in ds] == [[11], [12]]
    assert [(it["data_source"], it["level"]) for it in ds] == [("p", 3), ("j", 1)]
    with pytest.raises(ValueError, match="'prompt'.*a.parquet.*'q'"):
        PromptDataset(tmp_path / "a.parquet", plain_tok)
    (tmp_path / "c.csv").write_text("x\n")
    with pytest.raises(ValueError, match=r"\.csv"):
        PromptDataset(tmp_path / "c.csv", plain_tok)


def test_collate_left_pads_with_positions_and_object_arrays():
    items = [
        {"input_ids": torch.tensor([7, 8, 9]), "raw_prompt": "abc", "ground_truth": "1",
         "data_source": "x"},
        {"input_ids": torch.tensor([5]), "raw_prompt": "d", "ground_truth": ["2", "3"],
         "data_source": "y"},
    ]
    tensors, non_tensors = collate_prompts(items, pad_token_id=0)
    assert tensors["input_ids"].tolist() == [[7, 8, 9], [0, 0, 5]]
    assert tensors["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert tensors["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert set(non_tensors) == {"raw_prompt", "ground_truth", "data_source"}
    assert non_tensors["raw_prompt"].dtype == object
    assert non_tensors["ground_truth"].shape == (2,)  # a list value stays one element
    assert non_tensors["ground_truth"][1] == ["2", "3"]
    assert non_tensors["data_source"].tolist() == ["x", "y"]
    with pytest.raises(ValueError, match="pad_token_id"):
        collate_prompts(items, pad_token_id=None)


def test_sampler_epochs_are_permutations_and_deterministic():
    s = ResumableBatchSampler(10, 3, shuffle=True, seed=5, num_epochs=2)
    batches = list(s)
    assert len(batches) == 6 and all(len(b) == 3 for b in batches)  # drop_last: 9 of 10 per epoch
    for epoch in (0, 1):
        seen = sum(batches[3 * epoch:3 * epoch + 3], [])
        assert len(set(seen)) == 9 and set(seen) <= set(range(10))
    assert batches[:3] != batches[3:]  # the two epochs differ
    assert list(ResumableBatchSampler(10, 3, seed=5, num_epochs=2)) == batches
    assert list(ResumableBatchSampler(10, 3, seed=6, num_epochs=2)) != batches
    ordered = list(ResumableBatchSampler(5, 2, shuffle=False, drop_last=False, num_epochs=1))
    assert ordered == [[0, 1], [2, 3], [4]]


def test_resumed_sampler_yields_exactly_the_remaining_batches():
    full = list(ResumableBatchSampler(7, 2, seed=1, num_epochs=3))  # 3 batches per epoch
    assert len(full) == 9

    run = ResumableBatchSampler(7, 2, seed=1, num_epochs=3)
    it = iter(run)
    first = [next(it) for _ in range(4)]  # one batch into epoch 1
    state = run.state_dict()
    assert (state["epoch"], state["position"]) == (1, 1)

    resumed = ResumableBatchSampler(7, 2, seed=1, num_epochs=3)
    resumed.load_state_dict(state)
    assert first + list(resumed) == full

    # a checkpoint taken right after the last batch of an epoch resumes with the next epoch
    run = ResumableBatchSampler(7, 2, seed=1, num_epochs=3)
    it = iter(run)
    [next(it) for _ in range(3)]
    resumed = ResumableBatchSampler(7, 2, seed=1, num_epochs=3)
    resumed.load_state_dict(run.state_dict())
    assert list(resumed) == full[3:]

    with pytest.raises(ValueError, match="seed"):
        ResumableBatchSampler(7, 2, seed=2).load_state_dict(state)


def test_endless_sampler_keeps_going():
    s = ResumableBatchSampler(4, 4, seed=0)
    it = iter(s)
    batches = [next(it) for _ in range(5)]
    assert all(sorted(b) == [0, 1, 2, 3] for b in batches)
    assert s.state_dict()["epoch"] == 4


def test_prompt_loader_batches_and_resume(tmp_path, plain_tok):
    rows = [{"prompt": str(i) * (i + 1), "answer": str(i), "data_source": "a"} for i in range(6)]
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", rows), plain_tok)
    loader = PromptLoader(ds, batch_size=2, seed=3, num_epochs=2)
    assert len(loader) == 3 and loader.total_steps == 6
    batches = list(loader)
    assert len(batches) == 6
    tensors, non_tensors = batches[0]
    lengths = [int(i) + 1 for i in non_tensors["ground_truth"]]  # prompt i has i+1 characters
    assert tensors["input_ids"].shape == (2, max(lengths))
    assert tensors["attention_mask"].sum(1).tolist() == lengths
    assert (tensors["input_ids"][tensors["attention_mask"] == 0] == plain_tok.pad_token_id).all()

    again = PromptLoader(ds, batch_size=2, seed=3, num_epochs=2)
    it = iter(again)
    next(it), next(it)
    resumed = PromptLoader(ds, batch_size=2, seed=3, num_epochs=2)
    resumed.load_state_dict(again.state_dict())
    rest = list(resumed)
    assert [b[1]["raw_prompt"].tolist() for b in rest] == \
        [b[1]["raw_prompt"].tolist() for b in batches[2:]]
    assert all(torch.equal(a[0]["input_ids"], b[0]["input_ids"]) for a, b in zip(rest, batches[2:]))


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="cannot fill one batch"):
        ResumableBatchSampler(3, 4)
    with pytest.raises(ValueError, match="batch_size"):
        ResumableBatchSampler(3, 0)
    assert len(ResumableBatchSampler(3, 4, drop_last=False)) == 1
