"""Fixtures of the worker tests: one tiny model directory per session, a batch factory.

The session-wide Ray instance is ``ray_cluster`` from tests/conftest.py.
"""

import pytest
import torch

from rlcore.models.tiny import build_tiny_model
from rlcore.protocol import DataProto

VOCAB = 66  # the tiny char tokenizer: 4 special tokens + 62 characters


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_lm"), seed=0)


def rollout_batch(prompt_lens=(5, 3, 4, 2), response_lens=(6, 5, 1, 2), prompt_width=5, response_width=6,
                  seed=0) -> DataProto:
    """A rollout-shaped batch: left-padded prompts, right-padded responses (pad id 0), token ids
    >= 4 (no special tokens), position ids that skip the left padding, random advantages."""
    g = torch.Generator().manual_seed(seed)
    n = len(prompt_lens)
    prompt_mask = torch.arange(prompt_width).flip(0).expand(n, -1) < torch.tensor(prompt_lens)[:, None]
    response_mask = torch.arange(response_width).expand(n, -1) < torch.tensor(response_lens)[:, None]
    prompts = torch.randint(4, VOCAB, (n, prompt_width), generator=g) * prompt_mask
    responses = torch.randint(4, VOCAB, (n, response_width), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1).long()
    return DataProto.from_dict({
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask.float(),
        "advantages": torch.randn(n, response_width, generator=g) * response_mask,
    })


@pytest.fixture
def make_batch():
    return rollout_batch
