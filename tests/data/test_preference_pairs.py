"""rlcore.data.preference: arithmetic pairs (right vs wrong, per kind), the pair dataset's token ids
and layout against hand-written ones, and bad rows named by file and row."""

import json

import pytest
import torch

from rlcore.data.arithmetic import make_split
from rlcore.data.dataset import PromptLoader
from rlcore.data.preference import (
    PAIR_KINDS,
    PairDataset,
    collate_pairs,
    make_arithmetic_pairs,
    write_pairs_jsonl,
    write_pairs_parquet,
)
from rlcore.models.tiny import build_char_tokenizer
from rlcore.rewards.registry import arithmetic_reward

# build_char_tokenizer: <pad>=0, </s>=2, digits '0'..'9' = 4..13, '+'=14, '='=18


@pytest.fixture
def tok():
    tok = build_char_tokenizer()
    tok.chat_template = None
    return tok


def test_arithmetic_pairs_put_the_answer_above_a_wrong_one_of_every_kind():
    rows, _ = make_split(200, 0, seed=0, max_operand=19, ops="+")
    pairs = make_arithmetic_pairs(rows, seed=1)
    assert len(pairs) == 3 * len(rows) and [p["kind"] for p in pairs[:3]] == list(PAIR_KINDS)
    assert pairs == make_arithmetic_pairs(rows, seed=1) and pairs != make_arithmetic_pairs(rows, seed=2)
    for row, group in zip(rows, (pairs[i:i + 3] for i in range(0, len(pairs), 3))):
        for p in group:
            assert p["prompt"] == row["prompt"] and p["chosen"] == row["answer"]
            # the rule ranks every pair the same way: the chosen is right, the rejected is not
            assert arithmetic_reward(p["chosen"], row["answer"]) == 1.0
            assert arithmetic_reward(p["rejected"], row["answer"]) == 0.0
        digit, random_number, _ = (p["rejected"] for p in group)
        differing = [(a, b) for a, b in zip(row["answer"], digit) if a != b]
        assert len(digit) == len(row["answer"]) and len(differing) == 1
        assert abs(int(differing[0][0]) - int(differing[0][1])) == 1  # one digit, off by one
        assert not (len(digit) > 1 and digit[0] == "0")
        assert random_number.isdigit() and 0 <= int(random_number) <= 38
    malformed = {p["rejected"] for p in pairs if p["kind"] == "malformed"}
    assert "" in malformed and any(m.startswith("0") for m in malformed) and any("+" in m for m in malformed)
    with pytest.raises(ValueError, match="pair kinds"):
        make_arithmetic_pairs(rows, seed=0, kinds=("typo",))


def test_dense_arithmetic_pairs_hold_every_wrong_answer_of_each_kind():
    rows = [{"prompt": "12+3=", "answer": "15"}, {"prompt": "0+4=", "answer": "4"}, {"prompt": "19+19=", "answer": "38"}]
    pairs = make_arithmetic_pairs(rows, seed=3, dense=True, n_random=5)
    assert pairs == make_arithmetic_pairs(rows, seed=3, dense=True, n_random=5)
    by_problem = {r["prompt"]: [p for p in pairs if p["prompt"] == r["prompt"]] for r in rows}
    # by hand: 15 -> 05 is a leading zero, so 25, 14, 16; 4 -> 3, 5; 38 -> 28, 48, 37, 39
    expected_digits = {"12+3=": ["25", "14", "16"], "0+4=": ["3", "5"], "19+19=": ["28", "48", "37", "39"]}
    for row in rows:
        group = by_problem[row["prompt"]]
        assert all(p["chosen"] == row["answer"] for p in group)
        assert [p["rejected"] for p in group if p["kind"] == "digit"] == expected_digits[row["prompt"]]
        randoms = [p["rejected"] for p in group if p["kind"] == "random"]
        assert len(randoms) == len(set(randoms)) == 5
        assert all(0 <= int(v) <= 38 and v != row["answer"] and v not in expected_digits[row["prompt"]] for v in randoms)
        malformed = [p["rejected"] for p in group if p["kind"] == "malformed"]
        assert malformed[0] == "" and malformed[2] == "0" + row["answer"] and malformed[3] == row["prompt"][:-1]
        assert malformed[1][:-1] == row["answer"] and malformed[1][-1] in "+-="
        assert all(arithmetic_reward(p["rejected"], row["answer"]) == 0.0 for p in group)
    only_digits = make_arithmetic_pairs(rows, seed=3, kinds=("digit",), dense=True)
    assert [p["rejected"] for p in only_digits] == sum(expected_digits.values(), [])
    with pytest.raises(ValueError, match="n_random"):
        make_arithmetic_pairs(rows, seed=0, dense=True, n_random=-1)


