"""verl's parquet files read as they are: the chat prompt through the template, the nested
reward_model.ground_truth as the ground truth, extra_info carried to the reward; bad rows fail when
read, naming the file, the row and the key."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.data.dataset import PromptDataset, collate_prompts
from rlcore.models.tiny import build_char_tokenizer

INSTRUCTION = "let's think step by step and output the final answer after \"####\"."


def verl_gsm8k_row(index: int, question: str, answer: str, split: str = "train") -> dict:
    """One row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": f"{question} = {answer}\n#### {answer}",
                       "question": question},
    }


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()  # template: "<role>: <content>\n" per message, then "assistant: "


def test_verl_rows_read_as_they_are(tmp_path, tok):
    rows = [verl_gsm8k_row(0, "what is 2+3?", "5"), verl_gsm8k_row(1, "what is 10-4?", "6")]
    rows[1]["prompt"].insert(0, {"role": "system", "content": "be brief."})
    f = write_parquet(tmp_path / "train.parquet", rows)
    ds = PromptDataset(f, tok, max_prompt_length=256, apply_chat_template=False)  # the recipes' default

    expected = [f"user: what is 2+3? {INSTRUCTION}\nassistant: ",
                f"system: be brief.\nuser: what is 10-4? {INSTRUCTION}\nassistant: "]
    assert [item["raw_prompt"] for item in ds] == expected
    for item, text, row in zip(ds, expected, rows):
        assert item["input_ids"].tolist() == tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(item["input_ids"]) == text
        assert item["messages"] == row["prompt"]
        assert item["extra_info"] == row["extra_info"]
        assert item["data_source"] == "openai/gsm8k"
    assert [item["ground_truth"] for item in ds] == ["5", "6"]

    _, non_tensors = collate_prompts(list(ds), tok.pad_token_id)
    assert non_tensors["extra_info"][1] == {"split": "train", "index": 1, "answer": "what is 10-4? = 6\n#### 6",
                                            "question": "what is 10-4?"}


def test_verl_and_plain_files_in_one_dataset(tmp_path, tok):
    verl = write_parquet(tmp_path / "v.parquet", [verl_gsm8k_row(7, "1+1", "2")])
    plain = tmp_path / "p.jsonl"
    plain.write_text(json.dumps({"prompt": "3+4=", "answer": "7", "data_source": "arithmetic"}) + "\n")
    ds = PromptDataset([verl, plain], tok, max_prompt_length=128, apply_chat_template=False)
    assert [it["ground_truth"] for it in ds] == ["2", "7"]
    assert [it["raw_prompt"] for it in ds] == [f"user: 1+1 {INSTRUCTION}\nassistant: ", "3+4="]
    assert ds[1]["extra_info"] is None and ds[0]["extra_info"]["index"] == 7
    assert ds[1]["messages"] == [{"role": "user", "content": "3+4="}]
    _, non_tensors = collate_prompts(list(ds), tok.pad_token_id)  # same columns on every row
    assert list(non_tensors["extra_info"]) == [ds[0]["extra_info"], None]


def test_an_answer_column_wins_over_reward_model(tmp_path, tok):
    row = {**verl_gsm8k_row(0, "1+1", "2"), "answer": "11"}
    ds = PromptDataset(write_parquet(tmp_path / "a.parquet", [row]), tok, max_prompt_length=128)
    assert ds[0]["ground_truth"] == "11" and "extra_info" not in ds[0]


def bad(row_change):
    row = verl_gsm8k_row(1, "1+1", "2")
    row_change(row)
    return row


@pytest.mark.parametrize("row, message", [
    (bad(lambda r: r["reward_model"].pop("ground_truth")),
     r"row 1: 'reward_model.ground_truth' is missing or null .*reward_model has \['style'\]"),
    (bad(lambda r: r["reward_model"].update(ground_truth=None)), r"row 1: 'reward_model.ground_truth' is missing"),
    (bad(lambda r: r["reward_model"].update(ground_truth=" ")), r"row 1: 'reward_model.ground_truth' is an empty"),
    (bad(lambda r: r.update(reward_model="2")), r"row 1: 'reward_model' must be a dict"),
    (bad(lambda r: r["prompt"][0].pop("content")), r"row 1: prompt\[0\]\.content must be a string, got missing"),
    (bad(lambda r: r["prompt"][0].update(role=3)), r"row 1: prompt\[0\]\.role must be a non-empty string, got int 3"),
    (bad(lambda r: r["prompt"].append("and then")), r"row 1: prompt\[1\] must be a \{'role', 'content'\} message"),
    (bad(lambda r: r.update(prompt=[])), r"row 1: prompt is an empty list of messages"),
    (bad(lambda r: r.update(extra_info="train")), r"row 1: 'extra_info' must be a dict"),
    (bad(lambda r: r.pop("data_source")), r"column 'data_source' missing in .*bad.jsonl \(row 1\)"),
])
def test_bad_verl_rows_fail_when_read_naming_file_row_and_key(tmp_path, tok, row, message):
    f = tmp_path / "bad.jsonl"  # JSON lines: each row keeps exactly its own keys (parquet would unify them)
    f.write_text(json.dumps(verl_gsm8k_row(0, "1+2", "3")) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=message) as err:
        PromptDataset(f, tok, max_prompt_length=128)
    assert "bad.jsonl" in str(err.value)


def test_no_answer_anywhere_names_both_places(tmp_path, tok):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "1"}], "data_source": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"column 'answer' \(or verl's 'reward_model' column .*\) "
                                         r"missing in .*d\.jsonl"):
        PromptDataset(f, tok)


def test_chat_prompt_with_a_tokenizer_without_template_is_an_error(tmp_path):
    plain = build_char_tokenizer()
    plain.chat_template = None
    f = write_parquet(tmp_path / "v.parquet", [verl_gsm8k_row(0, "1+1", "2")])
    with pytest.raises(ValueError, match=r"v\.parquet row 0: prompt is a chat list but the tokenizer has "
                                         r"no chat_template"):
        PromptDataset(f, plain)
