"""Fixtures of the worker tests: one tiny model directory per session, a batch factory, a check
that every key of a config section is documented.

The session-wide Ray instance is ``ray_cluster`` from tests/conftest.py.
"""

import dataclasses
import inspect
import re

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


def field_comments(cls) -> dict[str, str]:
    """Field name -> the comment on its declaration line, over the dataclass and the dataclasses it extends."""
    comments = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            for m in re.finditer(r"^    (\w+): [^\n=]+=[^\n#]*#\s*(\S.*)$", inspect.getsource(klass), re.M):
                comments[m.group(1)] = m.group(2)
    return comments


@pytest.fixture
def undocumented_fields():
    """A section dataclass's fields that have no comment: a field's comment is its documentation."""
    return lambda cls: [f.name for f in dataclasses.fields(cls) if f.name not in field_comments(cls)]
