"""The per-session OpenAI endpoint, driven by the real ``openai`` client against a real engine (the
tiny model on ``AsyncHFEngine``): replies equal HF's greedy decoding, usage counts are the real
ones, streaming gives the same text token by token while the engine samples it (the first delta
long before the last) and the session records the streamed ids, tool calls come back structured
(from a model taught to call one), the ids trained on are the ids sampled, a non-prefix request
opens a new segment, and bad requests (wrong key, malformed body, too big, disconnecting
mid-stream, which cancels the request in the engine) never hurt the server."""

import asyncio
import dataclasses
import json
import socket
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from recipes.chat_agent_grpo import chat_metrics
from chat_helpers import CALC, CALL_TEXT, GREEDY, SAMPLED, SlowSteps, client, hand_greedy, render, serving, until_idle
from rlcore.agentic.chat_agent import ChatAgentRunner, ChatAgentSpec
from rlcore.agentic.chat_proxy import session_trajectories
from rlcore.agentic.episode import to_dataproto
from rlcore.agentic.tool_calls import parse_tool_calls
from rlcore.engines.async_hf import AsyncHFEngine
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.models.config import ModelConfig

# ---------------------------------------------------------------------------------------------- wire format
def test_greedy_reply_is_hf_greedy_with_real_usage_and_the_same_text_streamed(model_dir, tok, ref_model):
    messages = [{"role": "user", "content": "12+3="}]
    prompt = render(tok, messages)
    expected = hand_greedy(ref_model, prompt, GREEDY.max_new_tokens, {tok.eos_token_id})

    async def scenario():
        async with serving(model_dir, GREEDY) as (proxy, rec, _):
            c = client(proxy.open_session("s", 200))
            reply = await c.chat.completions.create(model="policy", messages=messages)
            chunks = [ch async for ch in await c.chat.completions.create(
                model="policy", messages=messages, stream=True, stream_options={"include_usage": True})]
            models = await c.models.list()
            return reply, chunks, models, rec.calls

    reply, chunks, models, calls = asyncio.run(scenario())
    assert calls[0][1] == prompt and calls[0][2].token_ids == expected
    assert reply.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
    assert reply.choices[0].finish_reason == ("stop" if expected[-1] == tok.eos_token_id else "length")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(expected))
    assert reply.usage.total_tokens == len(prompt) + len(expected)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == reply.choices[0].message.content
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1  # token by token
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reply.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
    assert [m.id for m in models.data] == ["policy"]


def test_a_streamed_reply_arrives_while_the_engine_samples_it(model_dir, tok):
    """stream=True with the stock client: the first content delta comes long before the last (the
    engine is still sampling), the deltas add up to the non-streamed reply of the same greedy
    request, and the session records exactly the ids that were streamed."""
    long = dataclasses.replace(GREEDY, max_new_tokens=150, ignore_eos=True)
    messages = [{"role": "user", "content": "12+3="}]

    async def scenario():
        async with serving(model_dir, long) as (proxy, rec, engine):
            c = client(proxy.open_session("s", 400))
            whole = await c.chat.completions.create(model="policy", messages=messages)
            arrivals, texts = [], []  # arrivals: the engine's steps taken when each delta came
            with SlowSteps(engine, 0.005) as slow:
                async for ch in await c.chat.completions.create(model="policy", messages=messages, stream=True):
                    if ch.choices and ch.choices[0].delta.content:
                        arrivals.append(slow.steps)
                        texts.append(ch.choices[0].delta.content)
            return whole, arrivals, texts, proxy.close_session("s"), rec

    whole, arrivals, texts, session, rec = asyncio.run(scenario())
    assert len(texts) > 100  # token by token
    assert arrivals[0] < arrivals[-1]  # the engine stepped on after the first delta came: it came while sampling
    assert "".join(texts) == whole.choices[0].message.content
    [segment] = session.segments
    streamed = rec.streamed[0]
    assert len(streamed) == 150 and streamed == rec.calls[1][2].token_ids
    assert [t for t, m in zip(segment.token_ids, segment.policy_mask) if m] == streamed  # the streamed reply kept
    assert session.discarded_replies == 1  # the non-streamed one (the same request again)