def test_pair_tokens_and_layout_by_hand(tmp_path, tok):
    f = write_pairs_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "1+2=", "chosen": "3", "rejected": "13", "kind": "digit"},
        {"prompt": "12=", "chosen": "12", "rejected": ""},
    ])
    ds = PairDataset(f, tok)
    assert len(ds) == 2 and ds.num_filtered == 0
    assert ds[0]["chosen"].tolist() == [5, 14, 6, 18, 7, 2]  # prompt, "3", eos
    assert ds[0]["rejected"].tolist() == [5, 14, 6, 18, 5, 7, 2]
    assert ds[1]["rejected"].tolist() == [5, 6, 18, 2] and ds[1]["kind"] == ""  # an empty response: eos alone
    t, nt = collate_pairs([ds[0], ds[1]], tok.pad_token_id)
    assert {k: tuple(v.shape) for k, v in t.items()} == {k: (2, 2, 7) for k in t}
    assert t["input_ids"][1].tolist() == [[5, 6, 18, 5, 6, 2, 0], [5, 6, 18, 2, 0, 0, 0]]
    assert t["attention_mask"][1].tolist() == [[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0]]
    assert t["response_mask"][0].tolist() == [[0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]]
    assert t["response_mask"][1].tolist() == [[0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0, 0]]
    assert t["position_ids"][1, 1].tolist() == [0, 1, 2, 3, 3, 3, 3]
    assert nt["kind"].tolist() == ["digit", ""] and nt["raw_prompt"].tolist() == ["1+2=", "12="]


def test_parquet_pairs_and_long_prompts_dropped(tmp_path, tok):
    f = write_pairs_parquet(tmp_path / "p.parquet", [{"prompt": "1+2=", "chosen": "3", "rejected": "4"},
                                                     {"prompt": "11+12=", "chosen": "23", "rejected": "24"}])
    ds = PairDataset([f], tok, max_prompt_length=5)
    assert len(ds) == 1 and ds.num_filtered == 1 and ds[0]["rejected"].tolist() == [5, 14, 6, 18, 8, 2]


def test_loader_yields_pair_batches_and_resumes(tmp_path, tok):
    rows, _ = make_split(8, 0, seed=0, max_operand=9, ops="+")
    ds = PairDataset(write_pairs_jsonl(tmp_path / "p.jsonl", make_arithmetic_pairs(rows, seed=0)), tok)
    loader = PromptLoader(ds, 4, seed=3, collate=collate_pairs)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    expected = next(it)
    again = PromptLoader(ds, 4, seed=3, collate=collate_pairs)
    again.load_state_dict(state)
    got = next(iter(again))
    assert got[0]["input_ids"].shape[:2] == (4, 2) and torch.equal(got[0]["input_ids"], expected[0]["input_ids"])


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+2=", "chosen": "3"}, r"column 'rejected' missing in .*bad\.jsonl \(row 1\)"),
    ({"prompt": "1+2=", "chosen": 3, "rejected": "4"}, r"bad\.jsonl row 1: 'chosen' must be a string .* int 3"),
    ({"prompt": "1+2=", "chosen": "3", "rejected": "3"}, r"bad\.jsonl row 1: chosen and rejected are the same"),
    ({"prompt": " ", "chosen": "3", "rejected": "4"}, r"bad\.jsonl row 1: 'prompt' must be a non-empty string"),
    ({"prompt": "1+2=", "chosen": "3", "rejected": None}, r"bad\.jsonl row 1: 'rejected' must be a string"),
    ({"prompt": "1+2=", "chosen": "3", "rejected": "4", "kind": 7}, r"bad\.jsonl row 1: 'kind' must be a string"),
])
def test_bad_rows_name_file_and_row(tmp_path, tok, row, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "2+2=", "chosen": "4", "rejected": "5"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=message):
        PairDataset(f, tok)
