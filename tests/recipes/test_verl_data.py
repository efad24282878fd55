"""GRPO trained on a verl parquet file as verl's examples/data_preprocess/gsm8k.py lays it out (chat
prompts, reward_model.ground_truth, extra_info), given as data.train_files with no other change: the
prompts trained on are the chat template's rendering of each row's messages, and every reward is the
gsm8k checker's score of that row's response against that row's answer; then the same data scored by
a verl-signature compute_score file, whose dict entries are logged as metrics."""

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer

import recipes.grpo
from rlcore.models.tiny import build_tiny_model
from rlcore.rewards.manager import RuleRewardManager
from rlcore.rewards.registry import gsm8k_reward
from rlcore.trainer.tracking import read_jsonl_metrics

pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
INSTRUCTION = "let's think step by step and output the final answer after \"####\"."
PROBLEMS = [(a, b) for a in range(1, 5) for b in range(1, 4)]  # sums 2..7: one digit, so a guess can hit


def verl_rows(problems, split: str, first_index: int) -> list[dict]:
    """Rows as verl's gsm8k preprocessing writes them (lower case: the tiny tokenizer has no capitals)."""
    rows = []
    for k, (a, b) in enumerate(problems):
        question = f"what is {a}+{b}?"
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": first_index + k, "answer": f"{a}+{b}={a + b}\n#### {a + b}",
                           "question": question},
        })
    return rows


@pytest.fixture(scope="module")
def verl_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verl_gsm8k")
    train, val = verl_rows(PROBLEMS[:8], "train", 0), verl_rows(PROBLEMS[8:], "test", 100)
    pq.write_table(pa.Table.from_pylist(train), folder / "train.parquet")
    pq.write_table(pa.Table.from_pylist(val), folder / "test.parquet")
    return folder / "train.parquet", folder / "test.parquet", {r["extra_info"]["index"]: r for r in train + val}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("verl_model"), hidden_size=32, num_heads=2, num_kv_heads=1)


def run_grpo(tmp_path, tiny_model, verl_files, *extra):
    train, val, _ = verl_files
    overrides = [f"model.path={tiny_model}", f"trainer.output_dir={tmp_path}", "trainer.backend=local",
                 "trainer.loggers=[jsonl]", "trainer.total_steps=2", "trainer.val_freq=2", "trainer.save_freq=0",
                 f"data.train_files={train}", f"data.val_files={val}", "data.max_prompt_length=128",
                 "data.train_batch_size=4", "rollout.n=4", "rollout.max_new_tokens=6",
                 "actor.ppo_micro_batch_size_per_gpu=16", *extra]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("grpo", overrides=overrides)
    return recipes.grpo.train(cfg)


@pytest.fixture
def scored(monkeypatch):
    """Every (batch, reward output) the recipe's reward manager sees, training and validation."""
    calls = []
    score = RuleRewardManager.score

    def recording(self, data, index_offset=0):
        out = score(self, data, index_offset)
        calls.append((data, out))
        return out

    monkeypatch.setattr(RuleRewardManager, "score", recording)
    return calls


def test_grpo_trains_on_verl_parquet_as_it_is(tmp_path, tiny_model, verl_files, scored):
    rows = verl_files[2]
    run = run_grpo(tmp_path, tiny_model, verl_files, "+reward.reward_kwargs.method=flexible")  # data_source routes
    tok = AutoTokenizer.from_pretrained(tiny_model)

    metrics = read_jsonl_metrics(run.dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in metrics[1:])
    train_calls = [(d, o) for d, o in scored if not d.meta_info.get("validate")]
    assert len(train_calls) == 2 and len(scored) == 4  # 2 steps; validation before step 1 and at step 2

    hits = checked = 0
    for data, out in scored:
        prompts, mask = data.batch["prompts"], data.batch["attention_mask"][:, : data.batch["prompts"].shape[1]]
        for i in range(len(data)):
            row = rows[data.non_tensor_batch["extra_info"][i]["index"]]
            assert data.non_tensor_batch["extra_info"][i] == row["extra_info"]
            rendered = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            assert rendered == f"user: {row['prompt'][0]['content']}\nassistant: "
            assert prompts[i][mask[i].bool()].tolist() == tok(rendered, add_special_tokens=False)["input_ids"]
            text = out.non_tensor_batch["response_text"][i]
            expected = gsm8k_reward(text, row["reward_model"]["ground_truth"], method="flexible")
            assert out.batch["reward_scores"][i].item() == expected, (text, row["reward_model"])
            hits, checked = hits + int(expected == 1.0), checked + 1
    assert checked == 2 * 4 * 4 + 2 * 4  # 2 steps x 4 prompts x 4 samples, 2 validations x 4 prompts
    train_scores = torch.cat([o.batch["reward_scores"] for _, o in train_calls])
    assert 0 < hits and train_scores.min() == 0.0  # a mix: the equality above is not just 0 == 0
    assert metrics[1]["reward/score/mean"] == pytest.approx(train_calls[0][1].batch["reward_scores"].mean().item())


def test_a_verl_compute_score_file_scores_the_same_rows(tmp_path, tiny_model, verl_files, scored):
    reward_file = tmp_path / "verl_reward.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    digits = [c for c in solution_str if c.isdigit()]\n"
        "    hit = float(bool(digits) and digits[-1] == ground_truth)\n"
        "    return {'score': hit + (0.5 if extra_info['split'] == 'train' else 0.0), 'acc': hit}\n")
    run = run_grpo(tmp_path, tiny_model, verl_files, f"reward.reward_fn={reward_file}:compute_score")
    metrics = read_jsonl_metrics(run.dir / "metrics.jsonl")
    assert len(scored) == 4
    for data, out in scored:
        hits = []
        for i, text in enumerate(out.non_tensor_batch["response_text"]):
            info, truth = data.non_tensor_batch["extra_info"][i], data.non_tensor_batch["ground_truth"][i]
            digits = [c for c in text if c.isdigit()]
            hits.append(float(bool(digits) and digits[-1] == truth))
            assert out.batch["reward_scores"][i].item() == hits[-1] + (0.5 if info["split"] == "train" else 0.0)
        assert out.meta_info["reward/extra/acc/mean"] == pytest.approx(sum(hits) / len(hits))
    assert [r["step"] for r in metrics] == [0, 1, 2]
    assert all("reward/extra/acc/mean" in r for r in metrics[1:])  # logged with each training step's metrics
