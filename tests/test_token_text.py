"""Tokens in OpenAI ``logprobs`` objects: each token's own bytes, its text, and where it starts in the returned text,
for a byte-level BPE tokenizer (our tiny models' and SmolLM2's kind) and a SentencePiece one with byte fallback
(Llama-2's kind), against the definitions decoded the slow way (every prefix of the sequence)."""

from __future__ import annotations

import json
import random

import pytest

from petals_chain.orchestrator.sampling import StopMatcher
from petals_chain.orchestrator.tokentext import TokenText

TEXTS = ["The capital of France is Paris.", "漢字の読み方 🦜🧬 ℵ₀ and ascii", "Ελληνικά ☃ naïve café — ok",
         "  leading spaces\nnew line\ttab  ", "日本語 テキスト ✓ is Paris"]


def _byte_level():
    from petals_chain.swarm.tiny_model import build_tokenizer

    return build_tokenizer()


def _sentencepiece():
    """Llama-2's pieces: "▁" word starts, characters outside the vocabulary as <0xNN> bytes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    spm = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    spm.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    spm.train_from_iterator(["The capital of France is Paris. Paris is a city, naive cafe."] * 50,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                show_progress=False))
    # the 256 byte pieces as ordinary vocabulary (a trainer would make them special tokens, which decode skips)
    spec = json.loads(spm.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spm = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=spm, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"byte-level BPE": _byte_level, "SentencePiece, byte fallback": _sentencepiece}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def _offsets(tok, ids, context=()) -> list[int]:
    """Offsets as the API gives them: from the stream's incremental detokenizer, started after ``context``."""
    return StopMatcher(tok, [], list(context)).feed_offsets(ids)


def _slow_offsets(tok, ids: list[int]) -> list[int]:
    """Token i starts after the longest prefix ``ids[:j]``, j <= i, that decodes to whole characters (a decoder
    may turn a whole run of bytes into U+FFFDs while its last character is incomplete)."""
    out, whole = [], 0
    for i in range(len(ids)):
        text = _decode(tok, ids[:i])
        if not text.endswith("\ufffd"):
            whole = len(text)
        out.append(whole)
    return out


def test_offsets_are_where_each_token_starts_in_the_decoded_text(tok):
    """A token that only starts (or continues) a multi-byte character starts where that character does; fed in
    any pieces (a stream's chunks), or after a context (generated text after its prompt), the offsets agree."""
    tt = TokenText(tok)
    rng = random.Random(0)
    saw_partial = False
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        want = _slow_offsets(tok, ids)
        assert _offsets(tok, ids) == want, text
        counter, got, i = StopMatcher(tok, []), [], 0
        while i < len(ids):
            k = rng.randint(1, 4)
            got += counter.feed_offsets(ids[i:i + k])
            i += k
        assert got == want
        # after a context (a prompt ends on a whole character), as generated text is decoded after its prompt
        cut = max(i for i in range(1, len(ids) // 2 + 1) if not _decode(tok, ids[:i]).endswith("\ufffd"))
        rest = _decode(tok, ids)[len(_decode(tok, ids[:cut])):]
        head = len(_decode(tok, ids[:cut]))
        assert _offsets(tok, ids[cut:], ids[:cut]) == [o - head for o in _slow_offsets(tok, ids)[cut:]], text
        assert all(o <= len(rest) for o in _offsets(tok, ids[cut:], ids[:cut]))
        saw_partial |= any(tt.text_of(t).startswith("bytes:") for t in ids)
    assert saw_partial  # the texts do split characters over tokens


def test_token_bytes_make_up_the_text_and_partial_characters_show_as_bytes(tok):
    tt = TokenText(tok)
    for text in TEXTS:
        ids = [t for t in tok(text)["input_ids"] if t not in tt.special]
        raw = b"".join(tt.bytes_of(t) for t in ids)
        decoded = _decode(tok, ids)
        # SentencePiece's decoder drops the first word's space, the pieces keep it
        assert raw.decode("utf-8") in (decoded, " " + decoded), (raw, decoded)
        for t in ids:
            b = tt.bytes_of(t)
            try:
                whole = b.decode("utf-8")
            except UnicodeDecodeError:
                assert tt.text_of(t) == "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            else:
                assert tt.text_of(t) == whole


def test_offsets_after_a_special_token_in_the_text(tok):
    """A skipped special token mid-text (``</s>`` between documents) is no context of its own: alone as the
    decoder's context, the SentencePiece word after it lost its leading space and every later offset was one short."""
    words = tok("Paris", add_special_tokens=False)["input_ids"], tok(" is a city", add_special_tokens=False)["input_ids"]
    ids = words[0] + [tok.eos_token_id] + words[1]
    assert _offsets(tok, ids) == _slow_offsets(tok, ids)
    prompt = words[0] + [tok.eos_token_id]  # generated text after a prompt that ends with one
    head = len(_decode(tok, prompt))
    assert _offsets(tok, words[1], prompt) == [o - head for o in _slow_offsets(tok, ids)[len(prompt):]]


def test_special_tokens_show_as_their_text_and_take_no_room_in_the_text():
    tok = _byte_level()
    tt = TokenText(tok)
    eos = tok.eos_token_id
    ids = tok("Paris")["input_ids"] + [eos] + tok(" is")["input_ids"]
    assert tt.text_of(eos) == tok.eos_token and tt.bytes_of(eos) == tok.eos_token.encode()
    offs = _offsets(tok, ids)
    at = ids.index(eos)
    assert offs[at] == offs[at + 1] == len("Paris")


def test_generated_text_after_a_prompt_equals_decoding_the_whole_sequence(tok):
    """The stream's incremental detokenizer (StopMatcher) starts from the prompt's last tokens; with byte pieces
    (a SentencePiece tokenizer's fallback for CJK) those must start on a whole character, else every byte piece
    after them decoded to U+FFFD ('������' for 'の読み方')."""
    from petals_chain.orchestrator.sampling import StopMatcher

    full = tok("漢字の読み方 漢字の読み方 🦜")["input_ids"]
    checked = 0
    for cut in range(1, len(full)):
        prompt, gen = full[:cut], full[cut:]
        if _decode(tok, prompt).endswith("\ufffd"):
            continue  # a prompt that ends inside a character: its text is not the whole sequence's prefix
        m = StopMatcher(tok, [], prompt)
        out = "".join(m.feed(t) for t in gen) + m.flush()
        assert out == _decode(tok, full)[len(_decode(tok, prompt)):], cut
        checked += 1
    assert checked >= 8
