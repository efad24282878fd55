"""Greedy accuracy of HF model directories on a held-out split, through the HF and vLLM engines.

    python -m rlcore.trainer.evaluate smollm2 outputs/grpo/real/hf [--task arithmetic_words] [--backend both]
    python -m rlcore.trainer.evaluate <dir> --data val.jsonl --max-new-tokens 96
    python -m rlcore.trainer.evaluate <run>/hf --data my_val.parquet --reward-fn my_reward.py:compute_score
    python -m rlcore.trainer.evaluate <run>/hf --data my_val.parquet --run-config <run>/config.yaml

What a trained policy is judged by outside its run: each model (a HF directory, a ``.gguf`` file
or ``smollm2``) is loaded from disk as a user would load an export, by transformers (the ``hf``
engine) and by vLLM, answers every prompt greedily, and is scored by the rule reward of the row's
``data_source``, or the user's own: ``--reward-fn file.py:function`` (rlcore's or verl's signature),
``--reward-fn-by-source SOURCE=FUNCTION``, ``--reward-kwargs '{...}'``, or a run's whole ``reward``
section and data keys with ``--run-config <run>/config.yaml`` (flags win). Scoring goes through the
recipes' ``RuleRewardManager``, so a response is decoded and scored exactly as in training; a data
source that no function scores is refused before any model is loaded. Both engines decode the same ids, so their accuracies should agree (bf16 vLLM
may flip a near-tie); a model that loads in one and not the other fails here. With several
models the first ``--show`` prompts are printed side by side: what the base model answered, what
the trained one answers.

Plain-string prompts are rendered as the run that trained the model rendered them: through the chat
template or not, as its export records (``rlcore.trainer.prompt_format``: ``data.apply_chat_template``
as the run resolved it); ``--apply-chat-template`` or ``--run-config`` decide instead, and a model no
run exported gets auto. The line "evaluating on ..." says which and why.

The split is the one a recipe validates on: ``--task`` writes it as ``data.task`` does with the
default ``data.word_problems`` settings (the same rows), or ``--data`` reads a prompt file.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rlcore.data.dataset import PromptDataset, collate_prompts
from rlcore.data.word_problems import TASKS, make_word_problems, write_jsonl
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.engines.factory import build_engine
from rlcore.models.config import ModelConfig
from rlcore.models.gguf import resolve_model_path
from rlcore.protocol import DataProto
from rlcore.rewards.manager import RewardConfig, RuleRewardManager
from rlcore.trainer import prompt_format
from rlcore.trainer.config import WordProblemsConfig


@dataclass
class Answers:
    model: str
    backend: str
    texts: list[str]
    scores: list[float]

    @property
    def accuracy(self) -> float:
        return sum(self.scores) / len(self.scores)


def held_out_rows(task: str) -> list[dict]:
    """The validation rows of ``data.task=<task>`` at the default ``data.word_problems`` settings."""
    spec = WordProblemsConfig()
    return make_word_problems(task, spec.n_train + spec.n_val, spec.seed)[spec.n_train:]


def answer(model_dir: str, dataset: Sequence[dict], backend: str, max_new_tokens: int,
           scorer: RuleRewardManager | None = None, batch_size: int = 256, dtype: str | None = None) -> Answers:
    """Greedy answers of ``model_dir`` to every prompt of ``dataset`` (a ``PromptDataset`` or a list of
    its items) through one engine, scored by ``scorer`` (None: each row's data_source's registered function).
    ``dtype`` null: the model's for HF, bf16 where native else fp32 for vLLM (as the recipes sample)."""
    rollout = RolloutConfig(backend=backend, do_sample=False, max_new_tokens=max_new_tokens, max_model_len=1024,
                            kv_cache_memory_bytes=1 << 30, dtype=dtype)
    scorer = scorer or RuleRewardManager(AutoTokenizer.from_pretrained(model_dir), num_workers=0)
    engine = build_engine(ModelConfig(path=model_dir), rollout)
    settings = SamplingSettings.resolve(rollout, {"validate": True})
    texts, scores = [], []
    for start in range(0, len(dataset), batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        tensors, non_tensors = collate_prompts(items, engine.pad_token_id)
        out = engine.generate(tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"], settings)
        mask = torch.arange(out.responses.shape[1]) < out.lengths[:, None]
        scored = scorer.score(DataProto.from_dict({"responses": out.responses, "response_mask": mask.long()},
                                                  non_tensors))
        texts += list(scored.non_tensor_batch["response_text"])
        scores += scored.batch["reward_scores"].tolist()
    del engine
    gc.collect()
    return Answers(model_dir, backend, texts, scores)


def reward_settings(args: argparse.Namespace) -> tuple[dict, dict]:
    """(the ``reward`` section, the ``data`` keys) to score with: a run's config, then the flags over it."""
    reward, data = {}, {}
    if args.run_config:
        if not Path(args.run_config).is_file():
            raise FileNotFoundError(f"--run-config {args.run_config}: no such file (a run folder's config.yaml)")
        run = OmegaConf.to_container(OmegaConf.load(args.run_config), resolve=True)
        reward = {k: v for k, v in run.get("reward", {}).items() if k != "model"}
        data = {k: v for k, v in run.get("data", {}).items()
                if k in ("prompt_key", "answer_key", "apply_chat_template")}
    if args.reward_fn:
        reward["reward_fn"] = args.reward_fn
    for item in args.reward_fn_by_source or []:
        source, sep, fn = item.partition("=")
        if not sep or not source or not fn:
            raise ValueError(f"--reward-fn-by-source takes SOURCE=FUNCTION, got {item!r}")
        reward.setdefault("reward_fn_by_source", {})[source] = fn
    if args.reward_kwargs:
        reward["reward_kwargs"] = json.loads(args.reward_kwargs)
    return reward, data


def prompt_template_choice(args: argparse.Namespace, data_keys: dict, models: Sequence[str]) -> tuple[Any, str]:
    """(``apply_chat_template`` for plain-string prompts, why): the flag, else ``--run-config``'s, else
    what the first model's export records of the run that trained it (``rlcore.trainer.prompt_format``),
    else auto (the tokenizer's template when it has one)."""
    if args.apply_chat_template:
        value = {"true": True, "false": False}.get(args.apply_chat_template, "auto")
        return value, f"--apply-chat-template {args.apply_chat_template}"
    if "apply_chat_template" in data_keys:
        return data_keys["apply_chat_template"], f"data.apply_chat_template of --run-config {args.run_config}"
    for model in models:
        found = prompt_format.recorded(model)
        if found is not None:
            return found
    return "auto", "no run recorded how it rendered prompts: auto, the tokenizer's chat template when it has one"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlcore.trainer.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="HF model directories (or a .gguf file, or smollm2)")
    parser.add_argument("--task", default="arithmetic_words", choices=TASKS)
    parser.add_argument("--data", help="a prompt file (jsonl/parquet with prompt, answer, data_source) instead of --task")
    parser.add_argument("--n", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--backend", default="both", choices=("hf", "vllm", "both"))
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 32 (96 for multi_step)")
    parser.add_argument("--show", type=int, default=5, help="prompts printed with every model's answer")
    parser.add_argument("--json", help="also write the accuracies (and answers) here")
    parser.add_argument("--reward-fn", help="score every row with this function: file.py:function, "
                                            "package.module:function or a registered name")
    parser.add_argument("--reward-fn-by-source", action="append", metavar="SOURCE=FUNCTION",
                        help="the function of one data_source (repeatable); wins over --reward-fn")
    parser.add_argument("--reward-kwargs", help="keyword arguments of every reward call, as JSON")
    parser.add_argument("--run-config", help="a run's config.yaml: its reward section and data keys")
    parser.add_argument("--apply-chat-template", choices=("true", "false", "auto"),
                        help="plain-string prompts through the chat template (default: as the run that trained "
                             "the model did, from its export's record; auto for a model no run exported)")
    args = parser.parse_args(argv)
    reward, data_keys = reward_settings(args)
    models = [resolve_model_path(m) for m in args.models]
    data_keys["apply_chat_template"], how = prompt_template_choice(args, data_keys, models)
    tokenizer = AutoTokenizer.from_pretrained(models[0])
    r = RewardConfig(**reward)
    scorer = RuleRewardManager.from_reward_config(tokenizer, r, num_workers=0,
                                                  answer_key=data_keys.get("answer_key", "answer"))
    if args.data:
        files = args.data
    else:
        rows = held_out_rows(args.task)
        files = str(write_jsonl(Path(tempfile.mkdtemp(prefix="rlcore_eval_")) / f"{args.task}_val.jsonl", rows))
    prompts = PromptDataset(files, tokenizer, max_prompt_length=1024,
                            extra_keys=("data_source", *dict.fromkeys(r.extra_keys)), **data_keys)
    dataset = [prompts[i] for i in range(min(args.n or len(prompts), len(prompts)))]
    scorer.check_sources([item["data_source"] for item in dataset])  # before any model loads
    print(f"evaluating on {prompts.describe()}; {how}", flush=True)
    max_new = args.max_new_tokens or (96 if args.task == "multi_step" and not args.data else 32)
    backends = ("hf", "vllm") if args.backend == "both" else (args.backend,)
    results = [answer(m, dataset, b, max_new, scorer) for m in models for b in backends]
    print(f"\ngreedy accuracy on {len(dataset)} held-out prompts ({args.data or args.task}), {max_new} new tokens at most")
    for r in results:
        print(f"  {r.accuracy:6.3f}  {r.backend:<5} {r.model}")
    for i in range(min(args.show, len(dataset))):
        item = dataset[i]
        question = item["messages"][-1]["content"] if "messages" in item else item["raw_prompt"]
        print(f"\n{question!r} (answer {item['ground_truth']})")
        for r in results:
            print(f"  [{r.backend} {'right' if r.scores[i] else 'wrong'}] {r.model.rsplit('/', 2)[-2:]}: {r.texts[i][:120]!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"model": r.model, "backend": r.backend, "accuracy": r.accuracy, "answers": r.texts}
                       for r in results], f, indent=1)


if __name__ == "__main__":
    main()
