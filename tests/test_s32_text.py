"""Text correctness with the real model's tokenizer (SmolLM2, byte-level BPE with chat-markup special tokens): the
stream's incremental detokenizer against ``tokenizer.decode`` on token ids SmolLM2 generated greedily (emoji and
kana split over tokens), stop strings over those, and logprobs' ``text_offset`` of a prompt echoed as sent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from petals_chain.orchestrator.sampling import StopMatcher, TokenChoice, offsets_in_text
from petals_chain.orchestrator.tokentext import TokenText

# the chat template's prompt for "Reply only with five different emoji." and "Translate 'I love cats' into Japanese
# and Chinese.", and SmolLM2-135M-Instruct's greedy answers (checked against transformers' generate)
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
STAR = [10813, 230, 249]  # "🌟" in three tokens
EMOJI = STAR * 4
KANA = [7365, 237, 10391, 230, 7365, 124, 11100, 233, 46763, 11100, 234, 11100, 119, 7365, 117, 7365, 124]


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from petals_chain.swarm.sources import resolve_source

    return resolve_source("smollm2-135m").load_tokenizer()


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def _stream(tok, prompt, gen, stop=()):
    """The pieces a stream shows, as the decode loop feeds the matcher (flush at the end), and the matcher."""
    m = StopMatcher(tok, list(stop), prompt)
    pieces = []
    for t in gen:
        pieces.append(m.feed(t))
        if m.stopped:
            break
    pieces.append(m.flush())
    return pieces, m


@pytest.mark.parametrize("question,gen", [("Reply only with five different emoji.", EMOJI),
                                          ("Translate 'I love cats' into Japanese and Chinese.", KANA)])
def test_streamed_text_equals_decoding_and_shows_no_partial_character(tok, question, gen):
    prompt = tok(CHAT.format(question))["input_ids"]
    want = _decode(tok, prompt + gen)[len(_decode(tok, prompt)):]
    assert "\ufffd" not in want
    for n in range(1, len(gen) + 1):  # cut anywhere: a partial character is held, never shown as U+FFFD
        pieces, m = _stream(tok, prompt, gen[:n])
        assert all("\ufffd" not in p for p in pieces[:-1]), (n, pieces)
        assert "".join(pieces) == m.text == _decode(tok, prompt + gen[:n])[len(_decode(tok, prompt)):]
    assert "".join(_stream(tok, prompt, gen)[0]) == want


@pytest.mark.parametrize("gen,stop,want,stopped", [
    (EMOJI, ["🌟🌟"], "", True),  # spans six tokens, from the first
    (EMOJI, ["🌟🌟🌟🌟🌟X"], "🌟🌟🌟🌟", False),  # a prefix of the text that never completes: all of it is released
    (EMOJI, ["🌟🌟🌟🌟🌟X", "🌟🌟🌟🌟"], "", True),  # several: the one that matches
    (KANA, ["ハンバ", "らで"], "これは", True),  # each character split over two tokens
    (KANA, ["はハX", "では"], "これはハンバラ", True),
])
def test_stop_strings_over_multibyte_tokens(tok, gen, stop, want, stopped):
    prompt = tok(CHAT.format("Reply only with five different emoji."))["input_ids"]
    pieces, m = _stream(tok, prompt, gen, stop)
    assert "".join(pieces) == m.text == want and m.stopped == stopped
    if not stopped:  # held back while the stop was possible, then shown whole
        assert "".join(pieces[:-1]) == "" and pieces[-1] == want


def test_echoed_prompt_offsets_count_its_chat_markup(tok):
    """A completions prompt written with its chat markup is echoed as sent, markup included; decoding skips the
    special tokens, so their offsets (and every later token's) came from a text without them: ``user`` at 0, not
    12, and every offset of the prompt pointed at the wrong characters."""
    tt = TokenText(tok)
    text = CHAT.format("Hi there 🌟 漢字")
    ids = tok(text)["input_ids"]
    assert any(t in tt.special for t in ids)
    offsets = offsets_in_text(tok, ids, text)
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[1] == len("<|im_start|>")
    for t, o in zip(ids, offsets):
        if not tt.text_of(t).startswith("bytes:"):
            assert text[o:o + len(tt.text_of(t))] == tt.text_of(t), (t, o)
    # a text without the markup (a token-id prompt's echo, decoded): the stream's offsets, specials take no room
    plain = _decode(tok, ids)
    assert offsets_in_text(tok, ids, plain) == StopMatcher(tok, []).feed_offsets(ids)


def test_added_special_tokens_outside_all_special_ids_are_silent(tok):
    """SmolLM2's ``<file_sep>`` & co. are special (decoding skips them) but not in ``all_special_ids``: a run of them
    stayed in the incremental decoder's window and was decoded again at every token (quadratic, on the event
    loop), and an echoed prompt with one in its text had every later offset short by its length."""
    sep = tok.convert_tokens_to_ids("<file_sep>")
    assert sep not in tok.all_special_ids and tok.decode([sep], skip_special_tokens=True) == ""
    m = StopMatcher(tok, [], tok("Hi")["input_ids"])
    context = len(m.ids)
    assert [m.feed(sep) for _ in range(50)] == [""] * 50
    assert len(m.ids) == context  # nothing left to decode again
    assert m.feed(tok(" there")["input_ids"][0]) == " there"
    text = "a<file_sep>b c"
    ids = tok(text)["input_ids"]
    assert sep in ids
    assert offsets_in_text(tok, ids, text) == [0, 1, len("a<file_sep>"), len("a<file_sep>b")]


def test_api_echo_logprobs_offsets_point_into_the_echoed_prompt(tok):
    from petals_chain.orchestrator.api import _Logprobs

    lp = _Logprobs(SimpleNamespace(tokenizer=tok, token_text=TokenText(tok)))
    text = CHAT.format("Hi")
    ids = tok(text)["input_ids"]
    out = lp.completion([None] + [TokenChoice(t, -1.0, []) for t in ids[1:]], ids, text=text)
    assert [text[o:o + len(t)] for t, o in zip(out["tokens"], out["text_offset"])] == out["tokens"]
