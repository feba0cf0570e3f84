"""Prefix hashes: how the orchestrator names a token prefix to servers, which never see tokens.

The orchestrator cuts a sequence into blocks of :data:`PREFIX_BLOCK_TOKENS` tokens and sends, for each full
block, a hash of *every token up to its end* (a hash chain: block ``j``'s hash covers tokens
``[0, (j + 1) * PREFIX_BLOCK_TOKENS)``), :data:`HASH_BYTES` bytes each, concatenated. The K/V of any decoder
layer at a position depends only on the tokens up to it, so a server names a KV page by the hash at the page's
last token: page ``j`` of ``page_size`` tokens is named by block hash ``(j + 1) * page_size / 16 - 1``
(:func:`page_hashes`; prefix caching needs a page size that is a multiple of 16).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

PREFIX_BLOCK_TOKENS = 16  # tokens per hashed block (the default page size)
HASH_BYTES = 16  # blake2b digest size: collisions are out of reach for any swarm


def prefix_hashes(token_ids: Sequence[int], salt: bytes = b"") -> bytes:
    """The hash chain of ``token_ids``' full blocks, concatenated (``len // 16`` hashes). ``salt`` starts the
    chain: the same tokens under another salt never match (the orchestrator changes it to retire every cached
    prefix at once, e.g. after banning a server whose replies other servers' KV was computed from)."""
    out = bytearray()
    prev = bytes(salt)
    for start in range(0, len(token_ids) - PREFIX_BLOCK_TOKENS + 1, PREFIX_BLOCK_TOKENS):
        block = token_ids[start:start + PREFIX_BLOCK_TOKENS]
        prev = hashlib.blake2b(prev + struct.pack(f"<{PREFIX_BLOCK_TOKENS}I", *block), digest_size=HASH_BYTES).digest()
        out += prev
    return bytes(out)


def split_hashes(blob: bytes) -> list[bytes]:
    """The hashes of a :func:`prefix_hashes` blob; ``ValueError`` if it is not a whole number of them."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) % HASH_BYTES:
        raise ValueError(f"prefix hashes must be bytes, a multiple of {HASH_BYTES} long")
    return [bytes(blob[i:i + HASH_BYTES]) for i in range(0, len(blob), HASH_BYTES)]


def page_hashes(block_hashes: bytes | Sequence[bytes], page_size: int) -> list[bytes]:
    """The names of the full pages of ``page_size`` tokens covered by ``block_hashes`` (a list, or a
    :func:`prefix_hashes` blob; ``[]`` when ``page_size`` is not a multiple of :data:`PREFIX_BLOCK_TOKENS`)."""
    if isinstance(block_hashes, (bytes, bytearray)):
        block_hashes = split_hashes(block_hashes)
    if page_size < 1 or page_size % PREFIX_BLOCK_TOKENS:
        return []
    step = page_size // PREFIX_BLOCK_TOKENS
    return list(block_hashes[step - 1::step])


def supports_prefix_cache(page_size: int) -> bool:
    """Whether pages of ``page_size`` tokens can be named by prefix hashes."""
    return page_size >= 1 and page_size % PREFIX_BLOCK_TOKENS == 0


__all__ = ["PREFIX_BLOCK_TOKENS", "HASH_BYTES", "prefix_hashes", "split_hashes", "page_hashes",
           "supports_prefix_cache"]
