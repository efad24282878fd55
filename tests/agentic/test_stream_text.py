"""Streamed reply text (``TextStream``) fed one token at a time: characters split over several
byte-level tokens come out whole, SentencePiece's word-initial spaces are kept, stop strings and
tool calls are held back, and the deltas always add up to the text the non-streamed reply has."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlcore.agentic.stream_text import TextStream

TEXTS = ["日本語 é 🙂 ok", "naïve café, 中文", "plain ascii, then 😀😀 and more"]


def byte_level() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 / Qwen style) with few merges: a CJK character or an emoji is 3-4 tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["</s>"])
    tok.train_from_iterator(["hello world, plain ascii text and more"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def metaspace() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer ("▁" for spaces, dropped at the start of a decode)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(["the answer is five and the other answer is six"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def stream(tok, ids, **kw):
    s = TextStream(tok, **kw)
    deltas = [s.push([i]) for i in ids]
    return s, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_multi_byte_characters_come_out_whole(text):
    tok = byte_level()
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # characters really are split over tokens
    s, deltas = stream(tok, ids + [tok.eos_token_id])
    assert not any("\ufffd" in d for d in deltas)
    assert sum(d == "" for d in deltas) > 0  # some tokens were half a character: nothing to send yet
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) + s.finish(full) == full == text


def test_word_initial_spaces_of_sentencepiece_tokens_are_kept():
    tok = metaspace()
    text = "the answer is six"
    ids = tok.encode(text, add_special_tokens=False)
    s, deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text


def test_a_stop_string_is_held_back_and_never_sent():
    tok = byte_level()
    ids = tok.encode("abc STOP def", add_special_tokens=False)
    s, deltas = stream(tok, ids, stops=("STOP",))
    assert "".join(deltas) == "abc " and s.closed
    assert s.finish("abc ") == ""
    s, deltas = stream(tok, tok.encode("abc ST", add_special_tokens=False), stops=("STOP",))
    assert "".join(deltas) == "abc " and s.finish("abc ST") == "ST"  # a stop prefix at the end: text after all


def test_tool_calls_are_held_back_for_the_final_chunk():
    tok = byte_level()
    text = 'let me add <tool_call>{"name": "calc"}</tool_call>'
    s, deltas = stream(tok, tok.encode(text, add_special_tokens=False), hold_tool_calls=True)
    assert "".join(deltas) == "let me add "
    assert s.finish("let me add") == ""  # the parsed content (stripped) adds nothing the client has not seen
    s, deltas = stream(tok, tok.encode("a < b and <tool", add_special_tokens=False), hold_tool_calls=True)
    assert "".join(deltas) == "a < b and "  # "<" alone went out once it could not start a call
