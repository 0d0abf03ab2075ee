"""Refuse a prompt that cannot fit the context before tokenizing all of it, and give back the
memory a long tokenization took.

Two ways to know a text has more than `limit` tokens without tokenizing it whole:

* **Bytes.** When nothing in the tokenizer can shrink the text (its normalizer and
  pre-tokenizer only split or add, and no unknown token can swallow a run of characters), every
  token covers at most `max_token_bytes` bytes of the text, the longest piece in the
  vocabulary: a text of B bytes has at least ceil(B / max_token_bytes) tokens. NFKC (a 3-byte
  full-width letter becomes 1 byte), Strip and Replace (delete characters), Whitespace
  pre-tokenizers (drop them), WordPiece / WordLevel and fused unknown tokens (one token for a
  whole unknown run) make the bound unsound: for those tokenizers it is None.
* **A prefix.** Any tokenizer: tokenize a prefix cut right before a whitespace character that
  starts a word (a pre-tokenizer boundary for byte-level BPE and SentencePiece alike, so the
  prefix's tokens are the first tokens of the whole text); more than `limit` of them proves the
  whole text has more. The prefix's length is sized from the bytes per token measured on a
  first slice, so a refusal costs about `limit` tokens of work whatever the body size, and a
  prompt that fits costs its own tokenization plus one slice.

The tokenizer (Rust, in a worker thread) frees what it built, but glibc keeps the freed pages
in that thread's arena: an 8 MB prompt left a worker ~0.8 GB larger for good. After a long text
`baton.engine.runtime.cpu_allocator.release_freed_memory` hands them back (malloc_trim), and again once a request with a large body
has been answered (its copies and token ids are freed only then).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from baton.server.errors import APIError

# Texts shorter than this are tokenized as they are: no bound can be worth a second pass.
FIRST_SLICE_CHARS = 64 * 1024
# A prefix is sized to hold the limit with this margin (bytes per token vary along a text).
PREFIX_MARGIN = 1.25
# Tokenizing at least this many characters is followed by malloc_trim (and a request with a
# large body is too, once answered: server/middleware.py).
TRIM_AFTER_CHARS = 256 * 1024

# Parts of a tokenizer.json that never make the text the model sees shorter than its input.
_NON_SHRINKING_NORMALIZERS = {"Prepend"}  # NFC / NFD / NFKC can all shrink some text
_NON_SHRINKING_PRETOKENIZERS = {
    "ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split",
}  # fmt: skip
_WORD_START = re.compile(r"\s(?=\S)")


def _normalizer_keeps_length(node: dict | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_normalizer_keeps_length(n) for n in node.get("normalizers", []))
    if kind == "Replace":  # replacing a literal by one at least as long (Llama's " " -> "▁")
        pattern = node.get("pattern", {})
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        content = node.get("content", "")
        return literal is not None and len(content.encode()) >= len(literal.encode())
    return kind in _NON_SHRINKING_NORMALIZERS


def _pretokenizer_keeps_length(node: dict | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_pretokenizer_keeps_length(n) for n in node.get("pretokenizers", []))
    if kind == "Split" and node.get("behavior") == "Removed":
        return False
    return kind in _NON_SHRINKING_PRETOKENIZERS


def _unknown_bytes(model: dict) -> int | None:
    """The most bytes one unknown token can stand for (0: none can appear), or None when one
    can swallow any run (fused unknowns, WordPiece / WordLevel words)."""
    kind = model.get("type")
    if model.get("byte_fallback"):
        return 0
    if kind == "BPE":
        if model.get("unk_token") is None:
            return 0
        return None if model.get("fuse_unk") else 4  # one character of UTF-8
    if kind == "Unigram":  # SentencePiece joins consecutive unknown characters into one
        return 0 if model.get("unk_id") is None else None
    return None


def max_token_bytes(tokenizer_json: dict[str, Any], pieces: list[str]) -> int | None:
    """The most bytes of a text one token can cover, or None when the tokenizer can shrink the
    text (module docstring). `pieces`: every token string of the vocabulary, added ones too;
    a piece's UTF-8 length bounds the text it covers (byte-level pieces spell each byte with a
    1-2 byte character, SentencePiece writes a space as the 3-byte "▁")."""
    if not _normalizer_keeps_length(tokenizer_json.get("normalizer")):
        return None
    if not _pretokenizer_keeps_length(tokenizer_json.get("pre_tokenizer")):
        return None
    unknown = _unknown_bytes(tokenizer_json.get("model") or {})
    if unknown is None:
        return None
    return max(unknown, 1, *(len(piece.encode()) for piece in pieces))


def tokenizer_bound(hf_tokenizer) -> int | None:
    """max_token_bytes of a transformers fast tokenizer (None for a slow one)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return max_token_bytes(json.loads(backend.to_str()), list(hf_tokenizer.get_vocab()))


def word_start_before(text: str, end: int) -> int | None:
    """The last index <= end holding a whitespace character that starts a word (None if none):
    cutting there keeps every pre-token of the prefix whole."""
    window_start = max(0, end - 4096)
    matches = list(_WORD_START.finditer(text, window_start, end + 1))
    if matches:
        return matches[-1].start()
    match = _WORD_START.search(text, end)  # none just before: the next one
    return match.start() if match else None


def too_long(limit: int, param: str, tokens: int, why: str) -> APIError:
    return APIError.bad_request(
        f"{param}: the prompt is at least {tokens} tokens ({why}); it exceeds max-model-len,"
        f" which leaves room for at most {limit} prompt tokens",
        param,
    )


def encode_within(
    text: str,
    encode: Callable[[str], list[int]],
    bound: int | None,
    limit: int,
    param: str,
) -> list[int]:
    """`encode(text)`, or APIError 400 as soon as the text is proved to have more than `limit`
    tokens: by its bytes (`bound`, max_token_bytes), else by a prefix (module docstring)."""
    if bound is not None and len(text) > limit:  # a character is at least one byte
        size = len(text.encode())
        least = math.ceil(size / bound)
        if least > limit:
            raise too_long(limit, param, least, f"{size} bytes, at most {bound} per token")
    if len(text) <= FIRST_SLICE_CHARS:
        return encode(text)
    cut = word_start_before(text, FIRST_SLICE_CHARS)
    while cut is not None and cut < len(text):
        ids = encode(text[:cut])
        if len(ids) > limit:
            raise too_long(limit, param, len(ids), f"its first {cut} characters alone")
        # size the next prefix to hold the limit, from this one's characters per token
        end = max(int((limit + 1) * PREFIX_MARGIN * cut / max(1, len(ids))), 2 * cut)
        cut = word_start_before(text, end) if end < len(text) else None
    return encode(text)
