"""Per-request sampling parameters, validated at the boundary (server or LLM API)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StructuredOutputs:
    """A constraint on the generated text, enforced by a grammar matcher (xgrammar) that masks
    the logits of every step (vLLM's StructuredOutputsParams, one kind per request).

    `spec` by kind: "json" a JSON schema (JSON text), "json_object" unused (""), "regex" a
    regular expression, "choice" a JSON list of strings, "grammar" an EBNF / GBNF grammar,
    "structural_tag" xgrammar's structural tag (JSON text). `after_token_ids`: the grammar
    applies only once the generated ids contain this sequence (the end of the reasoning, e.g. the
    ids of "</think>"); empty: from the first generated token.
    """

    kind: StructuredKind
    spec: str
    after_token_ids: tuple[int, ...]


@dataclass(kw_only=True)
class SamplingParams:
    """What a user asks of one request. Defaults live here, at the user boundary.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1 and min_p 0 disable
    theirs. `logprobs` is the number of top alternatives returned per generated token (the
    chosen token is always included); `prompt_logprobs` likewise for prompt tokens.
    `logit_bias` adds its value (-100..100, OpenAI's range) to its token id's logit before
    penalties, filters and the draw (greedy included); logprobs stay those of the raw logits.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: the text runs through the stop string
    logit_bias: dict[int, float] = field(default_factory=dict)
    # A grammar the output must follow (None: unconstrained).
    structured_outputs: StructuredOutputs | None = None
    # The LoRA adapter this request runs under (engine/lora/), by its served name; None: the
    # base model. Not a sampling choice, but it travels with them to every worker (the server's
    # engine, both PD halves, TP rank 0).
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the parameter and its limit."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise ValueError(f"{name} must be in [0, 20], got {value}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise ValueError(f"logit_bias: key {token_id!r} is not a token id (an int)")
            if not isinstance(bias, (int, float)) or isinstance(bias, bool):
                raise ValueError(f"logit_bias: {bias!r} for token {token_id} is not a number")
            if token_id < 0:
                raise ValueError(f"logit_bias: token id {token_id} is negative")
            if not -100.0 <= bias <= 100.0:  # also refuses NaN
                raise ValueError(f"logit_bias: {bias} for token {token_id} is outside [-100, 100]")

    @classmethod
    def from_dict(cls, fields: dict) -> SamplingParams:
        """The inverse of `dataclasses.asdict` (the ipc payload): nested carriers rebuilt."""
        structured = fields.get("structured_outputs")
        if isinstance(structured, dict):
            structured = StructuredOutputs(
                kind=structured["kind"],
                spec=structured["spec"],
                after_token_ids=tuple(structured["after_token_ids"]),
            )
        return cls(**{**fields, "structured_outputs": structured})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
