"""A model-free Engine with the real Engine's interface, for server and engine-loop tests.

Each running request emits one deterministic token per step (a function of its prompt and its
output length, never a special token), so tests can predict outputs without a model.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from baton.engine.core.outputs import RequestDelta
from baton.engine.core.sampling_params import SamplingParams

FIRST_PLAIN_TOKEN = 3  # ids 0-2 are <pad>, <s>, </s> in tests/tiny.py's tokenizer


@dataclass(frozen=True, kw_only=True)
class FakeStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    mamba_slots_used: int
    mamba_slots_total: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int


class _FakeRequest:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.output: list[int] = []


def fake_token(prompt: list[int], position: int, vocab_size: int) -> int:
    return FIRST_PLAIN_TOKEN + (sum(prompt) * 31 + position * 7) % (vocab_size - FIRST_PLAIN_TOKEN)


class FakeEngine:
    PAGE_SIZE = 16
    handover = SimpleNamespace(track_interval=0)  # no prefix cache

    def __init__(
        self, model_dir: str, *, dtype: str = "float32", device: str = "cpu", **engine_args
    ) -> None:
        from transformers import AutoTokenizer

        config = json.loads(Path(model_dir, "config.json").read_text())
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_config = SimpleNamespace(vocab_size=config["vocab_size"])
        self.args = SimpleNamespace(page_size=self.PAGE_SIZE)
        self.max_model_len = engine_args.get("max_model_len") or config["max_position_embeddings"]
        self.max_running = engine_args.get("max_running_requests") or 256
        self.step_delay_s = 0.002
        self.waiting: list[_FakeRequest] = []
        self.running: list[_FakeRequest] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def warm_up(self) -> None:
        """Nothing to pay on a first forward here."""

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= token < vocab_size for token in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len ({self.max_model_len})"
            )
        self.waiting.append(_FakeRequest(request_id, list(prompt_token_ids), params))

    def abort_request(self, request_id: str) -> None:
        self.waiting = [request for request in self.waiting if request.request_id != request_id]
        self.running = [request for request in self.running if request.request_id != request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def take_refused(self) -> list[tuple[str, str]]:
        return []  # no grammars here: nothing is refused after it was added

    def step(self) -> list[RequestDelta]:
        time.sleep(self.step_delay_s)
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting.pop(0)
            self.prompt_tokens_total += len(request.prompt)
            self.running.append(request)
        deltas = [self._advance(request) for request in self.running]
        self.running = [
            request for request in self.running if len(request.output) < request.params.max_tokens
        ]
        return deltas

    def _advance(self, request: _FakeRequest) -> RequestDelta:
        vocab_size = self.model_config.vocab_size
        token = fake_token(request.prompt, len(request.output), vocab_size)
        request.output.append(token)
        self.generation_tokens_total += 1
        finished = len(request.output) >= request.params.max_tokens
        logprobs = None
        if request.params.logprobs is not None:
            alternatives = {
                (token + k) % vocab_size: -1.0 - k for k in range(1, request.params.logprobs + 1)
            }
            logprobs = [{**alternatives, token: -0.5}]
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=[token],
            new_text="",  # like the real engine: the server detokenizes
            new_logprobs=logprobs,
            prompt_logprobs=None,
            finished=finished,
            finish_reason="length" if finished else None,
            stop_reason=None,
            num_prompt_tokens=len(request.prompt),
            num_cached_tokens=0,
        )

    def stats(self) -> FakeStats:
        active = self.running
        pages = sum(-(-(len(r.prompt) + len(r.output)) // self.PAGE_SIZE) for r in active)
        return FakeStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_pages_used=pages,
            kv_pages_total=4096,
            mamba_slots_used=len(self.running),
            mamba_slots_total=self.max_running,
            num_preemptions=0,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )
