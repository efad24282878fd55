"""Env turns through the tokenizer's chat template, by deltas, on both multi-turn paths.

- A Qwen3-like template (``<|im_start|>``/``<|im_end|>`` turns, ``<think>`` blocks of earlier assistant
  turns dropped on re-render): a 3-turn guess_number episode through ``play_episode`` and
  ``MultiTurnRollout`` keeps every earlier id, appends exactly the template's new-turn suffix, and keeps
  the policy's ids as sampled even where re-tokenising their text would give others.
- The tiny template: the ids are those of the ``user: ...\\nassistant: `` text the envs wrote by hand
  before (scripted turns, and sampled episodes of the tiny model against a hand-written legacy env).
- No chat template: a chat env fails at construction, naming itself; arithmetic_retry's raw default
  needs none.
- The tiny template travels with the checkpoint: built, exported (the warm start's ``hf`` folder).
"""

import asyncio
import functools

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.agentic.env import ArithmeticRetryEnv, GuessNumberEnv, make_env
from rlcore.agentic.episode import play_episode, to_dataproto
from rlcore.agentic.multi_turn import MultiTurnRollout
from rlcore.engines.async_base import Completion
from rlcore.engines.base import Generation, RolloutConfig, SamplingSettings
from rlcore.engines.hf_engine import HFEngine
from rlcore.models.config import ModelConfig
from rlcore.models.tiny import CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model
from rlcore.workers.fsdp_utils import export_hf

SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=24, n=1, do_sample=True)

