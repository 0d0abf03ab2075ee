"""A worker's tokenizer as files on the wire, and the identity of the model it serves.

`baton router --policy cache_aware` matches prompts in tokens, so it needs the model's
tokenizer. Rather than a `--tokenizer DIR` of its own (a second copy of the model directory to
mount and keep in step), it asks a worker, which already has one:

    worker                                        router
    GET /disagg/info  -> model: {name, config_digest, tokenizer_digest}
                                                  every worker's model compared with the others'
    GET /disagg/tokenizer -> TokenizerBundle      once per model: files checked against the
                                                  announced digest, written to a private temporary
                                                  directory, loaded as `baton serve` loads them

The bundle is the files Hugging Face's AutoTokenizer reads from a directory (BUNDLE_FILES: no
weights, no code; a tokenizer_config.json that asks for remote code fails to load, as
trust_remote_code is never set) and the worker's `--chat-template` when it has one, so the router
renders chat prompts as that worker does. The digests are sha256 over what the worker serves:
two workers with the same digests tokenize alike, whatever directory they read it from.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from baton.server.tokenizer import TOKENIZER_FILES, Tokenizer

# What AutoTokenizer.from_pretrained reads from a local directory, for fast and slow tokenizers
# (config.json: the model type, for a tokenizer_config.json that names no tokenizer class).
BUNDLE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "config.json",
)
MAX_BUNDLE_BYTES = 96 << 20  # the files together, decoded
MAX_NAME_CHARS = 1024  # a served model name as the router keeps it


def sha256_of(parts: list[tuple[str, bytes]]) -> str:
    """sha256 over named parts, each length-prefixed (no two lists hash alike by shifting
    bytes from one part to the next)."""
    digest = hashlib.sha256()
    for name, content in parts:
        for piece in (name.encode(), content):
            digest.update(len(piece).to_bytes(8, "little"))
            digest.update(piece)
    return digest.hexdigest()


@dataclass(frozen=True, kw_only=True)
class TokenizerBundle:
    files: dict[str, bytes]  # name in BUNDLE_FILES -> content
    chat_template: str | None  # the worker's --chat-template, over the files' own

    @classmethod
    def from_directory(cls, directory: str, chat_template: str | None) -> TokenizerBundle:
        files = {
            name: Path(directory, name).read_bytes()
            for name in BUNDLE_FILES
            if Path(directory, name).is_file()
        }
        return cls(files=files, chat_template=chat_template)

    @cached_property
    def digest(self) -> str:
        template = [] if self.chat_template is None else [("--chat-template", self.chat_template)]
        return sha256_of(
            sorted(self.files.items()) + [(name, text.encode()) for name, text in template]
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "files": {name: base64.b64encode(content).decode() for name, content in self.files.items()},
            "chat_template": self.chat_template,
        }  # fmt: skip

    @classmethod
    def from_json(cls, payload: object) -> TokenizerBundle:
        """The bundle a worker sent (ValueError naming what is wrong: an unknown file name, a
        body that is not base64, more than MAX_BUNDLE_BYTES, no tokenizer file at all)."""
        if not isinstance(payload, dict) or not isinstance(payload.get("files"), dict):
            raise ValueError("a tokenizer bundle is an object with files")
        template = payload.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise ValueError("chat_template must be a string or null")
        files, size = {}, len(template or "")
        for name, text in payload["files"].items():
            if name not in BUNDLE_FILES:
                raise ValueError(f"file {name[:80]!r} is not a tokenizer file")
            if not isinstance(text, str):
                raise ValueError(f"file {name}: content must be base64 text")
            try:
                files[name] = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"file {name}: content is not base64") from None
            size += len(files[name])
            if size > MAX_BUNDLE_BYTES:
                raise ValueError(f"the files are more than {MAX_BUNDLE_BYTES} bytes together")
        if not any(name in files for name in TOKENIZER_FILES):
            raise ValueError(f"no tokenizer file (neither {' nor '.join(TOKENIZER_FILES)})")
        return cls(files=files, chat_template=template)

    def load(self) -> Tokenizer:
        """The tokenizer these files make (slow: run it in a thread). ValueError when they do
        not make one."""
        directory = tempfile.mkdtemp(prefix="baton-tokenizer-")  # mode 0700, a fresh name
        try:
            for name, content in self.files.items():  # names are BUNDLE_FILES: no path in them
                Path(directory, name).write_bytes(content)
            return Tokenizer(directory, self.chat_template)
        except Exception as error:  # transformers and tokenizers raise many kinds
            raise ValueError(f"the files do not load as a tokenizer: {error}") from error
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def model_identity(name: str, model_dir: str, bundle: TokenizerBundle) -> dict[str, str]:
    """What a worker says it serves on /disagg/info: its served name, and digests of its
    config.json and of its tokenizer bundle."""
    config = Path(model_dir, "config.json").read_bytes()
    return {
        "name": name,
        "config_digest": sha256_of([("config.json", config)]),
        "tokenizer_digest": bundle.digest,
    }
