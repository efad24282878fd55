"""The per-session OpenAI Responses endpoint (``/s/<session>/v1/responses``), driven by the stock
``openai`` client's ``responses.create`` / ``responses.stream`` against the real tiny-model engine: a
greedy response is the chat route's reply on the same conversation with the real usage; the stream's
deltas add up to it in the Responses event order; the ids trained on are the ids sampled, also
across ``previous_response_id``; tools round-trip (function_call out, function_call_output in) with
the model taught to call one; bad inputs and unknown routes get clear 4xx bodies; and the two
Responses-based framework agents (the OpenAI Agents SDK, pydantic-ai) play a token-exact episode."""

import asyncio
import dataclasses
import json
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from chat_helpers import CALC, CALL_TEXT, GREEDY, SAMPLED, Recording, client, hand_greedy, render, serving
from rlcore.agentic.chat_agent import ChatAgentRunner, ChatAgentSpec
from rlcore.engines.async_hf import AsyncHFEngine
from rlcore.engines.base import RolloutConfig
from rlcore.models.config import ModelConfig
from rlcore.agentic.chat_session import RequestError
from rlcore.agentic.responses_wire import chat_request, input_messages, parse_responses_request
from rlcore.registry import load_named

TOOL = {"type": "function", "name": "calc", "description": "a+b", "parameters": CALC["function"]["parameters"]}
LONG = dataclasses.replace(GREEDY, max_new_tokens=80)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples/agents"


def own(segment) -> list[int]:
    return [t for t, m in zip(segment.token_ids, segment.policy_mask) if m]


def env(segment) -> list[int]:
    return [t for t, m in zip(segment.token_ids, segment.policy_mask) if not m]


def test_items_decode_into_chat_messages_one_assistant_turn_per_reply():
    """A reply's text and its calls come back as a message item then function_call items: one assistant
    message again (as the session recorded it); outputs are tool messages; instructions lead, not kept."""
    call = lambda i: {"type": "function_call", "call_id": f"call_{i}", "name": "calc",  # noqa: E731
                      "arguments": json.dumps({"expression": f"{i}+1"}), "id": f"fc_{i}", "status": "completed"}
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "1+1="}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me see",
                                                                    "annotations": []}]},
             call(1), call(2),
             {"type": "function_call_output", "call_id": "call_1", "output": "2"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "3"}]}]
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "calc", "arguments": call(i)["arguments"]}}
             for i in (1, 2)]
    expected = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="},
                {"role": "assistant", "content": "let me see", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "2"},
                {"role": "tool", "tool_call_id": "call_2", "content": "3"}]
    assert input_messages(items) == expected
    history = [{"role": "user", "content": "0="}, {"role": "assistant", "content": "0"}]
    req = parse_responses_request({"input": items[1:], "instructions": "hi", "max_output_tokens": 5,
                                   "tools": [TOOL], "tool_choice": {"type": "function", "name": "calc"}})
    chat, conversation = chat_request(req, history)
    assert chat.messages == [{"role": "system", "content": "hi"}] + history + expected[1:]
    assert conversation == history + expected[1:]  # what a response to it keeps: no instructions
    assert (chat.max_tokens, chat.tools, chat.tool_mode()) == (5, [CALC], ("function", "calc"))
    with pytest.raises(RequestError, match="call_2"):  # its output is missing
        chat_request(parse_responses_request({"input": items[:-1]}), [])


