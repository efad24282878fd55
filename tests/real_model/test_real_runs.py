"""The real model through the recipes' own path, kept short for the suite (the long, learning runs are
the README's documented commands): the actor's chunked log-probs at a 49k vocabulary against the full
logits, one GRPO step of ``+preset=smollm2`` end to end, and an exported checkpoint that loads in
transformers and vLLM and answers better than the base model."""

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

import recipes.grpo
import recipes.sft
from rlcore.data.dataset import PromptDataset, collate_prompts
from rlcore.data.word_problems import make_word_problems, write_jsonl
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.protocol import DataProto
from rlcore.trainer.evaluate import answer
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.workers.actor import ActorWorker

pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"


def compose_recipe(name, tmp_path, *overrides):
    base = ["+preset=smollm2", f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]", "trainer.backend=local"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(name, overrides=[*base, *overrides])


def test_actor_log_probs_at_the_real_vocabulary_equal_the_full_logits(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rows = make_word_problems("arithmetic_words", 3, seed=5)
    prompts = [torch.tensor(tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]) for r in rows]
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(10, 49152, (3, 12), generator=g)
    tensors, _ = collate_prompts([{"input_ids": p} for p in prompts], tok.pad_token_id)
    mask = torch.cat([tensors["attention_mask"], torch.ones_like(responses)], 1)
    batch = DataProto.from_dict({"input_ids": torch.cat([tensors["input_ids"], responses], 1), "attention_mask": mask,
                                 "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": responses},
                                meta_info={"temperature": 0.7, "top_k": 50})
    # 8 MiB chunks: 42 positions each, so the 36 response tokens of a micro-batch of 3 span one chunk and
    # of the whole batch several; 1 row per micro-batch too
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.batch["input_ids"], attention_mask=mask,
                       position_ids=batch.batch["position_ids"]).logits[:, -13:-1].float() / 0.7
    # the sampler's top-50, plus the scored token itself (filter_logits keeps it: random tokens are outside)
    keep = (logits >= logits.topk(50, dim=-1).values[..., -1:]).scatter(-1, responses[..., None], True)
    log_probs = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)
    expected = log_probs.gather(-1, responses[..., None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs.nan_to_num(neginf=0.0)).sum(-1)
    for micro in (1, 3):
        config = {"model": {"path": smollm2_dir}, "actor": {"ppo_micro_batch_size_per_gpu": micro, "logits_chunk_mb": 8}}
        actor = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config, role="ref"))
        actor.init_model()
        out = actor.compute_log_prob(batch)
        torch.testing.assert_close(out.batch["old_log_probs"], expected, atol=2e-4, rtol=0)
        torch.testing.assert_close(out.batch["entropys"], entropy, atol=2e-4, rtol=0)


def test_one_grpo_step_of_the_preset_then_its_export_loads_in_both_engines(smollm2_dir, tmp_path):
    cfg = compose_recipe("grpo", tmp_path, "trainer.total_steps=1", "trainer.val_freq=1", "data.train_batch_size=4",
                         "rollout.n=4", "rollout.max_new_tokens=16", "data.word_problems.n_train=16",
                         "data.word_problems.n_val=8", "actor.ppo_micro_batch_size_per_gpu=8")
    run = recipes.grpo.train(cfg)
    rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    step = rows[1]
    for key in ("actor/loss", "actor/grad_norm", "val/reward_mean", "rollout/tokens_per_s", "actor/entropy"):
        assert math.isfinite(step[key]), key
    assert 0 < step["actor/entropy"] < math.log(49152)
    assert step["actor/grad_norm"] > 0 or step["actor/trained_rows_frac"] == 0
    export = run.dir / "hf"
    val = sorted((tmp_path / "data").glob("arithmetic_words-*/val.jsonl"))[0]
    dataset = PromptDataset(str(val), AutoTokenizer.from_pretrained(export))
    hf = answer(str(export), dataset, "hf", max_new_tokens=16)
    vllm = answer(str(export), dataset, "vllm", max_new_tokens=16, dtype="float32")
    assert hf.texts == vllm.texts  # the same greedy answers from the exported files, fp32 in both engines
    assert abs(hf.accuracy - rows[1]["val/reward_mean"]) <= 0.25  # the run validated with bf16 vLLM


def test_a_trained_export_answers_better_than_the_base_model(smollm2_dir, tmp_path):
    """SFT for a few steps on 8 questions (the fastest training signal there is), exported, loaded from disk
    by both engines: it answers those questions right more often than the base model does."""
    rows = make_word_problems("arithmetic_words", 8, seed=11)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = compose_recipe("sft", tmp_path, f"data.train_files={data}", f"data.val_files={data}",
                         "data.train_batch_size=8", "trainer.total_steps=6", "trainer.val_freq=0",
                         "trainer.val_before_train=false", "actor.lr=5e-5", "actor.ppo_micro_batch_size_per_gpu=8",
                         "rollout.n=1", "rollout.backend=hf")
    run = recipes.sft.train(cfg)
    dataset = PromptDataset(str(data), AutoTokenizer.from_pretrained(smollm2_dir))
    base = answer(smollm2_dir, dataset, "hf", max_new_tokens=16)
    for backend in ("hf", "vllm"):
        trained = answer(str(run.dir / "hf"), dataset, backend, max_new_tokens=16)
        assert trained.accuracy >= base.accuracy + 0.25, (backend, base.accuracy, trained.accuracy, trained.texts)
