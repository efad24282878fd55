"""Helpers shared by the engine and rollout-worker tests: prompts, hand-computed references, and
one engine call turned into the trainer-facing layout."""

from __future__ import annotations

import time

import numpy as np
import torch

from rlcore.engines.base import Engine, SamplingSettings
from rlcore.engines.layout import build_output
from rlcore.protocol import DataProto

# Prompts of different lengths, so left padding is exercised.
PROMPTS = ["12+3=", "7*8=", "100-99=", "a"]


def make_prompts(tokenizer, texts=PROMPTS, meta_info: dict | None = None) -> DataProto:
    """Left-padded prompts as the dataset's collate builds them, with uid / raw_prompt non-tensors."""
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = max(len(i) for i in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        input_ids[row, width - len(seq):] = torch.tensor(seq)
        mask[row, width - len(seq):] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    uid = np.array([f"p{i}" for i in range(len(texts))], dtype=object)
    raw = np.array(list(texts), dtype=object)
    return DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids},
        {"uid": uid, "raw_prompt": raw},
        meta_info or {},
    )


def settings(**overrides) -> SamplingSettings:
    """Sampling settings of one engine call: plain sampling at temperature 1, ``overrides`` on top."""
    base = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=10, n=1, do_sample=True)
    return SamplingSettings(**{**base, **overrides})


def generate(engine: Engine, prompts: DataProto, settings: SamplingSettings, repeat: int = 1) -> DataProto:
    """``engine.generate`` on ``prompts`` (each row ``repeat`` times, adjacent) in the trainer's layout."""
    rows = prompts.repeat(repeat, interleave=True) if repeat > 1 else prompts
    b = rows.batch
    start = time.perf_counter()
    gen = engine.generate(b["input_ids"], b["attention_mask"], b["position_ids"], settings)
    return build_output(rows, gen, engine.pad_token_id, time.perf_counter() - start)


@torch.no_grad()
def hand_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Greedy decoding as a plain loop: full forward of the unpadded sequence, argmax, append."""
    seq = list(prompt_ids)
    out = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([seq])).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        seq.append(tok)
        if tok in stop_ids:
            break
    return out


@torch.no_grad()
def hand_log_probs(model, prompt_ids: list[int], response: list[int], temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """log-softmax of (logits / temperature, top-k then top-p filtered) at each response token, teacher-forced.

    Top-p keeps the most likely tokens whose probabilities sum to at least top_p: sorted ascending,
    a token goes when the mass up to and including it is at most 1 - top_p.
    """
    seq = torch.tensor([list(prompt_ids) + list(response)])
    logits = model(seq).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response).unsqueeze(1)).squeeze(1)


def unpadded(row_ids: torch.Tensor, row_mask: torch.Tensor) -> list[int]:
    return row_ids[row_mask.bool()].tolist()