def test_a_greedy_response_is_the_chat_routes_reply_with_real_usage(model_dir, tok, ref_model):
    system, messages = "be brief", [{"role": "user", "content": "12+3="}]
    prompt = render(tok, [{"role": "system", "content": system}] + messages)
    expected = hand_greedy(ref_model, prompt, GREEDY.max_new_tokens, {tok.eos_token_id})

    async def scenario():
        async with serving(model_dir, GREEDY) as (proxy, rec, _):
            access = proxy.open_session("s", 200)
            c = client(access)
            reply = await c.responses.create(model="policy", instructions=system, input="12+3=")
            parts = await c.responses.create(model="policy", input=[
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": system}]},
                {"role": "user", "content": [{"type": "input_text", "text": "12+3="}]}], store=False,
                parallel_tool_calls=True)
            chat = await client(proxy.open_session("chat", 200)).chat.completions.create(
                model="policy", messages=[{"role": "system", "content": system}] + messages)
            short = await c.responses.create(model="policy", input="12+3=", instructions=system, max_output_tokens=3)
            scored = await c.responses.create(model="policy", input="12+3=", instructions=system,
                                              include=["message.output_text.logprobs"], top_logprobs=2)
            return reply, parts, chat, short, scored, rec.calls

    reply, parts, chat, short, scored, calls = asyncio.run(scenario())
    assert [c[1] for c in calls[:3]] == [prompt] * 3  # a developer message and input_text parts render the same
    assert [c[2].token_ids for c in calls[:3]] == [expected] * 3  # HF's greedy ids, on either route
    text = tok.decode(expected, skip_special_tokens=True)
    assert reply.output_text == parts.output_text == chat.choices[0].message.content == text
    [item] = reply.output
    assert (item.type, item.role, item.content[0].type) == ("message", "assistant", "output_text")
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == "policy"
    assert reply.status == ("completed" if expected[-1] == tok.eos_token_id else "incomplete")
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == (
        len(prompt), len(expected), len(prompt) + len(expected))
    assert (short.status, short.incomplete_details.reason, short.usage.output_tokens) == ("incomplete",
                                                                                           "max_output_tokens", 3)
    assert short.output_text == tok.decode(expected[:3], skip_special_tokens=True)
    entries = scored.output[0].content[0].logprobs  # the engine's own log-probs, token by token
    assert [e.logprob for e in entries] == pytest.approx(calls[4][2].log_probs) and len(entries) == len(expected)
    assert [e.token for e in entries] == [tok.decode([t]) for t in expected]
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_streamed_deltas_add_up_to_the_response_in_the_responses_event_order(model_dir):
    long = dataclasses.replace(GREEDY, max_new_tokens=30, ignore_eos=True)

    async def scenario():
        async with serving(model_dir, long) as (proxy, rec, _):
            c = client(proxy.open_session("s", 400))
            whole = await c.responses.create(model="p", input="12+3=")
            events = [e async for e in await c.responses.create(model="p", input="12+3=", stream=True)]
            return whole, events, rec.streamed, rec.calls

    whole, events, streamed, calls = asyncio.run(scenario())
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # max_output_tokens cut it: as OpenAI ends such a stream
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == len(kinds) - 8 > 10 and "".join(deltas) == whole.output_text
    assert events[-4].text == whole.output_text and [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 30
    assert final.id == events[0].response.id
    assert streamed[0] == calls[0][2].token_ids == calls[1][2].token_ids  # greedy: the same ids, streamed


def test_the_ids_trained_on_are_the_ids_sampled_across_previous_response_id(model_dir, tok):
    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, rec, _):
            c = client(proxy.open_session("s", 400))
            first = await c.responses.create(model="p", input="12+30=", instructions="be brief")
            second = await c.responses.create(model="p", input="no, try 0", previous_response_id=first.id,
                                              instructions="be brief")
            items = lambda r: [o.model_dump(exclude_none=True) for o in r.output]  # noqa: E731
            resent = [{"role": "user", "content": "12+30="}, *items(first), {"role": "user", "content": "no, try 0"},
                      *items(second), {"role": "user", "content": "no, try 1"}]  # all of it again
            third = await c.responses.create(model="p", input=resent, instructions="be brief")
            fourth = await c.responses.create(model="p", input="no, try 2", previous_response_id=third.id,
                                              instructions="be brief")
            return proxy.close_session("s"), rec.calls, (first, second, third, fourth)

    session, calls, replies = asyncio.run(scenario())
    [segment] = session.segments
    assert len(calls) == 4 and session.tries == 4
    assert own(segment) == [t for _, _, c in calls for t in c.token_ids]  # every sampled id, nothing else
    assert segment.context() == calls[-1][1] + calls[-1][2].token_ids
    for i in range(1, 4):  # each request extends the last one's exact ids
        previous = calls[i - 1][1] + calls[i - 1][2].token_ids
        assert calls[i][1][:len(previous)] == previous
    assert tok.decode(env(segment)).replace("\n", "") == \
        "user: no, try 0assistant: user: no, try 1assistant: user: no, try 2assistant: "
    assert segment.prompt_ids == render(tok, [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "12+30="}])
    assert [r.usage.input_tokens for r in replies] == [len(c[1]) for c in calls]


