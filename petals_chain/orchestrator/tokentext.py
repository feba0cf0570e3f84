"""Tokens as the OpenAI ``logprobs`` objects show them: each token's own bytes, its text, and where it starts in the
returned text (that offset comes from the stream's incremental detokenizer, ``sampling.StopMatcher.feed_offsets``).

A token decoded alone is not its part of the text: byte-level BPE splits rare characters (CJK, many emoji) over
several tokens, each of which decodes alone to U+FFFD, and a SentencePiece tokenizer drops the leading space of a
sequence's first word. So a token's ``bytes`` come from its vocabulary piece (byte-level: GPT-2's byte-to-character
map undone; SentencePiece: ``▁`` is a space, ``<0xNN>`` one byte), its text is those bytes when they are whole
UTF-8 and OpenAI's ``bytes:\\xNN`` form when they are not.
"""

from __future__ import annotations

import re
from typing import Sequence

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SENTENCEPIECE_SPACE = "\u2581"  # "▁": SentencePiece's word start
CONTEXT_TOKENS = 4  # prompt tokens an incremental decoder starts from (leading spaces, merged bytes)
MAX_CHARACTER_BYTES = 4  # UTF-8


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
    doing so for every byte piece that follows."""
    ids = [int(t) for t in ids]
    for k in range(min(n, len(ids)), min(n + MAX_CHARACTER_BYTES, len(ids)) + 1):
        if not tokenizer.decode(ids[-k:], skip_special_tokens=True).startswith("\ufffd"):
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
