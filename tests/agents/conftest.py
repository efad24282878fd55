"""The tiny model taught to use a ``calc`` tool the way each framework asks for it."""

import importlib.util
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from frameworks import EXAMPLES
from rlcore.models.tiny import build_tiny_model

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object",
                                                                      "properties": {"expression": {"type": "string"}}}}}
FINAL = {"type": "function", "function": {"name": "final_answer", "parameters": {"type": "object",
                                                                                "properties": {"answer": {}}}}}
CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'
FINAL_CALL = '<tool_call>{"name": "final_answer", "arguments": {"answer": "5"}}</tool_call>'


def smolagents_system_prompt() -> str:
    spec = importlib.util.spec_from_file_location("smolagents_agent", EXAMPLES / "smolagents_agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SYSTEM_PROMPT


def sequences(tok, call_id: str) -> list[tuple[list[int], list[bool]]]:
    """The token sequences the model learns, each with the tokens it is trained to write: the native
    round trip as one session holds it (the call, its eos, the tool's result, the answer: the
    calculator example, LangGraph, pydantic-ai), then smolagents' two steps, each a segment of its
    own (a ``final_answer`` call ends its run; its history comes back as text, with ``call_id``, the
    id the proxy gave the call: a new one each episode)."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    render = lambda messages, tools: enc(tok.apply_chat_template(  # noqa: E731
        messages, tokenize=False, add_generation_prompt=True, tools=tools))
    eos = [tok.eos_token_id]

    def row(*parts):  # (ids, written by the model?) pieces
        return [t for ids, _ in parts for t in ids], [w for ids, w in parts for _ in ids]

    rows = [row((render([{"role": "user", "content": "2+3="}], [CALC]), False), (enc(CALL) + eos, True),
                (enc("\ntool: 5\nassistant: "), False), (enc("5") + eos, True))]
    smol = [{"role": "system", "content": smolagents_system_prompt()}, {"role": "user", "content": "New task:\n2+3="}]
    rows.append(row((render(smol, [CALC, FINAL]), False), (enc(CALL) + eos, True)))
    said = str([{"id": call_id, "type": "function", "function": {"name": "calc", "arguments": {"expression": "2+3"}}}])
    history = smol + [{"role": "assistant", "content": "Calling tools:\n" + said},
                      {"role": "user", "content": "Observation:\n5"}]
    rows.append(row((render(history, [CALC, FINAL]), False), (enc(FINAL_CALL) + eos, True)))
    return rows


def batch(tok, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequences with a fresh call id (as the proxy makes them), padded: ids, attention, labels."""
    rows = sequences(tok, "call_" + "".join(rng.choice("0123456789abcdef") for _ in range(24)))
    width = max(len(ids) for ids, _ in rows)
    x = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in rows])
    attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    labels = torch.where(torch.tensor([w + [False] * (width - len(w)) for _, w in rows]), x, -100)
    return x, attention, labels


@pytest.fixture(scope="session")
def framework_model_dir(tmp_path_factory):
    """The seed-0 tiny model overfit to those sequences, trained on the model's tokens only. smolagents'
    second step gets a new call id every optimizer step: with a few fixed ones the model learnt those
    and wrote garbage for a third of fresh ids; with fresh ones it ignores them (checked on fresh ids)."""
    out = build_tiny_model(tmp_path_factory.mktemp("frameworks"), seed=0)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    steps, rng = 150, random.Random(0)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / steps)
    torch.manual_seed(0)
    for _ in range(steps):
        x, attention, labels = batch(tok, rng)
        loss = model(x, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
    model.save_pretrained(out)
    return out