def test_tools_round_trip_streamed_and_continued(tool_model_dir):
    """The model taught to call calc: a function_call item out (streamed too, with responses.stream), a
    function_call_output item in (resent history, or previous_response_id), the answer 5, one segment."""
    tok = AutoTokenizer.from_pretrained(tool_model_dir)

    async def scenario():
        async with serving(tool_model_dir, LONG) as (proxy, rec, _):
            c = client(proxy.open_session("s", 400))
            first = await c.responses.create(model="p", input="2+3=", tools=[TOOL])
            async with c.responses.stream(model="p", input="2+3=", tools=[TOOL]) as stream:
                events = [e async for e in stream]
                streamed = await stream.get_final_response()
            forced = await c.responses.create(model="p", input="2+3=", tools=[TOOL],
                                              tool_choice={"type": "function", "name": "calc"})
            [call] = streamed.output
            result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
            history = [{"role": "user", "content": "2+3="}, call.model_dump(exclude_none=True), result]
            answer = await c.responses.create(model="p", input=history, tools=[TOOL])
            session = proxy.close_session("s")
            c2 = client(proxy.open_session("t", 400))  # the same, continued by previous_response_id
            called = await c2.responses.create(model="p", input="2+3=", tools=[TOOL])
            output = {"type": "function_call_output", "call_id": called.output[0].call_id, "output": "5"}
            continued = await c2.responses.create(model="p", input=[output], tools=[TOOL],
                                                  previous_response_id=called.id)
            return first, events, streamed, forced, (answer, continued), (session, proxy.close_session("t")), rec.calls

    first, events, streamed, forced, (answer, continued), (session, continued_session), calls = asyncio.run(scenario())
    assert calls[0][1] == render(tok, [{"role": "user", "content": "2+3="}], tools=[CALC])  # the flat tool rendered
    for reply in (first, streamed, forced):
        [item] = reply.output
        assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "calc", {"expression": "2+3"})
        assert item.call_id.startswith("call_") and item.id.startswith("fc_") and reply.status == "completed"
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert answer.output_text == continued.output_text == "5" and answer.status == continued.status == "completed"
    opening = '<tool_call>{"name": "calc", "arguments": '
    assert tok.decode(calls[2][1][-len(tok.encode(opening)):]) == opening  # the named tool_choice: its opening given
    [segment] = session.segments  # the retries (streamed, forced) discarded, the forced one continued
    assert tok.decode(env(segment)) == opening + "\ntool: 5\nassistant: "
    assert tok.decode(own(segment)) == CALL_TEXT[len(opening):] + "</s>5</s>"
    assert own(segment) == calls[2][2].token_ids + calls[3][2].token_ids
    [segment] = continued_session.segments
    assert tok.decode(env(segment)) == "\ntool: 5\nassistant: " and tok.decode(own(segment)) == CALL_TEXT + "</s>5</s>"
    assert own(segment) == calls[4][2].token_ids + calls[5][2].token_ids


