"""Re-rendered histories: requests that re-send the session's conversation in another form, matched
to the ids the model sampled (one segment) or sealed and counted, with tries counted honestly.

Hand-built message lists on a session over the tiny models' template (char-level tokenizer): the
model's replies are given as token ids, as the engine would return them (its eos included)."""

import pytest

from rlcore.agentic.chat import ChatDelta
from rlcore.agentic.chat_session import ChatSession, Reply
from rlcore.agentic.tool_calls import parse_tool_calls
from rlcore.engines.async_base import Completion
from rlcore.models.tiny import build_char_tokenizer

CALC = {"type": "function", "function": {"name": "calc", "description": "a+b",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}
FINAL = {"type": "function", "function": {"name": "final_answer", "parameters": {"properties": {"answer": {}}}}}
CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'
FINAL_CALL = '<tool_call>{"name": "final_answer", "arguments": {"answer": "5"}}</tool_call>'
SYSTEM = {"role": "system", "content": "use the tools."}
TASK = {"role": "user", "content": "new task: 2+3="}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def reply(tok, text, version=0):
    """What the proxy records for a sampled ``text`` + eos: the completion and the message the agent got."""
    ids = enc(tok, text) + [tok.eos_token_id]
    content, calls = parse_tool_calls(text)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return Reply(Completion(ids, [-0.5] * len(ids), "stop", [version] * len(ids)), message)


def ask(session, messages, tools, answer):
    """One request and its reply; returns the context the model generated on."""
    context = session.context_for(messages, tools)
    session.record([answer])
    return context


def smolagents_text(answer):
    """smolagents' rendering of a reply's tool calls: a Python list of the calls as dicts, ids included."""
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                              "arguments": {"expression": "2+3"}}}
             for c in answer.message["tool_calls"]]
    return "Calling tools:\n" + str(calls)


def render(tok, messages, tools):
    return enc(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools))


def test_tool_calls_resent_as_text_that_the_model_wrote_continue_the_segment(tok):
    """The model's call re-sent as assistant text exactly as it wrote it, the result as a user message:
    the request renders to the segment's ids, so it is an extension (one segment, one try); the next
    step again (the segment's earlier eos is not in the rendering: the message re-tokenises instead)."""
    session = ChatSession("s", ChatDelta(tok), 1000)
    first = reply(tok, CALL)
    ask(session, [SYSTEM, TASK], [CALC], first)
    second = reply(tok, CALL)
    history = [SYSTEM, TASK, {"role": "assistant", "content": CALL}, {"role": "user", "content": "observation: 5"}]
    context = ask(session, history, [CALC], second)
    # the model sees the request's rendering, with its own eos after its turn
    whole = render(tok, history, [CALC])
    cut = len(render(tok, [SYSTEM, TASK], [CALC])) + len(enc(tok, CALL))
    assert context == whole[:cut] + [tok.eos_token_id] + whole[cut:]
    history += [{"role": "assistant", "content": CALL}, {"role": "user", "content": "observation: 5"}]
    ask(session, history, [CALC], reply(tok, "5"))
    [segment] = session.finish()
    assert (session.rerendered_matched, session.rerendered_unmatched, session.tries) == (2, 0, 1)
    assert segment.turns == 3
    sampled = [t for t, m in zip(segment.token_ids, segment.policy_mask) if m]
    assert sampled == 2 * (enc(tok, CALL) + [tok.eos_token_id]) + enc(tok, "5") + [tok.eos_token_id]


def test_a_changed_tool_description_that_renders_the_same_continues_the_segment(tok):
    session = ChatSession("s", ChatDelta(tok), 1000)
    first = reply(tok, CALL)
    ask(session, [TASK], [CALC], first)
    reworded = {"type": "function", "function": {**CALC["function"], "description": "adds"}}
    history = [TASK, first.message, {"role": "tool", "tool_call_id": "x", "content": "5"}]
    ask(session, history, [reworded], reply(tok, "5"))
    [segment] = session.finish()
    assert (session.rerendered_matched, session.tries, segment.turns) == (1, 1, 2)


def test_smolagents_history_is_sealed_counted_and_its_observation_is_no_new_try(tok):
    """Calls re-sent as "Calling tools: [...]" text (not what the model wrote) cannot be matched: each
    step is a segment of its own, on the full rendering of what was sent. The text names the call's
    id, so the "Observation:" user message after it is the call's result: still one try."""
    session = ChatSession("s", ChatDelta(tok), 1000)
    first = reply(tok, CALL)
    ask(session, [SYSTEM, TASK], [CALC, FINAL], first)
    history = [SYSTEM, TASK, {"role": "assistant", "content": smolagents_text(first)},
               {"role": "user", "content": "Observation:\n5"}]
    context = ask(session, history, [CALC, FINAL], reply(tok, FINAL_CALL))
    assert context == render(tok, history, [CALC, FINAL])
    one, two = session.finish()
    assert (session.rerendered_matched, session.rerendered_unmatched, session.tries) == (0, 1, 1)
    assert [sum(s.policy_mask) for s in (one, two)] == [len(CALL) + 1, len(FINAL_CALL) + 1]


def test_a_resent_reply_that_does_not_name_the_calls_ids_counts_a_try(tok):
    """Without the ids nothing shows that the user message answers the call: it opens a try, as before."""
    session = ChatSession("s", ChatDelta(tok), 1000)
    ask(session, [SYSTEM, TASK], [CALC], reply(tok, CALL))
    history = [SYSTEM, TASK, {"role": "assistant", "content": "i called calc"}, {"role": "user", "content": "5"}]
    ask(session, history, [CALC], reply(tok, "5"))
    assert len(session.finish()) == 2
    assert (session.rerendered_matched, session.rerendered_unmatched, session.tries) == (0, 1, 2)


def test_an_edited_reply_is_unmatched_and_a_compacted_history_is_not_a_rerendering(tok):
    session = ChatSession("s", ChatDelta(tok), 1000)
    ask(session, [TASK], None, reply(tok, "6"))
    # the model's "6" came back as "7": not what it wrote; the user's "no" is a new try
    ask(session, [TASK, {"role": "assistant", "content": "7"}, {"role": "user", "content": "no"}], None, reply(tok, "5"))
    assert (session.rerendered_unmatched, session.tries) == (1, 2)
    # a history with the earlier turns dropped is no re-rendering of this one: sealed, as always
    ask(session, [{"role": "user", "content": "again: 2+3="}], None, reply(tok, "5"))
    assert len(session.finish()) == 3
    assert (session.rerendered_matched, session.rerendered_unmatched, session.tries) == (0, 1, 3)


def test_a_matched_text_reply_followed_by_a_user_message_is_a_new_try(tok):
    """The model's text answer re-sent as a content list and the user's "no": matched (one segment),
    and a new try (the reply called no tools, so the user message is no tool result)."""
    session = ChatSession("s", ChatDelta(tok), 1000)
    ask(session, [TASK], [CALC], reply(tok, "6"))
    reworded = {"type": "function", "function": {**CALC["function"], "description": "adds two"}}
    ask(session, [TASK, {"role": "assistant", "content": [{"type": "text", "text": "6"}]},
                  {"role": "user", "content": "no"}], [reworded], reply(tok, "5"))
    assert len(session.finish()) == 1
    assert (session.rerendered_matched, session.tries) == (1, 2)
