"""The OpenAI wire format as OpenAI's API takes it (issue 32): ``null`` for an optional field is the
field left out; ``tool_choice`` "none" keeps the tools out of the prompt, "required" and a named
function start the assistant turn with the template's tool-call opening (masked context in the
trajectory, the model's own ids after it), and what cannot be honoured is a 400 in OpenAI's error
body naming the field; a client that hangs up mid-stream leaves no asyncio traceback behind."""

import asyncio
import dataclasses
import gc
import json
import logging
import shutil

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from chat_helpers import CALC, CALL_TEXT, GREEDY, SAMPLED, SlowSteps, client, hand_greedy, render, serving, until_idle
from rlcore.agentic.chat import ChatDelta
from rlcore.models.tiny import build_char_tokenizer

MESSAGES = [{"role": "user", "content": "12+3="}]
NULLS = {k: None for k in ("stream", "logprobs", "top_logprobs", "n", "frequency_penalty", "presence_penalty",
                           "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed", "tools",
                           "tool_choice", "user", "stream_options", "logit_bias", "parallel_tool_calls",
                           "response_format", "metadata")}
OTHER = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


async def post(access, body):
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {access.api_key}"}, timeout=30) as h:
        r = await h.post(f"{access.base_url}/chat/completions", json=body)
        return r.status_code, r.json()


def test_null_optional_fields_are_taken_as_not_given(model_dir, tok, ref_model):
    expected = hand_greedy(ref_model, render(tok, MESSAGES), GREEDY.max_new_tokens, {tok.eos_token_id})

    async def scenario():
        async with serving(model_dir, GREEDY) as (proxy, rec, _):
            access = proxy.open_session("s", 200)
            nulls = await post(access, {"model": "p", "messages": MESSAGES, **NULLS})
            plain = await post(access, {"model": "p", "messages": MESSAGES})
            missing = await post(access, {"model": "p", "messages": None})
            return nulls, plain, missing, rec.calls

    (status, body), (_, plain), (missing_status, missing), calls = asyncio.run(scenario())
    assert status == 200, body
    assert body["choices"][0]["message"] == plain["choices"][0]["message"]
    assert calls[0][2].token_ids == expected and len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    assert missing_status == 400 and missing["error"]["param"] == "messages"  # messages: null is still an error


def test_tool_choice_none_keeps_the_tools_out_of_the_prompt(model_dir, tok):
    async def scenario():
        async with serving(model_dir, GREEDY) as (proxy, rec, _):
            c = client(proxy.open_session("s", 300))
            none = await c.chat.completions.create(model="p", messages=MESSAGES, tools=[CALC], tool_choice="none")
            auto = await c.chat.completions.create(model="p", messages=MESSAGES, tools=[CALC])
            return none, auto, rec.calls

    none, auto, calls = asyncio.run(scenario())
    assert calls[0][1] == render(tok, MESSAGES)  # as if no tools were offered
    assert calls[1][1] == render(tok, MESSAGES, tools=[CALC]) != calls[0][1]
    assert "calc" not in tok.decode(calls[0][1]) and "calc" in tok.decode(calls[1][1])
    assert none.choices[0].message.tool_calls is None


def test_required_and_named_tool_choice_start_the_turn_with_the_call(tool_model_dir):
    """The model taught to call calc: forced, the engine is asked to continue the template's call opening,
    the sampled ids are only the rest, and the session records the opening as masked context."""
    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    long = dataclasses.replace(GREEDY, max_new_tokens=80)
    messages = [{"role": "user", "content": "2+3="}]
    prompt = render(tok, messages, tools=[CALC])
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731

    async def scenario():
        async with serving(tool_model_dir, long) as (proxy, rec, _):
            replies = {}
            for name, choice in [("required", "required"),
                                 ("named", {"type": "function", "function": {"name": "calc"}})]:
                c = client(proxy.open_session(name, 400))
                replies[name] = await c.chat.completions.create(model="p", messages=messages, tools=[CALC],
                                                                tool_choice=choice)
                chunks = [ch async for ch in await c.chat.completions.create(
                    model="p", messages=messages, tools=[CALC], tool_choice=choice, stream=True)]
                replies[name + " streamed"] = [d.tool_calls[0] for ch in chunks if ch.choices
                                               for d in [ch.choices[0].delta] if d.tool_calls]
            return replies, {n: proxy.close_session(n) for n in ("required", "named")}, rec.calls

    replies, sessions, calls = asyncio.run(scenario())
    openings = {"required": '<tool_call>{"name": "', "named": '<tool_call>{"name": "calc", "arguments": '}
    for i, name in enumerate(("required", "named")):
        context, completion = calls[2 * i][1], calls[2 * i][2]
        assert context == prompt + enc(openings[name])
        assert tok.decode(completion.token_ids, skip_special_tokens=True) == CALL_TEXT[len(openings[name]):]
        message = replies[name].choices[0].message
        assert replies[name].choices[0].finish_reason == "tool_calls" and message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("calc", {"expression": "2+3"})]
        [streamed] = replies[name + " streamed"]
        assert (streamed.function.name, json.loads(streamed.function.arguments)) == ("calc", {"expression": "2+3"})
        [segment] = sessions[name].segments
        assert segment.prompt_ids == prompt
        forced = len(enc(openings[name]))
        assert segment.token_ids[:forced] == enc(openings[name]) and segment.policy_mask[:forced] == [0] * forced
        assert [t for t, m in zip(segment.token_ids, segment.policy_mask) if m] == calls[2 * i + 1][2].token_ids


