"""The worker's Tokenize / Detokenize answers (worker/tokens.py) on a real
tokenizer: the session's generated model, a byte-level BPE as GPT-2, Llama 3 and Qwen use."""

from __future__ import annotations

import pytest

from shared import protocol as p
from worker import prompts, tokens

TEXT = "This is a test string with unicode 媽 and emoji 🤗"


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded[1]


def ask(tokenizer, **kw):
    return tokens.tokenize(tokenizer, p.Tokenize(request_id="r", **kw))


def test_tokenize_gives_the_tokenizers_own_ids_and_no_bos_unless_add_special(tokenizer):
    plain = ask(tokenizer, text=TEXT)
    special = ask(tokenizer, text=TEXT, add_special=True)
    assert plain.tokens == tokenizer.encode(TEXT, add_special_tokens=False)
    assert special.tokens == [tokenizer.bos_token_id, *plain.tokens]
    assert plain.pieces == []


def test_pieces_are_each_tokens_bytes_and_join_to_the_text(tokenizer):
    answer = ask(tokenizer, text=TEXT, with_pieces=True)
    assert len(answer.pieces) == len(answer.tokens)
    assert b"".join(answer.pieces) == TEXT.encode()
    # the emoji's four bytes are split over tokens here: some pieces are not whole UTF-8
    partial = [raw for raw in answer.pieces if not _utf8(raw)]
    assert partial and all(raw for raw in answer.pieces)


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_parse_special_false_reads_special_token_text_as_plain_text(tokenizer):
    text = "a <|im_start|> b"
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start in ask(tokenizer, text=text).tokens
    plain = ask(tokenizer, text=text, parse_special=False, with_pieces=True)
    assert im_start not in plain.tokens and b"".join(plain.pieces) == text.encode()


def test_special_tokens_piece_is_their_text(tokenizer):
    answer = ask(tokenizer, text="<|im_end|>", with_pieces=True)
    assert answer.pieces == [b"<|im_end|>"]


def test_messages_are_counted_through_the_chat_template_as_a_generation_is(tokenizer):
    turns = [p.ChatMessage(role="system", content="Be brief."), p.ChatMessage(role="user", content="Hi")]
    answer = ask(tokenizer, messages=turns)
    assert answer.tokens == prompts.encode_chat(tokenizer, turns)


def test_detokenize_round_trips_and_names_an_id_outside_the_vocabulary(tokenizer):
    ids = ask(tokenizer, text=TEXT).tokens
    back = tokens.detokenize(tokenizer, p.Detokenize(request_id="d", tokens=ids))
    assert back == p.Detokenized(request_id="d", text=TEXT)
    bad = tokens.detokenize(tokenizer, p.Detokenize(request_id="d", tokens=[1, len(tokenizer)]))
    assert isinstance(bad, p.Failed) and bad.code == "invalid_request" and str(len(tokenizer)) in bad.message
    assert tokens.detokenize(tokenizer, p.Detokenize(request_id="d", tokens=[-1])).code == "invalid_request"


def test_neither_or_both_of_text_and_messages_is_a_failed_answer(tokenizer):
    for kw in ({}, {"text": "a", "messages": [p.ChatMessage(role="user", content="a")]}):
        answer = ask(tokenizer, **kw)
        assert isinstance(answer, p.Failed) and answer.code == "invalid_request"
