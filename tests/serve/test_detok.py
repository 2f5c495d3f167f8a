"""Streamed text pieces add up to the final text; stop strings and half characters are never streamed."""

import pytest

from ecru.serve.engine.detok import Decoder, TextStream


@pytest.fixture(scope="module")
def decode():
    from ecru.models import load_smollm2

    return Decoder(load_smollm2()[1])


def stream_all(decode, text, stop=()):
    ids = decode.tokenizer(text, add_special_tokens=False)["input_ids"]
    s = TextStream(decode, stop)
    pieces = []
    for t in ids:
        pieces.append(s.push(t))
        if s.stopped:
            break
    pieces.append(s.finish())
    return s, pieces


def test_pieces_add_up_to_the_decoded_text_multibyte_included(decode):
    text = "Café ☕ costs 3€ — naïve 日本語 emoji 🎉🎉 end."
    s, pieces = stream_all(decode, text)
    assert "".join(pieces) == s.text == text
    assert not any("\ufffd" in p for p in pieces) and sum(bool(p) for p in pieces) > 5


def test_stop_string_ends_the_text_before_it_and_is_never_streamed(decode):
    s, pieces = stream_all(decode, "one two three STOP four five", stop=("STOP",))
    assert s.stopped and s.text == "one two three " == "".join(pieces)
    assert all("S" not in p for p in pieces)


def test_a_partial_stop_match_is_released_when_it_does_not_complete(decode):
    s, pieces = stream_all(decode, "alpha beta gamma", stop=("beta delta",))
    assert not s.stopped and "".join(pieces) == "alpha beta gamma"
