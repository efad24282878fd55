"""SFT's target: the answer by default, or the column ``data.response_key`` names (worked solutions),
tokenized exactly and closed by eos; a row without a usable target fails at load time by number."""

import json
import string

import numpy as np
import pytest
import torch

from recipes.sft import check_targets, sft_batch
from rlcore.data.dataset import PromptDataset, collate_prompts
from rlcore.models.tiny import build_char_tokenizer
from rlcore.protocol import DataProto


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(string.digits + string.ascii_letters + " +-*/=.?\n")


def prompts(tok, questions, **columns):
    items = [{"input_ids": torch.tensor(tok(q)["input_ids"])} for q in questions]
    tensors, _ = collate_prompts(items, tok.pad_token_id)
    return DataProto.from_dict(tensors, {k: np.array(v, dtype=object) for k, v in columns.items()})


def test_the_response_column_is_the_target_token_for_token_then_eos(tok):
    solutions = ["2 * 3 = 6.\nThe answer is 6.", "9 - 4 = 5.\nThe answer is 5."]
    batch = sft_batch(prompts(tok, ["a?", "bcd?"], ground_truth=["6", "5"], solution=solutions), tok, "solution")
    for row, text in enumerate(solutions):
        n = int(batch.batch["response_mask"][row].sum())
        ids = batch.batch["responses"][row, :n].tolist()
        assert ids == tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert (batch.batch["responses"][row, n:] == tok.pad_token_id).all()
    width = batch.batch["prompts"].shape[1]
    assert torch.equal(batch.batch["input_ids"][:, :width], batch.batch["prompts"])
    # positions continue from each prompt's last one through the response
    assert torch.equal(batch.batch["position_ids"][:, width], batch.batch["position_ids"][:, width - 1] + 1)


def test_without_a_response_key_the_answer_is_the_target(tok):
    batch = sft_batch(prompts(tok, ["a?"], ground_truth=["42"], solution=["4 * 10 = 40"]), tok)
    assert batch.batch["responses"][0].tolist() == tok("42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_a_row_without_a_usable_target_fails_at_load_time_naming_it(tok, tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2", "solution": "1 + 1 = 2"},
            {"prompt": "2+2=", "answer": "4", "solution": " "}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = PromptDataset(str(path), tok, extra_keys=("solution",), apply_chat_template=False)
    with pytest.raises(ValueError, match=r"response_key='solution': row 1 .* non-empty string"):
        check_targets(dataset, "solution")
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    with pytest.raises(ValueError, match=r"row 1.*solution"):
        PromptDataset(str(path), tok, extra_keys=("solution",), apply_chat_template=False)