def test_logprobs_are_the_samplers_and_top_logprobs_rank_the_step(model_dir, tok, ref_model):
    messages = [{"role": "user", "content": "7+8="}]

    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, rec, _):
            c = client(proxy.open_session("s", 200))
            reply = await c.chat.completions.create(model="policy", messages=messages, logprobs=True, top_logprobs=3)
            return reply, rec.calls[0][2]

    reply, sampled = asyncio.run(scenario())
    content = reply.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(sampled.log_probs)
    prompt = render(tok, messages)
    with torch.no_grad():
        logits = ref_model(torch.tensor([prompt + sampled.token_ids])).logits[0, len(prompt) - 1:-1]
    reference = torch.log_softmax(logits.float(), -1)
    for step, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(reference[step, sampled.token_ids[step]]), abs=1e-4)
        top = reference[step].topk(3)
        assert [tok.convert_tokens_to_ids(t.token) if t.token not in ("</s>",) else tok.eos_token_id
                for t in entry.top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_n_choices_stop_strings_and_max_tokens(model_dir, tok, ref_model):
    messages = [{"role": "user", "content": "3+4="}]
    expected = tok.decode(hand_greedy(ref_model, render(tok, messages), 12, {tok.eos_token_id}),
                          skip_special_tokens=True)
    stop = expected[3:5]  # a stop string the greedy reply holds

    async def scenario():
        async with serving(model_dir, GREEDY) as (proxy, rec, _):
            c = client(proxy.open_session("s", 200))
            three = await c.chat.completions.create(model="policy", messages=messages, n=3)
            stopped = await c.chat.completions.create(model="policy", messages=messages, stop=[stop])
            short = await c.chat.completions.create(model="policy", messages=messages, max_tokens=2)
            return three, stopped, short, rec.calls

    three, stopped, short, calls = asyncio.run(scenario())
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert all(ch.message.content == expected for ch in three.choices)  # greedy: three times the same
    assert three.usage.completion_tokens == sum(len(c.token_ids) for _, _, c in calls[:3])
    assert stopped.choices[0].message.content == expected[:expected.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert short.usage.completion_tokens == 2 and short.choices[0].finish_reason == "length"
    assert short.choices[0].message.content == expected[:2]


# ---------------------------------------------------------------------------------------------- token-exact
def test_the_ids_trained_on_are_the_ids_sampled_across_turns(model_dir, tok):
    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, rec, _):
            c = client(proxy.open_session("s", 400))
            messages = [{"role": "user", "content": "12+30="}]
            for turn in range(3):
                reply = await c.chat.completions.create(model="policy", messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": f"no, try {turn}"}]
            return proxy.close_session("s"), rec.calls

    session, calls = asyncio.run(scenario())
    [segment] = session.segments
    sampled = [c for _, _, c in calls]
    own = [t for t, m in zip(segment.token_ids, segment.policy_mask) if m]
    assert own == [t for c in sampled for t in c.token_ids]
    assert [lp for lp, m in zip(segment.log_probs, segment.policy_mask) if m] == [lp for c in sampled for lp in c.log_probs]
    for i, (_, context, completion) in enumerate(calls):  # each turn's context: the last one's, extended
        if i:
            previous = calls[i - 1][1] + calls[i - 1][2].token_ids
            assert context[:len(previous)] == previous
    assert segment.context() == calls[-1][1] + calls[-1][2].token_ids
    text = tok.decode(segment.context()[len(calls[0][1]):], skip_special_tokens=False)
    assert "\nuser: no, try 0\nassistant: " in text and "\nuser: no, try 1\nassistant: " in text
    env_text = tok.decode([t for t, m in zip(segment.token_ids, segment.policy_mask) if not m])
    # what the template adds after each reply: its end-of-turn "\n" unless the model wrote it, the user turn, the cue
    assert env_text.replace("\n", "") == "user: no, try 0assistant: user: no, try 1assistant: "
    assert env_text.count("\n") + sum(tok.decode(c.token_ids[-1:]) == "\n" for c in sampled[:2]) == 4

    [traj] = session_trajectories(session, 0.5, episode="e0")
    batch = to_dataproto([traj], tok.pad_token_id, 1.0, {"episode": np.array(["e0"], dtype=object)})
    row = batch.batch["responses"][0]
    mask = batch.batch["response_mask"][0].bool()
    assert row[mask].tolist() == own
    assert float(batch.batch["token_level_scores"].sum()) == 0.5


def test_a_request_that_does_not_extend_the_session_starts_a_new_segment(model_dir):
    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, rec, _):
            c = client(proxy.open_session("s", 400))
            first = [{"role": "user", "content": "1+1="}]
            reply = await c.chat.completions.create(model="policy", messages=first)
            again = await c.chat.completions.create(model="policy", messages=first)  # a retry: same request
            compacted = [{"role": "user", "content": "summary: 1+1. answer again"}]  # history rewritten
            await c.chat.completions.create(model="policy", messages=compacted)
            return proxy.close_session("s"), rec.calls, reply, again

    session, calls, reply, again = asyncio.run(scenario())
    assert len(session.segments) == 2 and session.discarded_replies == 1
    first, second = session.segments
    assert first.prompt_ids == calls[0][1] == calls[1][1]  # the retry generated from the same ids
    assert first.token_ids == calls[1][2].token_ids  # the reply the agent got last is the one kept
    assert second.prompt_ids == calls[2][1] and second.token_ids == calls[2][2].token_ids
    trajs = session_trajectories(session, 1.0, episode="ep")
    assert [t.reward for t in trajs] == [1.0, 1.0] and {t.episode_id for t in trajs} == {"ep"}


def test_the_choice_a_request_continues_is_the_one_kept(model_dir):
    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, rec, _):
            c = client(proxy.open_session("s", 400))
            messages = [{"role": "user", "content": "5+5="}]
            reply = await c.chat.completions.create(model="policy", messages=messages, n=3)
            messages += [{"role": "assistant", "content": reply.choices[2].message.content},
                         {"role": "user", "content": "ok"}]
            await c.chat.completions.create(model="policy", messages=messages)
            return proxy.close_session("s"), rec.calls, reply

    session, calls, reply = asyncio.run(scenario())
    [segment] = session.segments
    picked = [c for _, _, c in calls[:3]][2]
    assert segment.token_ids[:len(picked.token_ids)] == picked.token_ids
    assert session.discarded_replies == 2


