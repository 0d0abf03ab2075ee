"""The interface every routing policy implements, and what a policy reads of a worker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol


class Candidate(Protocol):
    """What a policy reads of a worker."""

    @property
    def url(self) -> str: ...

    @property
    def load(self) -> int: ...  # requests the router has in flight on it

    @property
    def track_interval(self) -> int: ...  # tokens between its Mamba checkpoints (0: no cache)


class Choice(NamedTuple):
    worker: Candidate
    cached_tokens: int  # prompt tokens the policy expects the worker to reuse (0: none known)


class Policy(Protocol):
    name: str
    needs_tokens: bool  # whether `pick` reads the prompt's token ids

    def pick(self, workers: Sequence[Candidate], prompt: Sequence[int] | None) -> Choice:
        """One of `workers` (never empty); `prompt` is None unless some policy needs tokens."""
        ...

    def forget(self, worker: Candidate) -> None:
        """The worker left, or came back after it was away (its cache is gone): drop what the
        policy keeps about it."""
        ...