def test_bad_inputs_and_unknown_routes_get_clear_4xx_bodies(model_dir):
    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, rec, engine):
            mine, other = proxy.open_session("mine", 200), proxy.open_session("other", 200)
            theirs = await client(other).responses.create(model="p", input="1+1=")
            unstored = await client(mine).responses.create(model="p", input="1+1=", store=False)
            call = {"type": "function_call", "call_id": "call_abc", "name": "calc", "arguments": "{}"}
            bad = {
                "unknown item": {"input": [{"role": "user", "content": "1+1="}, {"type": "reasoning", "summary": []}]},
                "missing output": {"input": [{"role": "user", "content": "1+1="}, call], "tools": [TOOL]},
                "orphan output": {"input": [{"role": "user", "content": "1+1="},
                                            {"type": "function_call_output", "call_id": "call_zzz", "output": "2"}]},
                "another session's": {"input": "again", "previous_response_id": theirs.id},
                "unknown id": {"input": "again", "previous_response_id": "resp_nope"},
                "not stored": {"input": "again", "previous_response_id": unstored.id},
                "hosted tool": {"input": "1+1=", "tools": [TOOL, {"type": "web_search"}]},
                "image": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                "bad role": {"input": [{"role": "wizard", "content": "x"}]},
                "json schema": {"input": "1+1=", "text": {"format": {"type": "json_schema", "name": "x",
                                                                     "schema": {}}}},
                "empty": {"input": []},
                "parallel false": {"input": "1+1=", "tools": [TOOL], "parallel_tool_calls": False},
            }
            errors = {}
            for name, body in bad.items():
                with pytest.raises(openai.BadRequestError) as e:
                    await client(mine).responses.create(model="p", **body)
                errors[name] = e.value
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {mine.api_key}"}, timeout=30) as h:
                routes = {(m, p): await h.request(m, proxy.url + p) for m, p in [
                    ("POST", "/s/mine/v1/foo"), ("GET", "/s/mine/v1/responses"), ("DELETE", "/v1/responses"),
                    ("POST", "/s/mine/v1/messages/nope")]}
            ok = await client(mine).responses.create(model="p", input="1+1=")
            return errors, routes, ok, engine.num_running(), len(rec.calls)

    errors, routes, ok, running, generated = asyncio.run(scenario())
    message = {k: e.body["message"] for k, e in errors.items()}
    assert all(e.status_code == 400 and e.body["type"] == "invalid_request_error" for e in errors.values())
    assert "input[1]" in message["unknown item"] and "'reasoning'" in message["unknown item"]
    assert "call_abc" in message["missing output"] and "function_call_output" in message["missing output"]
    assert "call_zzz" in message["orphan output"]
    assert "another session" in message["another session's"] and errors["another session's"].param == \
        "previous_response_id"
    assert "resp_nope" in message["unknown id"] and "not a response of this session" in message["unknown id"]
    assert "store=false" in message["not stored"]
    assert "tools[1]" in message["hosted tool"] and "'web_search'" in message["hosted tool"]
    assert "input[0].content[0]" in message["image"] and "'input_image'" in message["image"]
    assert "wizard" in message["bad role"] and "json_schema" in message["json schema"]
    assert "input" in message["empty"] and errors["parallel false"].param == "parallel_tool_calls"
    for (method, path), r in routes.items():
        body = r.json()
        text = body["error"]["message"]
        assert r.status_code == 404 and text.startswith(f"no route {method} {path}; served: ")
        assert "POST /s/{session_id}/v1/responses" in text and "POST /s/{session_id}/v1/chat/completions" in text
        assert ("type" in body) == ("/v1/messages" in path)  # Anthropic's error shape on its paths
    assert ok.output_text is not None and running == 0 and generated == 3  # the bad ones generated nothing


@pytest.mark.parametrize("agent", ["openai_agents_sdk.py:AgentsSDKCalculator",
                                   "pydantic_ai_responses.py:PydanticAICalculator"])
