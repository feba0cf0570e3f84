"""Tokens as the OpenAI ``logprobs`` objects show them: each token's own bytes, its text, and where it starts in the
returned text (that offset comes from the stream's incremental detokenizer, ``sampling.StopMatcher.feed_offsets``).

A token decoded alone is not its part of the text: byte-level BPE splits rare characters (CJK, many emoji) over
several tokens, each of which decodes alone to U+FFFD, and a SentencePiece tokenizer drops the leading space of a
sequence's first word. So a token's ``bytes`` come from its vocabulary piece (byte-level: GPT-2's byte-to-character
map undone; SentencePiece: ``▁`` is a space, ``<0xNN>`` one byte), its text is those bytes when they are whole
UTF-8 and OpenAI's ``bytes:\\xNN`` form when they are not.

A token-id prompt may end inside a character (its last id the first bytes of ``漢``): that character belongs to the
text that completes it, the generated text (:func:`incomplete_end`, :func:`whole_text`), so that an echoed prompt and
its completion together are the decoding of all their tokens.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, Sequence

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SENTENCEPIECE_SPACE = "\u2581"  # "▁": SentencePiece's word start
CONTEXT_TOKENS = 4  # prompt tokens an incremental decoder starts from (leading spaces, merged bytes)
MAX_CHARACTER_BYTES = 4  # UTF-8
# second bytes of the lead bytes that allow fewer than 0x80..0xBF (Unicode's table 3-7): the others would spell an
# overlong form (0xE0 0x80), a surrogate (0xED 0xA0) or a code point past U+10FFFF (0xF4 0x90)
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the other 68 are
    shifted past 255 so that every byte is a visible character."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in visible}
    shifted = 0
    for b in range(256):
        if b not in visible:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def context_tail(tokenizer, ids: Sequence[int], n: int = CONTEXT_TOKENS) -> list[int]:
    """The last ``n`` or more of ``ids`` as a decoder's context, starting on a whole character: a byte-fallback
    decoder turns a whole run of byte pieces to U+FFFDs when the run starts inside a character, and would keep
    doing so for every byte piece that follows. The character ``ids`` may end inside of is not looked at: it turns
    its whole run of byte pieces to U+FFFDs, whole characters before it too."""
    ids = [int(t) for t in ids]
    end = len(ids)
    if tokenizer.decode(ids[-n:], skip_special_tokens=True).endswith("\ufffd"):
        cut = incomplete_end(tokenizer, ids)
        end = cut[0] if cut is not None else end
    for k in range(min(n, len(ids)), min(n + MAX_CHARACTER_BYTES, len(ids)) + 1):
        if len(ids) - k <= end and not tokenizer.decode(ids[-k:end], skip_special_tokens=True).startswith("\ufffd"):
            return ids[-k:]
    return ids[-min(n, len(ids)):] if ids else []


class TokenText:
    """Per-token bytes and display text for one tokenizer (cached: tokens repeat)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = backend is not None and "ByteLevel" in repr(getattr(backend, "decoder", None))
        self._byte_of = _byte_level_decoder() if self.byte_level else {}
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._bytes: dict[int, bytes] = {}
        self._text: dict[int, str] = {}

    def bytes_of(self, token: int) -> bytes:
        """The token's own bytes (a special token: its text)."""
        b = self._bytes.get(token)
        if b is None:
            b = self._bytes[token] = self._compute_bytes(token)
        return b

    def _compute_bytes(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(int(token))
        if not isinstance(piece, str):
            return self.tokenizer.decode([int(token)]).encode("utf-8")
        if token in self.special:
            return piece.encode("utf-8")
        if (m := _BYTE_PIECE.match(piece)) is not None:
            return bytes([int(m.group(1), 16)])
        if self.byte_level and all(ch in self._byte_of for ch in piece):
            return bytes(self._byte_of[ch] for ch in piece)
        if SENTENCEPIECE_SPACE in piece:
            return piece.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")
        # added tokens and vocabularies of another kind: what the tokenizer itself makes of it
        return self.tokenizer.decode([int(token)]).encode("utf-8")

    def text_of(self, token: int) -> str:
        """The token's text; ``bytes:\\xNN…`` (OpenAI's form) when its bytes are only part of a character."""
        t = self._text.get(token)
        if t is None:
            b = self.bytes_of(token)
            try:
                t = b.decode("utf-8")
            except UnicodeDecodeError:
                t = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            self._text[token] = t
        return t


_TOKEN_TEXTS: "weakref.WeakKeyDictionary[Any, TokenText]" = weakref.WeakKeyDictionary()


def token_text(tokenizer) -> TokenText:
    """The :class:`TokenText` of ``tokenizer``, made once per tokenizer (a new one when it cannot be cached)."""
    try:
        return _TOKEN_TEXTS[tokenizer]
    except (KeyError, TypeError):
        pass
    tt = TokenText(tokenizer)
    try:
        _TOKEN_TEXTS[tokenizer] = tt
    except TypeError:  # not weakly referenceable
        pass
    return tt


def _needs(lead: int) -> int:
    """The length of the UTF-8 sequence ``lead`` starts; 0 for a byte no multi-byte character starts with."""
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def incomplete_end(tokenizer, ids: Sequence[int]) -> tuple[int, str] | None:
    """Where ``ids`` end inside a character: ``(j, head)``, ``ids[j]`` the token that holds its first byte and
    ``head`` the text of that token's bytes before it (``" "`` for SmolLM2's ``Ġæ``, the space and the first byte of
    ``漢``). None when ``ids`` end on a whole character, or on bytes no character can become (stray bytes, which stay
    U+FFFD wherever they are)."""
    tt = token_text(tokenizer)
    tail, first = b"", len(ids)
    while first > 0 and len(tail) < MAX_CHARACTER_BYTES - 1:  # an incomplete character has at most 3 bytes
        tok = int(ids[first - 1])
        if tok in tt.special:  # decoding drops it or spells it out: no character spans it
            break
        tail = tt.bytes_of(tok) + tail
        first -= 1
    # the last character's first byte: the last byte that is not a continuation byte (10xxxxxx)
    at = next((p for p in range(len(tail) - 1, max(-1, len(tail) - MAX_CHARACTER_BYTES), -1)
               if tail[p] & 0xC0 != 0x80), None)
    if at is None or not len(tail) - at < _needs(tail[at]):
        return None
    lo, hi = _SECOND_BYTE.get(tail[at], (0x80, 0xBF))
    if len(tail) - at > 1 and not lo <= tail[at + 1] <= hi:  # a start no character has
        return None
    pos = 0
    for j in range(first, len(ids)):
        piece = tt.bytes_of(int(ids[j]))
        if pos + len(piece) > at:
            return j, piece[:at - pos].decode("utf-8", "replace")
        pos += len(piece)
    return None  # (unreachable: byte ``at`` lies in one of the tokens)


def whole_text(tokenizer, ids: Sequence[int]) -> str:
    """``ids`` decoded without the character they end inside of (:func:`incomplete_end`), which belongs to the text
    that completes it: a token-id prompt's echo when a completion follows it, so that the echo and the completion
    together are the decoding of all their tokens (the echo showed ``�`` and the completion lost the character)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    cut = incomplete_end(tokenizer, ids) if text.endswith("\ufffd") else None
    if cut is None:
        return text
    j, head = cut
    before = tokenizer.decode(list(ids[:j]), skip_special_tokens=True)
    if text.startswith(before + head):
        return before + head
    # a byte-fallback decoder turns the whole run of byte pieces the incomplete character ends to U+FFFDs ("漢" and
    # 字's first byte: four of them): the tokens before the character, if they decode to whole characters
    return before if not before.endswith("\ufffd") else text
