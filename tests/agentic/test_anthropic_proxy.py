"""The per-session Anthropic Messages endpoint (``/s/<session>/v1/messages``), driven by the stock
``anthropic`` client against the real tiny-model engine: a greedy reply is HF's greedy decoding with
the real usage, the system prompt is rendered, the ids trained on are the ids sampled and a
conversation gives the same ids on both wire formats, the stream's deltas add up to the
non-streamed reply in Anthropic's event order, stop sequences and max_tokens end a reply with
their stop reasons, tools round-trip (tool_use blocks out, tool_result blocks in), and bad keys and
requests get Anthropic's error body."""

import asyncio
import dataclasses
import json

import anthropic
import httpx
import pytest
from transformers import AutoTokenizer

from chat_helpers import CALC, CALL_TEXT, GREEDY, SAMPLED, client, hand_greedy, render, serving

TOOL = {"name": "calc", "description": "a+b", "input_schema": CALC["function"]["parameters"]}


def aclient(access, api_key=None) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=access.session_url, api_key=api_key or access.api_key, max_retries=0,
                                    timeout=30)


def own(segment) -> list[int]:
    return [t for t, m in zip(segment.token_ids, segment.policy_mask) if m]


def test_a_greedy_reply_is_hf_greedy_with_the_system_prompt_and_real_usage(model_dir, tok, ref_model):
    system, messages = "be brief", [{"role": "user", "content": "12+3="}]
    prompt = render(tok, [{"role": "system", "content": system}] + messages)
    expected = hand_greedy(ref_model, prompt, GREEDY.max_new_tokens, {tok.eos_token_id})

    async def scenario():
        async with serving(model_dir, GREEDY) as (proxy, rec, _):
            c = aclient(proxy.open_session("s", 200))
            reply = await c.messages.create(model="policy", max_tokens=50, system=system, messages=messages)
            blocks = await c.messages.create(model="policy", max_tokens=50,
                                             system=[{"type": "text", "text": system}],
                                             messages=[{"role": "user", "content": [{"type": "text", "text": "12+3="}]}])
            counted = await c.messages.count_tokens(model="policy", system=system, messages=messages)
            with_tools = await c.messages.count_tokens(model="policy", system=system, messages=messages, tools=[TOOL])
            return reply, blocks, (counted, with_tools), rec.calls

    reply, blocks, (counted, with_tools), calls = asyncio.run(scenario())
    assert counted.input_tokens == len(prompt) == reply.usage.input_tokens
    assert with_tools.input_tokens == len(render(tok, [{"role": "system", "content": system}] + messages,
                                                 tools=[CALC])) > len(prompt)
    assert len(calls) == 2  # counting generates nothing
    assert calls[0][1] == prompt and calls[0][2].token_ids == expected
    assert calls[1][1] == prompt  # text blocks are the same text
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == tok.decode(expected, skip_special_tokens=True) == blocks.content[0].text
    assert reply.stop_reason == ("end_turn" if expected[-1] == tok.eos_token_id else "max_tokens")
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len(prompt), len(expected))
    assert reply.role == "assistant" and reply.type == "message" and reply.id.startswith("msg_")


def test_the_ids_trained_on_are_the_ids_sampled_and_both_wires_render_alike(model_dir, tok):
    async def conversation(proxy, name, anthropic_wire):
        access = proxy.open_session(name, 400)
        messages = [{"role": "user", "content": "12+30="}]
        for turn in range(3):
            if anthropic_wire:
                reply = await aclient(access).messages.create(model="p", max_tokens=12, messages=messages)
                text = reply.content[0].text
            else:
                reply = await client(access).chat.completions.create(model="p", max_tokens=12, messages=messages)
                text = reply.choices[0].message.content
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"no, try {turn}"}]
        return proxy.close_session(name)

    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, rec, _):
            session = await conversation(proxy, "anthropic", True)
            n = len(rec.calls)
            openai_session = await conversation(proxy, "openai", False)
            return session, openai_session, rec.calls[:n], rec.calls[n:]

    session, openai_session, calls, openai_calls = asyncio.run(scenario())
    [segment] = session.segments
    assert own(segment) == [t for _, _, c in calls for t in c.token_ids]
    assert segment.context() == calls[-1][1] + calls[-1][2].token_ids
    for i in range(1, 3):  # each turn extends the last one's exact ids
        assert calls[i][1][:len(calls[i - 1][1]) + len(calls[i - 1][2].token_ids)] == \
            calls[i - 1][1] + calls[i - 1][2].token_ids
    # the same conversation on OpenAI's wire: the same template, the same deltas (the replies differ: sampled)
    env = [t for t, m in zip(segment.token_ids, segment.policy_mask) if not m]
    [openai_segment] = openai_session.segments
    openai_env = [t for t, m in zip(openai_segment.token_ids, openai_segment.policy_mask) if not m]
    assert segment.prompt_ids == openai_segment.prompt_ids
    assert tok.decode(env).replace("\n", "") == tok.decode(openai_env).replace("\n", "") == \
        "user: no, try 0assistant: user: no, try 1assistant: "