# Qwen3's rule, written small: an assistant message before the last user message loses its
# <think>...</think> on render; the generation cue opens an assistant turn; enable_thinking=False
# pre-fills an empty think block.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_query and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def tiny_tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def qwen_tok():
    """The char tokenizer with Qwen3's markers: im_start/im_end special (im_end the eos, as in Qwen3's
    chat models), <think> and </think> plain added tokens."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<think>", "</think>"])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN3_LIKE
    return tok


def spelled(tok, text):
    """``text`` one character per token: what a policy may sample although the tokenizer has one
    token for ``<think>``; re-encoding its text gives other ids."""
    return [tok.convert_tokens_to_ids(c) for c in text]


class ScriptedEngine:
    """Call k returns ``turns[k]``; records each context it was given."""

    def __init__(self, turns):
        self.turns, self.contexts = [list(t) for t in turns], []

    def next_turn(self, context):
        self.contexts.append(list(context))
        return self.turns[len(self.contexts) - 1]

    async def generate(self, prompt_ids, sampling, session_id=None):  # the async path's engine
        turn = self.next_turn(prompt_ids)
        return Completion(turn, [-0.25] * len(turn), "stop", [0] * len(turn))

    def generate_batch(self, input_ids, attention_mask, position_ids, settings):  # the lockstep path's engine
        assert input_ids.shape[0] == 1, "one episode at a time in these tests"
        turn = self.next_turn(input_ids[0][attention_mask[0].bool()].tolist())
        responses = torch.zeros((1, settings.max_new_tokens), dtype=torch.long)
        responses[0, : len(turn)] = torch.tensor(turn)
        return Generation(responses=responses, lengths=torch.tensor([len(turn)]),
                          log_probs=torch.full((1, settings.max_new_tokens), -0.25))


def both_paths(env_factory, turns, task, max_turns=4, max_total_tokens=400):
    """The episode through ``play_episode`` and through ``MultiTurnRollout``: (trajectory, its
    DataProto, the lockstep DataProto, the contexts each engine saw)."""
    async_engine, lockstep_engine = ScriptedEngine(turns), ScriptedEngine(turns)
    traj = asyncio.run(play_episode(env_factory(), async_engine, task, SAMPLING, max_turns=max_turns,
                                    max_total_tokens=max_total_tokens, session_id=0))
    env = env_factory()
    lockstep = MultiTurnRollout(lockstep_engine.generate_batch, env.tokenizer, env_factory, max_turns, max_total_tokens,
                                SAMPLING).run([task])
    pad = env.tokenizer.pad_token_id
    return traj, to_dataproto([traj], pad, 1.0), lockstep, async_engine.contexts, lockstep_engine.contexts


def assert_same_rows(a, b):
    for key in ("prompts", "responses", "input_ids", "attention_mask", "response_mask", "rollout_log_probs",
                "token_level_scores"):
        assert torch.equal(a.batch[key], b.batch[key]), key


# ------------------------------------------------------------------ a Qwen3-like template
def test_qwen_like_template_three_turns_by_deltas(qwen_tok):
    tok = qwen_tok
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    t1 = spelled(tok, "<think>hmm</think>50") + [im_end]  # ends with its end-of-turn token
    t2 = spelled(tok, "<think>ok</think>25")  # cut at its budget: no end-of-turn token of its own
    t3 = spelled(tok, "<think>so</think>37") + [im_end]
    for turn in (t1, t2, t3):  # the sampled ids are not what encoding their text gives
        assert ids(tok, tok.decode(turn)) != turn and tok.decode(ids(tok, tok.decode(turn))) == tok.decode(turn)

    env_factory = functools.partial(GuessNumberEnv, tok, max_turns=3)
    traj, out, lockstep, contexts, lockstep_contexts = both_paths(env_factory, [t1, t2, t3], {"target": 37})
    assert_same_rows(out, lockstep)
    assert contexts == lockstep_contexts

    question = "guess my number from 1 to 100."
    prompt_text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    new1 = "<|im_start|>user\ntoo high<|im_end|>\n<|im_start|>assistant\n"
    new2 = "<|im_start|>user\ntoo low<|im_end|>\n<|im_start|>assistant\n"
    prompt = ids(tok, prompt_text)
    d1 = ids(tok, "\n" + new1)  # the model wrote <|im_end|>: only the "\n" after it is missing
    d2 = ids(tok, "<|im_end|>\n" + new2)  # cut short: the whole end-of-turn is the env's
    assert traj.prompt_ids == prompt == contexts[0]
    assert traj.token_ids == t1 + d1 + t2 + d2 + t3
    assert traj.policy_mask == [1] * len(t1) + [0] * len(d1) + [1] * len(t2) + [0] * len(d2) + [1] * len(t3)
    assert (traj.reward, traj.turns, traj.terminated) == (pytest.approx(0.81), 3, True)

    # Earlier-turn ids never change: each context the engine saw is the one before, its turn and the delta.
    assert contexts == [prompt, prompt + t1 + d1, prompt + t1 + d1 + t2 + d2]
    # The delta is what the template adds for the new user turn: the suffix of rendering the whole
    # conversation, after the closing of the model's turn ...
    u0 = {"role": "user", "content": question}
    a1 = {"role": "assistant", "content": tok.decode(t1, skip_special_tokens=True)}
    a2 = {"role": "assistant", "content": tok.decode(t2, skip_special_tokens=True)}
    u1, u2 = {"role": "user", "content": "too high"}, {"role": "user", "content": "too low"}
    whole1 = tok.apply_chat_template([u0, a1, u1], tokenize=False, add_generation_prompt=True)
    whole2 = tok.apply_chat_template([u0, a1, u1, a2, u2], tokenize=False, add_generation_prompt=True)
    assert whole1.endswith("50<|im_end|>\n" + new1) and whole2.endswith("25<|im_end|>\n" + new2)
    # ... while that whole rendering is not the episode's: it dropped the earlier <think> blocks.
    assert "<think>hmm</think>" not in whole2 and "<think>ok</think>" not in whole2
    assert ids(tok, whole2) != contexts[2]
    assert tok.decode(contexts[2]).count("<think>") == 2  # the episode kept what the policy saw

    # The policy's ids are in the trajectory as sampled, each with its sampler log-prob.
    sampled = [t for t, m in zip(traj.token_ids, traj.policy_mask) if m]
    assert sampled == t1 + t2 + t3
    assert out.batch["rollout_log_probs"][0][out.batch["response_mask"][0].bool()].tolist() == [-0.25] * len(sampled)


def test_qwen_like_template_arithmetic_retry_in_chat_mode(qwen_tok):
    tok = qwen_tok
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    wrong, right = ids(tok, "4") + [im_end], ids(tok, "3") + [im_end]
    env_factory = functools.partial(make_env, "arithmetic_retry", tok, chat_template=True)
    traj, out, lockstep, _, _ = both_paths(env_factory, [wrong, right], {"prompt": "1+2=", "answer": "3"})
    assert_same_rows(out, lockstep)
    assert tok.decode(traj.prompt_ids) == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert traj.token_ids == wrong + ids(tok, "\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n") + right
    assert traj.reward == 0.5


# ------------------------------------------------------------------ the tiny template renders as before
class LegacyGuessNumberEnv(GuessNumberEnv):
    """guess_number's turns as it wrote them before they went through the chat template: the
    tiny format spelled out by hand (``"user: {c}\\nassistant: "``, each reply after a ``"\\n"``)."""

    def render_prompt(self, messages, **_):
        (message,) = messages
        return self.encode(f"user: {message['content']}\nassistant: ")

    def render_turn(self, action_token_ids, messages, **_):
        (message,) = messages
        return self.encode(f"\nuser: {message['content']}\nassistant: ")


def test_tiny_template_gives_the_hand_written_ids(tiny_tok):
    tok, eos = tiny_tok, tiny_tok.eos_token_id
    turns = [ids(tok, "50") + [eos], ids(tok, "2"), ids(tok, "hm") + [eos], ids(tok, "37") + [eos]]
    env_factory = functools.partial(GuessNumberEnv, tok, max_turns=5)
    traj, out, lockstep, contexts, _ = both_paths(env_factory, turns, {"target": 37}, max_turns=5)
    legacy, legacy_out, _, legacy_contexts, _ = both_paths(functools.partial(LegacyGuessNumberEnv, tok, max_turns=5),
                                                           turns, {"target": 37}, max_turns=5)
    assert_same_rows(out, lockstep)
    assert_same_rows(out, legacy_out)
    assert contexts == legacy_contexts
    # ... and those are the very characters, written out here once more.
    text = ("user: guess my number from 1 to 100.\nassistant: 50</s>\nuser: too high\nassistant: 2"
            "\nuser: too low\nassistant: hm</s>\nuser: say a number\nassistant: 37</s>")
    assert tok.decode(traj.context()) == text and traj.context() == ids(tok, text)
    # The final reply, which no path appends, is the old one too.
    env = GuessNumberEnv(tok)
    asyncio.run(env.reset({"target": 37}))
    assert asyncio.run(env.step(ids(tok, "37") + [eos])).observation == ids(tok, "\ncorrect")
    # The one difference, on purpose: a turn whose own text ends with the template's end-of-turn
    # ("\n") is closed by it, as the template would render it; the old text wrote a second "\n".
    env = GuessNumberEnv(tok)
    asyncio.run(env.reset({"target": 37}))
    assert asyncio.run(env.step(ids(tok, "50\n") + [eos])).observation == ids(tok, "user: too high\nassistant: ")


def test_arithmetic_retry_stays_raw_by_default_and_renders_the_tiny_chat_format_when_asked(tiny_tok):
    tok, task = tiny_tok, {"prompt": "1+2=", "answer": "3"}
    raw, chat = ArithmeticRetryEnv(tok), ArithmeticRetryEnv(tok, chat_template=True)
    assert asyncio.run(raw.reset(task)) == ids(tok, "1+2=")  # what the shipped multi_turn_grpo run sees
    assert asyncio.run(raw.step(ids(tok, "4"))).observation == ids(tok, "\n1+2=")
    assert asyncio.run(chat.reset(task)) == ids(tok, "user: 1+2=\nassistant: ")
    assert asyncio.run(chat.step(ids(tok, "4") + [tok.eos_token_id])).observation == ids(tok, "\nuser: 1+2=\nassistant: ")


def test_sampled_tiny_episodes_equal_the_hand_written_format(tmp_path):
    """The tiny model sampling against guess_number: the same batch, id for id, as against the env
    that writes the old text by hand (fresh engines with one seed: the same samples while the contexts agree)."""
    path = build_tiny_model(tmp_path / "tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    settings = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6, n=1, do_sample=True)

    def run(env_cls):
        engine = HFEngine(ModelConfig(path=path), RolloutConfig(seed=5))
        rollout = MultiTurnRollout(engine, tok, functools.partial(env_cls, tok, max_turns=3), max_turns=3,
                                   max_total_tokens=120, settings=settings)
        return rollout.run([{}] * 4, seeds=[1, 2, 3, 4])

    new, old = run(GuessNumberEnv), run(LegacyGuessNumberEnv)
    assert_same_rows(new, old)
    env_tokens = new.batch["attention_mask"][:, new.batch["prompts"].shape[1]:].bool() & ~new.batch["response_mask"].bool()
    assert env_tokens.any() and int(new.non_tensor_batch["num_turns"].max()) > 1  # multi-turn for real


# ------------------------------------------------------------------ no chat template
def test_a_chat_env_without_a_chat_template_is_an_error_naming_it():
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="GuessNumberEnv renders its turns through the chat template.*no chat template"):
        make_env("guess_number", tok)
    with pytest.raises(ValueError, match="ArithmeticRetryEnv.*no chat template"):
        ArithmeticRetryEnv(tok, chat_template=True)
    env = ArithmeticRetryEnv(tok)  # the raw default needs none
    assert asyncio.run(env.reset({"prompt": "1+2=", "answer": "3"})) == ids(tok, "1+2=")


# ------------------------------------------------------------------ the template travels with the model
def test_the_tiny_template_is_saved_with_the_model_and_its_export(tmp_path):
    src = build_tiny_model(tmp_path / "init_model", seed=0)
    assert AutoTokenizer.from_pretrained(src).chat_template == CHAT_TEMPLATE
    # export_hf writes the SFT recipe's <run>/hf, the folder the RL recipes warm-start from.
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        export_hf(AutoModelForCausalLM.from_pretrained(src), src, str(tmp_path / "hf"))
    finally:
        if started:
            dist.destroy_process_group()
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported.chat_template == CHAT_TEMPLATE
    env = GuessNumberEnv(exported)
    assert asyncio.run(env.reset({"target": 3})) == ids(exported, "user: guess my number from 1 to 100.\nassistant: ")