def test_context_budget_caps_replies_and_refuses_what_cannot_fit(model_dir, tok):
    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, rec, _):
            messages = [{"role": "user", "content": "1+2="}]
            prompt_len = len(render(tok, messages))
            c = client(proxy.open_session("s", prompt_len + 3))
            reply = await c.chat.completions.create(model="policy", messages=messages)
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x" * 300}])
            return reply, err.value

    reply, err = asyncio.run(scenario())
    assert reply.usage.completion_tokens <= 3
    assert err.code == "context_length_exceeded" and err.status_code == 400


# ---------------------------------------------------------------------------------------------- tool calls
def test_parse_tool_calls_keeps_malformed_blocks_as_content():
    content, calls = parse_tool_calls('ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert content == "ok" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    content, calls = parse_tool_calls("<tool_call>{not json}</tool_call>")
    assert calls == [] and content == "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name: not a call


def test_tool_calls_come_back_structured_and_tool_results_render_through_the_template(tool_model_dir):
    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    long = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=80, n=1, do_sample=False)

    async def scenario():
        async with serving(tool_model_dir, long) as (proxy, rec, _):
            c = client(proxy.open_session("s", 400))
            messages = [{"role": "user", "content": "2+3="}]
            first = await c.chat.completions.create(model="policy", messages=messages, tools=[CALC])
            streamed = [ch async for ch in await c.chat.completions.create(
                model="policy", messages=messages, tools=[CALC], stream=True)]
            call = first.choices[0].message.tool_calls[0]
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "5"}]
            answer = await c.chat.completions.create(model="policy", messages=messages, tools=[CALC])
            return first, streamed, answer, proxy.close_session("s")

    first, streamed, answer, session = asyncio.run(scenario())
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("calc", {"expression": "2+3"})]
    deltas = [ch.choices[0].delta for ch in streamed if ch.choices and ch.choices[0].delta.tool_calls]
    assert deltas and deltas[0].tool_calls[0].function.name == "calc"
    assert [ch.choices[0].finish_reason for ch in streamed if ch.choices][-1] == "tool_calls"
    assert answer.choices[0].message.content == "5" and answer.choices[0].finish_reason == "stop"
    [segment] = session.segments  # the retry (the streamed request) discarded, then extended
    env = [t for t, m in zip(segment.token_ids, segment.policy_mask) if not m]
    assert tok.decode(env) == "\ntool: 5\nassistant: "
    own = tok.decode([t for t, m in zip(segment.token_ids, segment.policy_mask) if m])
    assert own == CALL_TEXT + "</s>5</s>"


