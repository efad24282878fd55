"""TextCodec: the fast tokenizer's backend called directly gives exactly transformers' encode /
decode, and the wrapper runs wherever the backend's state or the tokenizer's settings would differ."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlcore.agentic.text_codec import TextCodec
from rlcore.models.tiny import build_char_tokenizer

TEXTS = ["12+3=", " wrong, try again: 7*8=", "user: 5-2=\nassistant: ", "", "  a  b  ", "a , b .",
         "<|im_start|>user\nhi<|im_end|>\n", "no<eos>more", "\t \n"]


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on a few lines (what GPT-2 / Llama-3 / SmolLM2 tokenizers are), with
    special tokens of its own."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["Mia has 17 apples and buys 25 more. How many apples does she have?", "Answer with the number only.",
              "wrong, try again: 7*8=", "hello world, hello there"] * 20
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|im_start|>")


@pytest.fixture(params=["char", "bpe"])
def tok(request):
    return build_char_tokenizer() if request.param == "char" else bpe_tokenizer()


def test_encode_and_decode_equal_the_wrapper(tok):
    codec = TextCodec(tok)
    assert codec._backend is not None  # the direct path is the one under test
    for text in TEXTS + ["Mia has 17 apples and buys 25 more.", "é中文 🙂"]:  # the char tokenizer: <unk>s
        ids = tok.encode(text, add_special_tokens=False)
        assert codec.encode(text) == ids, text
        ids = ids + [tok.eos_token_id]
        for skip in (True, False):
            assert codec.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip), (text, skip)


def test_a_truncating_call_elsewhere_does_not_truncate_the_codec(tok):
    codec = TextCodec(tok)
    text = "hello world, hello there"
    full = tok.encode(text, add_special_tokens=False)
    assert len(tok(text, truncation=True, max_length=3, add_special_tokens=False)["input_ids"]) == 3
    assert tok.backend_tokenizer.truncation is not None  # the wrapper left its state on the backend
    assert codec.encode(text) == full  # the wrapper ran (and reset it)
    assert tok.backend_tokenizer.truncation is None and codec.encode(text) == full


def test_decode_cleans_up_spaces_where_the_tokenizer_does():
    tok = build_char_tokenizer()
    tok.clean_up_tokenization_spaces = True  # " ," -> "," etc. in transformers' decode
    ids = tok.encode("a , b . c", add_special_tokens=False)
    assert tok.decode(ids) == "a, b. c"
    assert TextCodec(tok).decode(ids, skip_special_tokens=True) == "a, b. c"
