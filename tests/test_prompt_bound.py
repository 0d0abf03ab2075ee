"""A prompt proved longer than the context is refused before it is tokenized whole: by its bytes
when the tokenizer cannot shrink a text, else by a prefix; the proof never refuses a prompt that
fits (checked against the real token count), and a long tokenization gives its memory back."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import normalizers

from baton.server.errors import APIError
from baton.server.openai.prompt_bound import FIRST_SLICE_CHARS, encode_within, max_token_bytes
from baton.server.tokenizer import Tokenizer
from tests.test_server_load import huge_prompt_body
from tests.tiny import save_tokenizer

BYTE_LEVEL_BPE = {
    "normalizer": None,
    "pre_tokenizer": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits"}, {"type": "ByteLevel"}],
    },
    "model": {"type": "BPE", "unk_token": None, "fuse_unk": False, "byte_fallback": False},
}
# Llama 2 / Mistral (Zamba2's tokenizer): spaces become the 3-byte "▁", byte fallback.
SENTENCEPIECE_BPE = {
    "normalizer": {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    },
    "pre_tokenizer": None,
    "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True},
}
PIECES = ["a", "▁the", "Ġquestion", "<|end_of_text|>"]


def with_(base: dict, **parts) -> dict:
    return {**base, **parts}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(path, vocab_size=320)
    return path


def test_the_longest_piece_bounds_a_tokenizer_that_cannot_shrink_text():
    assert max_token_bytes(BYTE_LEVEL_BPE, PIECES) == len("<|end_of_text|>")
    assert max_token_bytes(SENTENCEPIECE_BPE, PIECES) == len("<|end_of_text|>")
    # an unknown token that is not fused stands for one character: up to 4 bytes
    lone_unknown = with_(BYTE_LEVEL_BPE, model={"type": "BPE", "unk_token": "<unk>"})
    assert max_token_bytes(lone_unknown, ["a", "b"]) == 4


@pytest.mark.parametrize(
    "tokenizer_json",
    [
        with_(BYTE_LEVEL_BPE, normalizer={"type": "NFKC"}),  # full-width "Ａ": 3 bytes -> 1
        with_(BYTE_LEVEL_BPE, normalizer={"type": "Strip", "strip_left": True}),
        with_(BYTE_LEVEL_BPE, normalizer={"type": "Replace", "pattern": {"String": "ab"}, "content": "c"}),
        with_(BYTE_LEVEL_BPE, normalizer={"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}),
        with_(BYTE_LEVEL_BPE, pre_tokenizer={"type": "Whitespace"}),  # drops the spaces
        with_(BYTE_LEVEL_BPE, pre_tokenizer={"type": "Split", "behavior": "Removed"}),
        with_(BYTE_LEVEL_BPE, model={"type": "BPE", "unk_token": "<unk>", "fuse_unk": True}),
        with_(BYTE_LEVEL_BPE, model={"type": "Unigram", "unk_id": 0}),
        with_(BYTE_LEVEL_BPE, model={"type": "WordPiece", "unk_token": "[UNK]"}),
    ],
    ids=["nfkc", "strip", "replace-shorter", "replace-regex", "whitespace", "split-removed",
         "fused-unk", "unigram-unk", "wordpiece"],
)  # fmt: skip
def test_no_byte_bound_for_a_tokenizer_that_can_shrink_text(tokenizer_json):
    assert max_token_bytes(tokenizer_json, PIECES) is None


def never(text: str) -> list[int]:
    raise AssertionError(f"tokenized {len(text)} characters")


def test_a_text_too_long_by_its_bytes_is_refused_without_tokenizing():
    text = "word " * 10_000
    with pytest.raises(APIError) as refused:
        encode_within(text, never, bound=8, limit=4000, param="prompt")
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert "at least 6250 tokens" in refused.value.message
    assert "exceeds max-model-len" in refused.value.message


def test_without_a_byte_bound_a_prefix_refuses_at_a_cost_set_by_the_limit():
    """A shrinking tokenizer (NFKC): 2 M characters are refused after tokenizing a prefix sized
    by the limit, not the whole text."""
    tokenized: list[int] = []

    def one_token_per_word(text: str) -> list[int]:
        tokenized.append(len(text))
        return [1] * len(text.split())

    text = "word " * 400_000
    with pytest.raises(APIError, match="exceeds max-model-len"):
        encode_within(text, one_token_per_word, bound=None, limit=4000, param="messages")
    assert sum(tokenized) < 3 * FIRST_SLICE_CHARS, tokenized


@pytest.mark.parametrize("normalized", [False, True], ids=["byte-level", "nfkc"])
def test_a_refusal_is_a_proof_and_a_fitting_prompt_is_tokenized_as_before(
    tokenizer_dir, normalized
):
    """Against the real count: every refusal is of a prompt over the limit, every prompt the
    bound lets through comes back with the tokens a plain encode gives, with or without a byte
    bound (an NFKC normalizer takes it away)."""
    tokenizer = Tokenizer(str(tokenizer_dir))
    if normalized:
        backend = json.loads(tokenizer.hf.backend_tokenizer.to_str())
        backend["normalizer"] = json.loads(normalizers.NFKC().__getstate__())
        tokenizer.hf._tokenizer = RustTokenizer.from_str(json.dumps(backend))
        tokenizer.max_token_bytes = None
    assert (tokenizer.max_token_bytes is None) == normalized
    rng = random.Random(5)
    words = ["apple", "Ｂａｎａｎａ", "42", "日本語", "the", "  ", "\n", "🚀", "q"]
    refused = 0
    for count in (300, 3_000, 20_000, 30_000):
        text = " ".join(rng.choice(words) for _ in range(count))
        real = tokenizer.encode(text)
        assert tokenizer.encode(text, True, len(real), "prompt") == real  # fits: no refusal
        try:
            ids = tokenizer.encode(text, True, len(real) // 2, "prompt")
        except APIError:
            refused += 1
        else:
            assert ids == real  # not proved too long: tokenized whole, checked after
    assert refused >= 2  # the long texts (over FIRST_SLICE_CHARS) are refused by a prefix


def test_an_8_mb_prompt_is_refused_by_its_bytes(tokenizer_dir):
    tokenizer = Tokenizer(str(tokenizer_dir))
    text = json.loads(huge_prompt_body(None, 8_300_000))["prompt"]
    tokenizer.hf = None  # any call into the tokenizer would fail the test
    with pytest.raises(APIError, match="exceeds max-model-len"):
        tokenizer.encode(text, True, 4095, "prompt")
