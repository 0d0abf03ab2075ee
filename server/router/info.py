"""What a worker says of itself on `/disagg/info`: its role, where decode engines register
with it (prefill), its prefix cache's geometry (what cache_aware matches prompts in) and the
model it serves (what the router compares across workers). Every field is checked: the answer
comes from a socket."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import httpx

from baton.server.router.answers import SMALL_BODY_BYTES, BadAnswer, get, parse_json
from baton.server.tokenizer_bundle import MAX_NAME_CHARS

Role = Literal["prefill", "decode"]
MAX_PAGE_SIZE = 1 << 16
MAX_TRACK_INTERVAL = 1 << 24
MAX_ADDR_CHARS = 256
_DIGEST = re.compile(r"[0-9a-f]{64}")
_ADDR = re.compile(r"[!-~]*")  # printable ASCII, no space: it goes into request bodies


@dataclass(frozen=True, kw_only=True)
class ModelIdentity:
    """What a worker serves: the name clients give as `model`, and sha256 digests of its
    config.json and of its tokenizer (server/tokenizer_bundle.py)."""

    name: str
    config_digest: str
    tokenizer_digest: str

    @classmethod
    def from_json(cls, payload: object) -> ModelIdentity:
        if not isinstance(payload, dict):
            raise ValueError("model must be an object with name, config_digest, tokenizer_digest")
        name = payload.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ValueError(f"model.name must be a string of 1 to {MAX_NAME_CHARS} characters")
        digests = [payload.get(key) for key in ("config_digest", "tokenizer_digest")]
        for key, digest in zip(("config_digest", "tokenizer_digest"), digests, strict=True):
            if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
                raise ValueError(f"model.{key} must be a sha256 digest in hex")
        return cls(name=name, config_digest=digests[0], tokenizer_digest=digests[1])

    def __str__(self) -> str:
        return (
            f"{self.name!r} (config {self.config_digest[:12]}, "
            f"tokenizer {self.tokenizer_digest[:12]})"
        )


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """A worker's `/disagg/info`."""

    role: Role
    transfer_addr: str | None  # prefill workers: where decode engines register
    # Its HMAC under the workers' secret (None without one): decode workers with a secret dial
    # only vouched addresses (disagg/address_token.py). The router, holding no secret, passes it on.
    transfer_addr_token: str | None
    page_size: int
    track_interval: int  # tokens between Mamba checkpoints of its prefix cache (0: none)
    model: ModelIdentity

    @classmethod
    def from_json(cls, payload: object) -> WorkerInfo:
        """Raises ValueError for an answer that is not a worker's, naming the field."""
        if not isinstance(payload, dict):
            raise ValueError("/disagg/info must be a JSON object")
        role = payload.get("role")
        if role not in ("prefill", "decode"):
            raise ValueError(f"role {str(role)[:40]!r} is neither prefill nor decode")
        page_size = _integer(payload, "page_size", 1, MAX_PAGE_SIZE)
        track_interval = _integer(payload, "track_interval", 0, MAX_TRACK_INTERVAL)
        if track_interval % page_size:
            raise ValueError(
                f"track interval {track_interval} is not a multiple of page size {page_size}"
            )
        transfer_addr = payload.get("transfer_addr")
        if transfer_addr is not None and (
            not isinstance(transfer_addr, str)
            or len(transfer_addr) > MAX_ADDR_CHARS
            or not _ADDR.fullmatch(transfer_addr)
        ):
            raise ValueError(
                f"transfer_addr must be printable ASCII of at most {MAX_ADDR_CHARS} characters"
            )
        token = payload.get("transfer_addr_token")
        if token is not None and (not isinstance(token, str) or not _DIGEST.fullmatch(token)):
            raise ValueError("transfer_addr_token must be a sha256 digest in hex")
        return cls(
            role=role,
            transfer_addr=transfer_addr or None,
            transfer_addr_token=token,
            page_size=page_size,
            track_interval=track_interval,
            model=ModelIdentity.from_json(payload.get("model")),
        )


async def read_info(client: httpx.AsyncClient, url: str) -> WorkerInfo:
    """The worker's `/disagg/info`, read within SMALL_BODY_BYTES (httpx.HTTPError, or
    ValueError naming what is wrong with its answer)."""
    answer = await get(client, f"{url}/disagg/info", SMALL_BODY_BYTES, "/disagg/info")
    if answer.status != 200:
        raise BadAnswer(f"/disagg/info answered {answer.status}")
    return WorkerInfo.from_json(await parse_json(answer.body, "/disagg/info"))


def _integer(payload: dict, key: str, low: int, high: int) -> int:
    value = payload.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{key} must be an integer in {low}..{high}, got {str(value)[:40]}")
    return value
