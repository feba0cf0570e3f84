"""Incremental decoding and stop strings (sampling.StopMatcher) on hostile token runs: stray UTF-8 bytes, special
tokens, long overlapping stop strings. Unit level, no orchestrator."""

from __future__ import annotations

import random

import pytest

from petals_chain.orchestrator.sampling import StopMatcher
from petals_chain.orchestrator.tokentext import TokenText
from petals_chain.swarm.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()  # byte-level BPE, as the real models'


class Counting:
    """The tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0
        self.all_special_ids = tok.all_special_ids

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def stream(m: StopMatcher, ids) -> list[str]:
    return [m.feed(t) for t in ids] + [m.flush()]


def test_a_run_of_stray_bytes_is_shown_as_it_comes_and_decoded_once(tok):
    """Bytes that never make a character (0x80 after 0x80) held the whole run back: each token decoded the run
    again (512 tokens: 0.04 ms a token, 4096: 0.27) and a stream showed nothing before the end."""
    stray = next(i for i in range(len(tok)) if TokenText(tok).bytes_of(i) == b"\x80")
    prompt = tok.encode("Hello there", add_special_tokens=False)
    counting = Counting(tok)
    m = StopMatcher(counting, [], prompt)
    n = 400
    pieces = stream(m, [stray] * n)
    assert "".join(pieces[:n // 2]), "nothing was shown during the run"
    assert counting.decoded < 40 * n, counting.decoded  # was about n * n
    assert "".join(pieces) == m.text == tok.decode([stray] * n) == "\ufffd" * n


def test_special_tokens_add_nothing_and_are_not_decoded_again(tok):
    """end-of-text after end-of-text (``ignore_eos``) was kept in the decoder's window: decoded again per token."""
    counting = Counting(tok)
    m = StopMatcher(counting, [], tok.encode("Hello", add_special_tokens=False))
    ids = [tok.eos_token_id] * 400 + tok.encode(" there", add_special_tokens=False)
    assert "".join(stream(m, ids)) == m.text == " there"
    assert counting.decoded < 40 * len(ids), counting.decoded


def test_any_soup_of_bytes_decodes_as_the_whole_sequence_does(tok):
    """Stray bytes, cut characters, whole ones and special tokens in any order: the pieces are the full decode."""
    text = TokenText(tok)
    single = [i for i in range(len(tok)) if len(text.bytes_of(i)) == 1 and text.bytes_of(i)[0] >= 0x80]
    pieces = single + tok.encode("中é😀ü ab\n", add_special_tokens=False) + tok.all_special_ids
    rng = random.Random(5)
    for trial in range(150):
        ids = [rng.choice(pieces) for _ in range(rng.randrange(1, 120))]
        prompt = tok.encode("Hi", add_special_tokens=False) if trial % 2 else []
        m = StopMatcher(tok, [], prompt)
        out = "".join(stream(m, ids))
        assert out == m.text == tok.decode(ids, skip_special_tokens=True), ids


class Bytes:
    """Tokens of given bytes, decoded as byte-level BPE decodes (invalid bytes: U+FFFD)."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_the_run_is_never_cut_inside_a_character_a_token_completed():
    """A token that ends one character and starts the next (bytes AD E4): the run is taken before the first."""
    tok = Bytes([b"\xff", b"\xe4", b"\xb8", b"\xad\xe4"])
    ids = [0] * 9 + [1, 2, 3] + [0] * 6
    m = StopMatcher(tok, [])
    assert "".join(stream(m, ids)) == m.text == tok.decode(ids) == "\ufffd" * 9 + "中" + "\ufffd" * 7


class Chars:
    """One token per character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def naive_pieces(stop: list[str], text: str) -> list[str]:
    """The hold-back as first written: every prefix of every stop tested at every character."""
    out, emitted = [], 0
    for end in range(1, len(text) + 1):
        t = text[:end]
        found = [p for p in (t.find(s) for s in stop) if p != -1]
        if found:
            out.append(t[emitted:min(found)])
            return out
        hold = 0
        for s in stop:
            for k in range(min(len(s) - 1, len(t)), 0, -1):
                if t.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        safe = max(emitted, len(t) - hold)
        out.append(t[emitted:safe])
        emitted = safe
    return out + [text[emitted:]]


def test_stop_hold_back_is_the_longest_stop_prefix_the_text_ends_with():
    """Each piece is what testing every prefix of every stop gave (now a KMP state per stop, per character)."""
    rng = random.Random(3)
    for _ in range(400):
        stop = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 7))) for _ in range(rng.randrange(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 40)))
        expected = naive_pieces(stop, text)
        expected += [""] * (len(text) + 1 - len(expected))  # stopped: nothing after the cut
        assert stream(StopMatcher(Chars(), stop), [ord(c) for c in text]) == expected, (stop, text)