# ---------------------------------------------------------------------------------------------- safety
def test_keys_sessions_and_bad_bodies_get_openai_errors_and_the_server_goes_on(model_dir):
    async def scenario():
        async with serving(model_dir, SAMPLED, max_request_bytes=4096) as (proxy, _, engine):
            mine, other = proxy.open_session("mine", 200), proxy.open_session("other", 200)
            messages = [{"role": "user", "content": "1+1="}]
            errors = {}
            with pytest.raises(openai.AuthenticationError) as e:
                await client(mine, ).with_options(api_key="wrong").chat.completions.create(model="p", messages=messages)
            errors["wrong key"] = e.value
            stolen = openai.AsyncOpenAI(base_url=other.base_url, api_key=mine.api_key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as e:
                await stolen.chat.completions.create(model="p", messages=messages)
            errors["another session's key"] = e.value
            closed = openai.AsyncOpenAI(base_url=mine.base_url.replace("/s/mine/", "/s/gone/"),
                                        api_key=proxy.api_key("gone"), max_retries=0)
            with pytest.raises(openai.NotFoundError) as e:
                await closed.chat.completions.create(model="p", messages=messages)
            errors["closed session"] = e.value
            raw = {}
            async with httpx.AsyncClient(base_url=mine.base_url, headers={"Authorization": f"Bearer {mine.api_key}"}) as h:
                for name, body in [("not json", b"{oops"), ("no messages", b'{"model": "p"}'),
                                   ("n not a number", json.dumps({"messages": messages, "n": "x"}).encode()),
                                   ("bad role", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode()),
                                   ("penalty", json.dumps({"messages": messages, "presence_penalty": 1}).encode()),
                                   ("too big", json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode())]:
                    r = await h.post("/chat/completions", content=body, headers={"content-type": "application/json"})
                    raw[name] = (r.status_code, r.json())
            ok = await client(mine).chat.completions.create(model="p", messages=messages)
            return errors, raw, ok, engine.num_running()

    errors, raw, ok, running = asyncio.run(scenario())
    assert {k: e.status_code for k, e in errors.items()} == {"wrong key": 401, "another session's key": 401,
                                                           "closed session": 404}
    assert {k: s for k, (s, _) in raw.items()} == {"not json": 400, "no messages": 400, "n not a number": 400,
                                                   "bad role": 400, "penalty": 400, "too big": 413}
    assert raw["n not a number"][1]["error"]["param"] == "n"
    assert "role" in raw["bad role"][1]["error"]["message"]
    assert all(set(body["error"]) >= {"message", "type", "code"} for _, body in raw.values())
    assert ok.choices[0].message.content is not None and running == 0


def test_an_error_inside_a_generation_request_is_a_500_in_its_wire_format_and_the_server_goes_on(model_dir):
    """Generation requests skip the FastAPI app (``ChatProxy._asgi``): an exception there is still the
    wire format's 500 body, OpenAI's or Anthropic's, and the next request on the session is served."""
    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, rec, _):
            access = proxy.open_session("s", 200)
            messages = [{"role": "user", "content": "1+1="}]

            async def broken(*args, **kwargs):
                raise RuntimeError("the engine broke")
            rec.generate = broken
            with pytest.raises(openai.InternalServerError) as openai_error:
                await client(access).chat.completions.create(model="p", messages=messages)
            async with httpx.AsyncClient(base_url=access.session_url, headers={"x-api-key": access.api_key}) as h:
                anthropic_error = await h.post("/v1/messages", json={"model": "p", "max_tokens": 4, "messages": messages})
            del rec.generate
            ok = await client(access).chat.completions.create(model="p", messages=messages)
            return openai_error.value, anthropic_error, ok

    openai_error, anthropic_error, ok = asyncio.run(scenario())
    assert openai_error.status_code == 500 and openai_error.body["type"] == "server_error"
    assert "RuntimeError: the engine broke" in openai_error.body["message"]
    assert anthropic_error.status_code == 500 and anthropic_error.json()["type"] == "error"
    assert "the engine broke" in anthropic_error.json()["error"]["message"]
    assert ok.choices[0].message.content is not None