def test_streamed_deltas_add_up_to_the_greedy_reply_in_anthropics_event_order(model_dir):
    long = dataclasses.replace(GREEDY, max_new_tokens=40, ignore_eos=True)
    messages = [{"role": "user", "content": "12+3="}]

    async def scenario():
        async with serving(model_dir, long) as (proxy, rec, _):
            c = aclient(proxy.open_session("s", 400))
            whole = await c.messages.create(model="p", max_tokens=40, messages=messages)
            async with c.messages.stream(model="p", max_tokens=40, messages=messages) as stream:
                texts = [t async for t in stream.text_stream]
                final = await stream.get_final_message()
            events = [e async for e in await c.messages.create(model="p", max_tokens=40, messages=messages,
                                                                stream=True)]
            return whole, texts, final, events, rec.streamed

    whole, texts, final, events, streamed = asyncio.run(scenario())
    assert len(texts) > 10 and "".join(texts) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason == "max_tokens" and final.usage.output_tokens == 40
    assert streamed[0] == streamed[1]  # greedy: the streamed ids are the same too
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert "".join(e.delta.text for e in events[2:-3]) == whole.content[0].text


def test_stop_sequences_and_max_tokens_end_a_reply_with_their_stop_reasons(model_dir, tok, ref_model):
    messages = [{"role": "user", "content": "3+4="}]
    expected = tok.decode(hand_greedy(ref_model, render(tok, messages), 12, {tok.eos_token_id}),
                          skip_special_tokens=True)
    stop = expected[3:5]

    async def scenario():
        async with serving(model_dir, GREEDY) as (proxy, _, _e):
            c = aclient(proxy.open_session("s", 200))
            stopped = await c.messages.create(model="p", max_tokens=12, messages=messages, stop_sequences=[stop])
            short = await c.messages.create(model="p", max_tokens=2, messages=messages)
            return stopped, short

    stopped, short = asyncio.run(scenario())
    assert stopped.content[0].text == expected[:expected.index(stop)]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert (short.stop_reason, short.usage.output_tokens, short.content[0].text) == ("max_tokens", 2, expected[:2])