def test_the_responses_framework_agents_run_the_tool_the_model_calls(tool_model_dir, agent):
    """The framework's own loop on the Responses route: the model calls calc, the framework runs it and
    sends the output back, the model answers 5; one token-exact segment of one try."""
    spec = ChatAgentSpec(str(EXAMPLES / agent), tool_model_dir, LONG, max_total_tokens=400)

    async def scenario():
        engine = AsyncHFEngine(ModelConfig(path=tool_model_dir), RolloutConfig())
        runner = ChatAgentRunner(spec, [engine])
        recording = Recording(runner.router)  # what the engine sampled, written down
        runner.proxy.generator = runner.proxy.turns.generator = recording
        bodies, serve = [], runner.proxy.responses.serve
        runner.proxy.responses.serve = lambda session, body: bodies.append(body) or serve(session, body)
        try:
            played = await runner.play({"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}, "s")
            return played, recording, bodies
        finally:
            await runner.close()

    [segment], recording, bodies = asyncio.run(scenario())
    # both requests came on the Responses route, the second with the tool's output as an item
    assert len(bodies) == 2
    assert {"type": "function_call_output", "output": "5"}.items() <= bodies[1]["input"][-1].items()
    assert segment.reward == 1.0 and segment.turns == 2  # the call, then the answer
    assert (segment.metrics["chat/segments"], segment.metrics["chat/tries"]) == (1.0, 1.0)
    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    assert tok.decode(env(segment)) == "\ntool: 5\nassistant: "  # the tool's result, rendered
    assert tok.decode(own(segment)) == CALL_TEXT + "</s>5</s>"
    calls = recording.calls
    assert len(calls) == 2 and own(segment) == calls[0][2].token_ids + calls[1][2].token_ids  # ids trained = sampled
    assert segment.prompt_ids == calls[0][1] == render(tok, [{"role": "user", "content": "2+3="}], tools=[CALC])


def test_the_frameworks_streamed_and_chained_paths_round_trip_the_tool_too(tool_model_dir):
    """The same frameworks on their other paths: the Agents SDK streamed (``Runner.run_streamed``) and
    chained by ``previous_response_id`` (``auto_previous_response_id=True``), pydantic-ai streamed
    (``run_stream``); each answers 5 after the tool call, in one segment of one try."""
    from agents import Agent, OpenAIResponsesModel, Runner
    from pydantic_ai.models.openai import OpenAIResponsesModel as PydanticResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calc = load_named(f"{EXAMPLES / 'openai_agents_sdk.py'}:calc", "tool")
    pydantic_agent = load_named(f"{EXAMPLES / 'pydantic_ai_responses.py'}:agent", "agent")

    async def scenario():
        async with serving(tool_model_dir, LONG) as (proxy, _, _e):
            bodies, serve = [], proxy.responses.serve
            proxy.responses.serve = lambda session, body: bodies.append(body) or serve(session, body)

            def sdk_agent(access):
                model = OpenAIResponsesModel(model="policy", openai_client=client(access))
                return Agent(name="calculator", tools=[calc], model=model)

            access = proxy.open_session("streamed", 400)
            run = Runner.run_streamed(sdk_agent(access), "2+3=")
            kinds = {e.type async for e in run.stream_events()}
            before = len(bodies)
            chained = await Runner.run(sdk_agent(proxy.open_session("chained", 400)), "2+3=",
                                       auto_previous_response_id=True)
            chained_bodies = bodies[before:]
            access = proxy.open_session("pydantic", 400)
            model = PydanticResponsesModel("policy", provider=OpenAIProvider(base_url=access.base_url,
                                                                             api_key=access.api_key))
            async with pydantic_agent.run_stream("2+3=", model=model) as result:
                output = await result.get_output()
            sessions = {name: proxy.close_session(name) for name in ("streamed", "chained", "pydantic")}
            return (run.final_output, chained.final_output, output), kinds, sessions, chained_bodies

    outputs, kinds, sessions, chained = asyncio.run(scenario())
    assert outputs == ("5", "5", "5") and "raw_response_event" in kinds
    # the second request continued the first by its id, sending only the tool's output
    assert chained[1]["previous_response_id"] in sessions["chained"].responses
    assert [item["type"] for item in chained[1]["input"]] == ["function_call_output"]
    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    for session in sessions.values():
        [segment] = session.segments
        assert session.tries == 1 and tok.decode(env(segment)) == "\ntool: 5\nassistant: "
