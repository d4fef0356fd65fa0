"""A completion's text as tokens arrive: characters split over tokens, stop strings across token boundaries, text
held back while it may still become a stop string."""

from __future__ import annotations

import random

from hybrid_attention.data.tokenizer import ByteTokenizer
from hybrid_attention.inference.completion_text import CompletionText


def feed(text: str, stop=(), flush=True):
    stream = CompletionText(ByteTokenizer(), tuple(stop))
    pieces = []
    for b in text.encode("utf-8"):
        piece, stopped = stream.add(b)
        pieces.append(piece)
        if stopped:
            return pieces, True
    if flush:
        pieces.append(stream.flush())
    return pieces, False


def test_multibyte_characters_arrive_whole():
    pieces, stopped = feed("añ€😀b")
    assert "".join(pieces) == "añ€😀b" and not stopped
    assert "😀" in pieces  # four tokens, one piece


def test_stop_strings_across_tokens_end_the_text_before_them():
    pieces, stopped = feed("hello world, bye", stop=("wor", "xyz"))
    assert stopped and "".join(pieces) == "hello "
    pieces, stopped = feed("abcab", stop=("cab",))
    assert stopped and "".join(pieces) == "ab"
    pieces, stopped = feed("abc", stop=("abc", "b"))  # "b" is complete first
    assert stopped and "".join(pieces) == "a"


def test_held_back_text_is_sent_once_it_cannot_be_a_stop():
    pieces, stopped = feed("xx<en", stop=("<end>",), flush=False)
    assert "".join(pieces) == "xx" and not stopped  # "<en" may still become "<end>"
    pieces, stopped = feed("xx<enough", stop=("<end>",))
    assert "".join(pieces) == "xx<enough" and not stopped


def expected(text: str, stop) -> str:
    """The text up to the first stop string to be completed (the earliest-starting one among those complete by
    then), searched plainly."""
    ends = [text.find(s) + len(s) for s in stop if s in text]
    if not ends:
        return text
    seen = text[: min(ends)]
    return seen[: min(seen.find(s) for s in stop if s in seen)]


def test_random_texts_match_a_plain_search():
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("abé ") for _ in range(rng.randint(0, 20)))
        stop = tuple("".join(rng.choice("abé") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3)))
        pieces, stopped = feed(text, stop)
        assert "".join(pieces) == expected(text, stop), (text, stop)
        assert stopped == any(s in text for s in stop)


def test_a_long_completion_keeps_only_a_bounded_window():
    """The stream keeps the unsent text and the few sent characters a stop string could start in, never the whole
    completion (so each token costs the same, however long the completion runs)."""
    rng = random.Random(1)
    stop = ("<end>", "q")
    stream = CompletionText(ByteTokenizer(), stop)
    sent = []
    text = "".join(rng.choice("ab<end z") for _ in range(20_000))
    while "<end>" in text:
        text = text.replace("<end>", "<e>")
    for b in text.encode():
        piece, stopped = stream.add(b)
        assert not stopped
        sent.append(piece)
        assert len(stream._before) + len(stream._unsent) <= 2 * (len("<end>") - 1)
    sent.append(stream.flush())
    assert "".join(sent) == text