def test_a_forced_call_the_model_does_not_finish_comes_back_as_text(model_dir, tok):
    """The random tiny model never writes a call: forced, its reply starts with the opening it was given and,
    malformed, stays content with finish reason stop/length (the engines cannot constrain the rest)."""
    async def scenario():
        async with serving(model_dir, GREEDY) as (proxy, rec, _):
            c = client(proxy.open_session("s", 300))
            return await c.chat.completions.create(model="p", messages=MESSAGES, tools=[CALC],
                                                   tool_choice={"type": "function", "function": {"name": "calc"}})

    reply = asyncio.run(scenario())
    assert reply.choices[0].message.content.startswith('<tool_call>{"name": "calc", "arguments": ')
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_and_fields_that_cannot_be_honoured_are_400s_naming_the_field(model_dir):
    cases = {
        "required without tools": ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        "unknown function": ({"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                             "tool_choice", "'nope', which is not among the tools offered ('calc')"),
        "unknown form": ({"tools": [CALC], "tool_choice": {"type": "allowed_tools", "mode": "auto"}},
                         "tool_choice", "must be 'none', 'auto', 'required' or"),
        "misspelt mode": ({"tools": [CALC], "tool_choice": "requried"}, "tool_choice", "must be 'none'"),
        "one call at a time": ({"tools": [CALC], "parallel_tool_calls": False}, "parallel_tool_calls",
                               "not supported"),
        "tool without a name": ({"tools": [{"type": "function", "function": {}}]}, "tools[0]", "function.name"),
    }

    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, _, engine):
            access = proxy.open_session("s", 200)
            out = {k: await post(access, {"messages": MESSAGES, **extra}) for k, (extra, _, _) in cases.items()}
            ok = await post(access, {"messages": MESSAGES, "tools": [CALC], "tool_choice": "auto"})
            return out, ok

    out, ok = asyncio.run(scenario())
    for name, (status, body) in out.items():
        _, param, words = cases[name]
        assert status == 400, name
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["param"] == param, name
        assert words in body["error"]["message"] and body["error"]["type"] == "invalid_request_error", name
        assert "pydantic" not in body["error"]["message"] and "validation error" not in body["error"]["message"]
    assert ok[0] == 200


def test_the_tool_call_opening_is_read_off_the_template():
    tok = build_char_tokenizer()
    delta = ChatDelta(tok)
    assert delta.tool_call_opening([CALC]) == '<tool_call>{"name": "'
    assert delta.tool_call_opening([CALC], "calc") == '<tool_call>{"name": "calc", "arguments": '
    tok.chat_template = QWEN_LIKE  # Qwen2.5's way: the call's JSON on a line of its own
    assert ChatDelta(tok).tool_call_opening([CALC]) == '<tool_call>\n{"name": "'
    assert ChatDelta(tok).tool_call_opening([CALC], "calc") == '<tool_call>\n{"name": "calc", "arguments": '
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
                        "{% if add_generation_prompt %}assistant: {% endif %}"  # renders no tool calls
    assert ChatDelta(tok).tool_call_opening([CALC], "calc") is None


QWEN_LIKE = (  # the shape of Qwen2.5's tool-calling template (ChatML, Hermes-style calls), abridged
    "{% if tools %}<|im_start|>system{{ '\\n' }}{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}"
    "<|im_end|>{{ '\\n' }}{% endif %}{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant"
    "{% if m['content'] %}{{ '\\n' + m['content'] }}{% endif %}{% for c in m.get('tool_calls', []) %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' }}"
    "{{ c['function']['arguments'] | tojson }}}{{ '\\n</tool_call>' }}{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m['role'] + '\\n' + m['content'] }}<|im_end|>{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}")


def test_a_client_hang_up_leaves_no_asyncio_traceback(model_dir, caplog, capfd):
    """Before: every hang-up printed '_GatheringFuture exception was never retrieved ... CancelledError'."""
    long = dataclasses.replace(SAMPLED, max_new_tokens=2000, ignore_eos=True)

    async def scenario():
        async with serving(model_dir, long) as (proxy, rec, engine):
            for n in (1, 2):  # one choice and two
                access = proxy.open_session(f"s{n}", 4000)
                body = {"model": "p", "messages": MESSAGES, "stream": True, "n": n}
                with SlowSteps(engine, 0.002):
                    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {access.api_key}"}) as h:
                        async with h.stream("POST", f"{access.base_url}/chat/completions", json=body) as r:
                            async for line in r.aiter_lines():
                                if '"content": "' in line and '"content": ""' not in line:
                                    break  # one delta, then hang up
                    await until_idle(engine)
                gc.collect()  # a future nobody retrieved complains when it is collected
                await asyncio.sleep(0.05)
            return engine.num_running()

    gc.collect()  # earlier tests' garbage (clients never closed) speaks now, not below
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        running = asyncio.run(scenario())
        gc.collect()
    assert running == 0
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''} {r.exc_info or ''}" for r in caplog.records
                       if r.name == "asyncio")
    out, err = capfd.readouterr()
    for text in (logged, out, err):
        assert "never retrieved" not in text and "CancelledError" not in text


def test_a_forced_tool_choice_on_a_template_without_tool_calls_is_a_400(model_dir, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
                        "{% if add_generation_prompt %}assistant: {% endif %}"
    tok.save_pretrained(plain)

    async def scenario():
        async with serving(str(plain), GREEDY) as (proxy, rec, _):
            access = proxy.open_session("s", 300)
            forced = await post(access, {"messages": MESSAGES, "tools": [CALC], "tool_choice": "required"})
            auto = await post(access, {"messages": MESSAGES, "tools": [CALC]})
            return forced, auto, len(rec.calls)

    (status, body), (auto_status, _), calls = asyncio.run(scenario())
    assert status == 400 and body["error"]["param"] == "tool_choice"
    assert "chat template does not write tool calls" in body["error"]["message"]
    assert auto_status == 200 and calls == 1  # the refused request never reached the engine