def test_tool_use_round_trip(tool_model_dir):
    """The model taught to call calc: a tool_use block out (streamed too), a tool_result block in, the answer,
    one token-exact segment whose masked tokens are the tool result's rendering."""
    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    long = dataclasses.replace(GREEDY, max_new_tokens=80)

    async def scenario():
        async with serving(tool_model_dir, long) as (proxy, rec, _):
            c = aclient(proxy.open_session("s", 400))
            messages = [{"role": "user", "content": "2+3="}]
            first = await c.messages.create(model="p", max_tokens=80, messages=messages, tools=[TOOL])
            async with c.messages.stream(model="p", max_tokens=80, messages=messages, tools=[TOOL]) as stream:
                streamed = await stream.get_final_message()
            forced = await c.messages.create(model="p", max_tokens=80, messages=messages, tools=[TOOL],
                                             tool_choice={"type": "tool", "name": "calc"})
            call = first.content[-1]
            messages += [{"role": "assistant", "content": first.content},  # the SDK's blocks, as agents pass them
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"}]}]
            answer = await c.messages.create(model="p", max_tokens=80, messages=messages, tools=[TOOL])
            return first, streamed, forced, answer, proxy.close_session("s"), rec.calls

    first, streamed, forced, answer, session, calls = asyncio.run(scenario())
    assert calls[0][1] == render(tok, [{"role": "user", "content": "2+3="}], tools=[CALC])  # input_schema rendered
    for reply in (first, streamed, forced):
        assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["tool_use"]
        assert (reply.content[0].name, reply.content[0].input) == ("calc", {"expression": "2+3"})
        assert reply.content[0].id.startswith("toolu_")
    assert tok.decode(calls[2][1][-len(tok.encode('<tool_call>{"name": "calc", "arguments": ')):]) == \
        '<tool_call>{"name": "calc", "arguments": '  # tool_choice tool: the opening was given
    assert answer.content[0].text == "5" and answer.stop_reason == "end_turn"
    [segment] = session.segments  # the retries (streamed, forced) discarded, then extended
    env = [t for t, m in zip(segment.token_ids, segment.policy_mask) if not m]
    assert tok.decode(env) == '<tool_call>{"name": "calc", "arguments": \ntool: 5\nassistant: '
    assert tok.decode(own(segment)) == CALL_TEXT[len('<tool_call>{"name": "calc", "arguments": '):] + "</s>5</s>"


def test_keys_and_bad_requests_get_anthropics_errors(model_dir):
    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, _, engine):
            mine, other = proxy.open_session("mine", 200), proxy.open_session("other", 200)
            messages = [{"role": "user", "content": "1+1="}]
            errors = {}
            for name, access, key in [("wrong key", mine, "wrong"), ("another session's key", other, mine.api_key)]:
                with pytest.raises(anthropic.AuthenticationError) as e:
                    await aclient(access, key).messages.create(model="p", max_tokens=4, messages=messages)
                errors[name] = e.value
            bad = {
                "image": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}],
                "prefill": messages + [{"role": "assistant", "content": "The answer is"}],
                "bad role": [{"role": "tool", "content": "x"}],
            }
            for name, msgs in bad.items():
                with pytest.raises(anthropic.BadRequestError) as e:
                    await aclient(mine).messages.create(model="p", max_tokens=4, messages=msgs)
                errors[name] = e.value
            with pytest.raises(anthropic.BadRequestError) as e:
                await aclient(mine).messages.create(model="p", max_tokens=4, messages=messages,
                                                    tools=[{"type": "web_search_20250305", "name": "web_search"}])
            errors["server tool"] = e.value
            async with httpx.AsyncClient(timeout=30) as h:  # older clients send the key as x-api-key
                raw_ok = await h.post(f"{mine.session_url}/v1/messages", headers={"x-api-key": mine.api_key},
                                      json={"model": "p", "max_tokens": 4, "messages": messages})
                no_max = await h.post(f"{mine.session_url}/v1/messages", headers={"x-api-key": mine.api_key},
                                      json={"model": "p", "messages": messages})
                wrong = await h.post(f"{mine.session_url}/v1/messages", headers={"x-api-key": "nope"},
                                     json={"model": "p", "max_tokens": 4, "messages": messages})
            return errors, (raw_ok.status_code, raw_ok.json()), no_max, wrong, engine.num_running()

    errors, (ok_status, ok), no_max, wrong, running = asyncio.run(scenario())
    assert {k: e.status_code for k, e in errors.items()} == {
        "wrong key": 401, "another session's key": 401, "image": 400, "prefill": 400, "bad role": 400,
        "server tool": 400}
    for e in errors.values():
        assert e.body["type"] == "error" and set(e.body["error"]) == {"type", "message"}
    assert errors["wrong key"].body["error"]["type"] == "authentication_error"
    assert "messages[0].content[0]" in errors["image"].body["error"]["message"]
    assert "prefill" in errors["prefill"].body["error"]["message"]
    assert "server tools" in errors["server tool"].body["error"]["message"]
    assert ok_status == 200 and ok["type"] == "message"
    assert no_max.status_code == 400 and "max_tokens" in no_max.json()["error"]["message"]
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert running == 0