def test_a_client_that_disconnects_mid_stream_cancels_the_request_and_the_session_goes_on(model_dir):
    long = dataclasses.replace(SAMPLED, max_new_tokens=2000, ignore_eos=True)

    async def scenario():
        async with serving(model_dir, long) as (proxy, rec, engine):
            access = proxy.open_session("s", 4000)
            messages = [{"role": "user", "content": "4+4="}]
            body = {"model": "p", "messages": messages, "stream": True}
            with SlowSteps(engine, 0.002):
                async with httpx.AsyncClient(headers={"Authorization": f"Bearer {access.api_key}"}) as h:
                    async with h.stream("POST", f"{access.base_url}/chat/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if '"content": "' in line and '"content": ""' not in line:
                                break  # read one token's delta, then hang up
                await until_idle(engine)  # the engine drops the request at its next step
                dropped_after = len(rec.streamed[0])
            running = engine.num_running()
            reply = await client(access).chat.completions.create(model="p", messages=messages, max_tokens=5)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "again"}]
            await client(access).chat.completions.create(model="p", messages=messages, max_tokens=5)
            return proxy.close_session("s"), rec.calls, running, dropped_after

    session, calls, running, dropped_after = asyncio.run(scenario())
    assert running == 0 and 0 < dropped_after < 2000  # cancelled before its 2000 tokens (no bound on how soon)
    assert calls[0][2] is None and len(calls) == 3  # the hung-up stream never completed
    [segment] = session.segments  # nothing of it was recorded: the retry continued the same context
    assert session.discarded_replies == 0
    assert segment.prompt_ids == calls[1][1] == calls[0][1]
    assert segment.token_ids[:len(calls[1][2].token_ids)] == calls[1][2].token_ids


def test_the_proxy_listens_on_loopback_only(model_dir):
    async def scenario():
        async with serving(model_dir, SAMPLED) as (proxy, _, _e):
            return proxy.url

    url = asyncio.run(scenario())
    assert url.startswith("http://127.0.0.1:")
    with pytest.raises(OSError):  # and it is gone once stopped
        socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=1).close()


def test_the_runs_sampling_rules_unless_client_sampling_is_on(model_dir, tok, ref_model):
    messages = [{"role": "user", "content": "9+9="}]
    greedy = hand_greedy(ref_model, render(tok, messages), SAMPLED.max_new_tokens, {tok.eos_token_id})

    async def replies(**config):
        async with serving(model_dir, SAMPLED, **config) as (proxy, rec, _):
            c = client(proxy.open_session("s", 200))
            for _ in range(4):
                await c.chat.completions.create(model="p", messages=messages, temperature=0)
            return [completion.token_ids for _, _, completion in rec.calls]

    assert any(ids != greedy for ids in asyncio.run(replies()))  # the run samples at its temperature 1
    assert all(ids == greedy for ids in asyncio.run(replies(client_sampling=True)))


def test_the_calculator_example_agent_runs_the_tool_the_model_calls(tool_model_dir):
    agent = str(Path(__file__).resolve().parents[2] / "examples/agents/calculator_agent.py") + ":CalculatorAgent"
    long = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=80, n=1, do_sample=False)
    spec = ChatAgentSpec(agent, tool_model_dir, long, max_total_tokens=400)

    async def scenario():
        runner = ChatAgentRunner(spec, [AsyncHFEngine(ModelConfig(path=tool_model_dir), RolloutConfig())])
        try:
            return await runner.play({"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}, "s")
        finally:
            await runner.close()

    [segment] = asyncio.run(scenario())
    assert segment.reward == 1.0 and segment.turns == 2  # the call, then the answer
    # one try of two requests (the tool result is no new try): right at the first try, which the
    # metric missed when it counted requests
    assert (segment.metrics["chat/requests"], segment.metrics["chat/tries"]) == (2.0, 1.0)
    assert chat_metrics([segment])["episode/first_try_right"] == 1.0
    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    assert tok.decode([t for t, m in zip(segment.token_ids, segment.policy_mask) if not m]) == "\ntool: 5\nassistant: "
