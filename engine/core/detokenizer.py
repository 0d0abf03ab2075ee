"""Incremental detokenization with stop strings: the stage after the engine.

The engine's step loop produces token ids only (RequestDelta with empty `new_text`); this stage
turns them into text, once per token, where the consumer runs: in the server process (its
EngineClient), off the engine's critical path, or in the offline `LLM` after each step. A stop
string found here ends the request: the stage marks the delta finished with "stop" and the
consumer aborts the engine request (the engine may have run a step or two further; those
tokens are dropped, as in vLLM's output processor).

Text is emitted only when it is final: bytes of an incomplete UTF-8 character are held back
until a later token completes them, and a suffix that could still grow into a stop string is
held back until it cannot. Concatenating every delta gives exactly the final text, so streamed
and non-streamed outputs agree.
"""

from __future__ import annotations

import dataclasses

from baton.engine.core.outputs import RequestDelta

# Prompt tokens given to the stream as left context: byte-level BPE and SentencePiece pieces
# render their leading space / merge correctly only after a few tokens of context.
CONTEXT_TOKENS = 6


class _ReDecodeStream:
    """`tokenizers.decoders.DecodeStream`'s contract (step -> new text or None while a
    character is incomplete) for tokenizers without a Rust backend: re-decodes a short window
    (the "prefix offset" method), two decodes per token."""

    def __init__(self, tokenizer, context_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(context_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]


class _RustDecodeStream:
    """One step of the tokenizers library's streaming decoder per token (no re-decoding)."""

    def __init__(self, tokenizer, context_ids: list[int], skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self.stream.step(self.backend, token_id)


class IncrementalDetokenizer:
    """One request's text: `add` each generated token, `take` what became final."""

    def __init__(
        self,
        tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
        include_stop: bool = False,
    ):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop  # keep the stop string that ended the text
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        stream_class = (
            _RustDecodeStream if hasattr(tokenizer, "backend_tokenizer") else _ReDecodeStream
        )
        self.stream = stream_class(tokenizer, context, skip_special_tokens)
        self.pending: list[int] = []  # tokens whose text is not out yet (incomplete UTF-8)
        self.text = ""  # decoded output text so far (before stop truncation)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped_by: str | None = None
        self.longest_stop = max((len(s) for s in self.stop), default=0)

    def add(self, token_id: int) -> None:
        """Feed one generated token; may set `stopped_by` when a stop string appears."""
        if self.stopped_by is not None:
            return
        self.pending.append(token_id)
        piece = self.stream.step(token_id)
        if not piece:
            return  # nothing final yet (incomplete UTF-8 or an empty special token)
        self.pending.clear()
        searched_from = max(0, len(self.text) - self.longest_stop + 1)
        self.text += piece
        if self.stop:
            self._check_stop(searched_from)

    def _check_stop(self, start: int) -> None:
        best = None
        for s in self.stop:
            at = self.text.find(s, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            at, stop = best
            self.text = self.text[: at + len(stop) if self.include_stop else at]
            self.stopped_by = stop

    def take(self, final: bool) -> str:
        """The newly final text since the last call (everything left when `final`)."""
        if final and self.stopped_by is None and self.pending:
            # The request ended mid-character: emit what the tokenizer makes of the rest.
            self.text += self.tokenizer.decode(
                self.pending, skip_special_tokens=self.skip_special_tokens
            )
            self.pending.clear()
        end = len(self.text)
        if not final and self.stopped_by is None:
            end -= self._stop_prefix_len()
        end = max(end, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest


class OutputDetokenizer:
    """Text for the deltas of many requests: `add_request`, then `process` every engine delta.

    `process` returns the delta with its text (and, when a stop string appeared, finished with
    "stop" and the string as `stop_reason`); None for a delta of a request this stage already
    ended. A returned delta that is finished while the engine's was not means: abort the
    request in the engine.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, IncrementalDetokenizer] = {}

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
        include_stop: bool = False,
    ) -> None:
        self.requests[request_id] = IncrementalDetokenizer(
            self.tokenizer, prompt_ids, stop, skip_special_tokens, include_stop
        )

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, delta: RequestDelta) -> RequestDelta | None:
        detok = self.requests.get(delta.request_id)
        if detok is None:
            return None
        finished, finish_reason, stop_reason = (
            delta.finished,
            delta.finish_reason,
            delta.stop_reason,
        )
        # The engine ends a request with "stop" only by token id (EOS or stop_token_ids): that
        # token's text is not part of the output (as in vLLM).
        token_ids = delta.new_token_ids[:-1] if finish_reason == "stop" else delta.new_token_ids
        kept = delta.new_token_ids
        for i, token_id in enumerate(token_ids):
            detok.add(token_id)
            if detok.stopped_by is not None:
                finished, finish_reason, stop_reason = True, "stop", detok.stopped_by
                # A delta of several tokens (speculative decoding) ends with the one that
                # completed the stop string, as one token at a time would have.
                kept = delta.new_token_ids[: i + 1]
                break
        text = detok.take(final=finished)
        if finished:
            del self.requests[delta.request_id]
        return dataclasses.replace(
            delta,
            new_token_ids=kept,
            new_logprobs=delta.new_logprobs[: len(kept)]
            if delta.new_logprobs
            else delta.new_logprobs,
            new_text=text,
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
