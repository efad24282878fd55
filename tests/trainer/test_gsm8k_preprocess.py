import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from recipes.data.gsm8k import INSTRUCTION, extract_final_answer, main
from rlcore.data.dataset import PromptDataset
from rlcore.models.tiny import build_char_tokenizer

REPO = Path(__file__).resolve().parents[2]

EXAMPLES = [
    {"question": "Tom has 3 apples and buys 4 more. How many?",
     "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A car costs $1,200 and a bike $300. Total?",
     "answer": "1200 + 300 = <<1200+300=1500>>1500\n#### 1,500"},
    {"question": "What is 10 - 12?", "answer": "10 - 12 = -2\n#### -2"},
]


def write_fixture(path):
    path.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    return path


def test_extract_final_answer():
    assert extract_final_answer("x\n#### 42") == "42"
    assert extract_final_answer("a #### 1 b\n#### 1,000,000 ") == "1000000"
    with pytest.raises(ValueError, match="no '####'"):
        extract_final_answer("the answer is 4")


def test_with_separate_test_file(tmp_path):
    src = write_fixture(tmp_path / "train.jsonl")
    test_src = tmp_path / "test.jsonl"
    test_src.write_text(json.dumps(EXAMPLES[2]) + "\n")
    out = main(["--input", str(src), "--test_input", str(test_src),
                "--output_dir", str(tmp_path / "out")])
    train = pq.read_table(out["train"])
    assert train.column_names == ["prompt", "answer", "data_source"]
    rows = train.to_pylist()
    assert [r["answer"] for r in rows] == ["7", "1500", "-2"]
    assert rows[0]["prompt"] == [{"role": "user", "content":
                                  "Tom has 3 apples and buys 4 more. How many? "
                                  "Let's think step by step and output the final answer "
                                  "after '####'."}]
    assert {r["data_source"] for r in rows} == {"gsm8k"}
    assert pq.read_table(out["test"]).to_pylist()[0]["answer"] == "-2"


def test_module_cli_splits_and_output_loads_as_prompt_dataset(tmp_path):
    src = write_fixture(tmp_path / "gsm8k.jsonl")
    out_dir = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "recipes.data.gsm8k", "--input", str(src),
                    "--output_dir", str(out_dir), "--test_size", "0.3"],
                   check=True, cwd=REPO, capture_output=True, timeout=120)
    train = pq.read_table(out_dir / "train.parquet").to_pylist()
    test = pq.read_table(out_dir / "test.parquet").to_pylist()
    assert (len(train), len(test)) == (2, 1)  # round(3 * 0.3) = 1 held out
    assert sorted(r["answer"] for r in train + test) == ["-2", "1500", "7"]

    tok = build_char_tokenizer()
    ds = PromptDataset(out_dir / "train.parquet", tok, max_prompt_length=256)
    assert len(ds) == 2
    assert ds[0]["raw_prompt"].startswith("user: ")
    assert ds[0]["raw_prompt"].endswith(f"{INSTRUCTION}\nassistant: ")
    assert ds[0]["data_source"] == "gsm8k"


def test_bad_input_names_the_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(EXAMPLES[0]) + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field 'answer'"):
        main(["--input", str(src), "--output_dir", str(tmp_path / "o")])
    src.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*no '####'"):
        main(["--input", str(src), "--output_dir", str(tmp_path / "o")])