def test_null_fields_are_not_given_on_the_anthropic_wire_too(model_dir):
    async def scenario():
        async with serving(model_dir, GREEDY) as (proxy, _, _e):
            access = proxy.open_session("s", 200)
            async with httpx.AsyncClient(timeout=30) as h:
                body = {"model": "p", "max_tokens": 4, "messages": [{"role": "user", "content": "1+1="}],
                        **{k: None for k in ("system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
                                             "tools", "tool_choice", "metadata", "thinking")}}
                r = await h.post(f"{access.session_url}/v1/messages", headers={"x-api-key": access.api_key},
                                 json=body)
                return r.status_code, r.json()

    status, body = asyncio.run(scenario())
    assert status == 200, body
    assert json.dumps(body["content"]) and body["stop_reason"] in ("end_turn", "max_tokens")


# The first request of the Claude Code CLI 2.1.327 (claude-agent-sdk 0.2.184) with its defaults, as a logging
# loopback server received it (docs/agentic.md "Claude Agent SDK"), abridged: the environment context's text
# and the metadata's ids shortened.
CLI_REQUEST = {
    "model": "policy", "max_tokens": 32000, "stream": True,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.327.502; cc_entrypoint=sdk-py;"},
               {"type": "text", "text": "you are an agent.", "cache_control": {"type": "ephemeral"}}],
    "tools": [{"name": "DeferredToolPlaceholder", "description": "never call this tool.",
               "input_schema": {"type": "object", "properties": {}}, "defer_loading": True},
              {"name": "mcp__arith__calc", "description": "a+b", "input_schema": CALC["function"]["parameters"]}],
    "messages": [{"role": "user",
                  "content": [{"type": "text", "text": "2+3=", "cache_control": {"type": "ephemeral"}}]},
                 {"role": "system", "content": [{"type": "text", "text": "# environment: linux",
                                                 "cache_control": {"type": "ephemeral"}}]}],
    "metadata": {"user_id": "{\"device_id\":\"96\",\"account_uuid\":\"\",\"session_id\":\"e2\"}"},
    "thinking": {"type": "adaptive", "display": "updates"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
}


def test_the_claude_code_clis_request_is_served_as_it_comes(model_dir, tok):
    """What the CLI sends with its defaults: ``?beta=true``, adaptive thinking, a system message among the
    messages (rendered where it stands), a deferred tool (left out of the prompt, as Anthropic's API keeps it
    out of the model's context), cache_control / metadata / effort / clearing thinking (ignored: nothing the
    policy sees); what would change what the policy sees or writes is still a 400 naming the field."""
    calc = {"type": "function", "function": {"name": "mcp__arith__calc", "description": "a+b",
                                             "parameters": CALC["function"]["parameters"]}}
    expected = render(tok, [{"role": "system", "content": CLI_REQUEST["system"][0]["text"] + "you are an agent."},
                            {"role": "user", "content": "2+3="}, {"role": "system", "content": "# environment: linux"}],
                      tools=[calc])
    refused = {"thinking": {"type": "enabled", "budget_tokens": 1024},
               "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
               "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {}}}}

    async def scenario():
        async with serving(model_dir, GREEDY) as (proxy, rec, _):
            access = proxy.open_session("s", 400)
            async with httpx.AsyncClient(headers={"x-api-key": access.api_key}, timeout=30) as h:
                url = f"{access.session_url}/v1/messages?beta=true"
                async with h.stream("POST", url, json=CLI_REQUEST) as r:
                    events = [line async for line in r.aiter_lines() if line.startswith("event: ")]
                    status = r.status_code
                bad = {k: await h.post(url, json={**CLI_REQUEST, "stream": False, k: v}) for k, v in refused.items()}
                counted = await h.post(f"{access.session_url}/v1/messages/count_tokens?beta=true",
                                       json={k: v for k, v in CLI_REQUEST.items() if k not in ("max_tokens", "stream")})
            return status, events, bad, counted.json(), rec.calls

    status, events, bad, counted, calls = asyncio.run(scenario())
    assert status == 200 and events[0] == "event: message_start" and events[-1] == "event: message_stop"
    assert calls[0][1] == expected and counted["input_tokens"] == len(expected)
    rendered = tok.decode(expected)
    assert "DeferredToolPlaceholder" not in rendered and "mcp__arith__calc(expression)" in rendered
    for field, r in bad.items():
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.json())
