"""The API key and the disaggregation secret, from a flag, a file or the environment.

A command line is readable by every local user (`ps`, /proc/*/cmdline): baton never puts a
secret on the command line of a process it starts (`baton up`'s children, the engine process,
tensor-parallel ranks); it hands them on in the environment (readable by the same user only).
An operator can keep them off baton's own command line too: `--api-key-file` /
`--disagg-secret-file` (the file's first line) or BATON_API_KEY / BATON_DISAGG_SECRET (as vLLM
reads VLLM_API_KEY). A flag wins over the environment; a flag and its file together are refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

API_KEY_ENV = "BATON_API_KEY"
DISAGG_SECRET_ENV = "BATON_DISAGG_SECRET"


class SecretError(ValueError):
    """A secret flag that cannot be used; the message names it."""


def add_api_key_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """--api-key and --api-key-file; `what` says where the key is required."""
    parser.add_argument(
        "--api-key",
        help=f"require `Authorization: Bearer KEY` on {what}; /health, /ping and /metrics stay "
        f"open (probes, Prometheus). Visible in `ps`: prefer --api-key-file or ${API_KEY_ENV}",
    )
    parser.add_argument(
        "--api-key-file", help=f"read the API key from this file's first line (or ${API_KEY_ENV})"
    )


def add_disagg_secret_file_flag(parser) -> None:
    parser.add_argument(
        "--disagg-secret-file",
        help="read the worker-to-worker secret from this file's first line "
        f"(or ${DISAGG_SECRET_ENV})",
    )


def secret(value: str | None, file: str | None, flag: str, environ, env_name: str) -> str | None:
    """The secret the flags `flag` / `flag`-file or the environment give (None: none)."""
    if value is not None and file is not None:
        raise SecretError(f"{flag} and {flag}-file both given: pass one")
    if file is not None:
        try:
            lines = Path(file).read_text().splitlines()
        except OSError as error:
            raise SecretError(f"{flag}-file {file}: {error.strerror or error}") from None
        text = lines[0].strip() if lines else ""
        if not text:
            raise SecretError(f"{flag}-file {file}: the file is empty")
        return text
    if value is not None:
        if not value:
            raise SecretError(f"{flag} is empty")
        return value
    return environ.get(env_name) or None
