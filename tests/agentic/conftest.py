"""Fixtures of the chat proxy tests: the tiny model taught to call a tool."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chat_helpers import CALC, CALL_TEXT, render
from rlcore.models.tiny import build_tiny_model


@pytest.fixture(scope="session")  # trained once for the three modules that use it
def tool_model_dir(tmp_path_factory):
    """The tiny model taught (by overfitting one conversation) to call ``calc`` on "2+3=", then,
    given the tool's result, to answer it."""
    out = build_tiny_model(tmp_path_factory.mktemp("tool"), seed=0)
    tok = AutoTokenizer.from_pretrained(out)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompt = render(tok, [{"role": "user", "content": "2+3="}], tools=[CALC])
    ids = prompt + enc(CALL_TEXT) + [tok.eos_token_id] + enc("\ntool: 5\nassistant: 5") + [tok.eos_token_id]
    model = AutoModelForCausalLM.from_pretrained(out)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.tensor([ids])
    torch.manual_seed(0)
    for _ in range(150):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    return out
