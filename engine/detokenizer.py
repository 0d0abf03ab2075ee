"""Incremental detokenization with stop strings, one instance per request.

Text is emitted only when it is final: bytes of an incomplete UTF-8 character (decoded as
U+FFFD) are held back until the next token completes them, and a suffix that could still grow
into a stop string is held back until it cannot. Concatenating every delta gives exactly the
final text, so streamed and non-streamed outputs agree.
"""

from __future__ import annotations

# How many tokens before the newest ones are re-decoded to get the boundary right (the
# "prefix offset" trick: byte-level BPE pieces only render correctly with some left context).
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool
    ):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # decoded output text so far (before stop truncation)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> None:
        """Feed one generated token; may set `stopped_by` when a stop string appears."""
        if self.stopped_by is not None:
            return
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # nothing final yet (incomplete UTF-8 or an empty special token)
        searched_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self._check_stop(searched_from)

    def _check_stop(self, start: int) -> None:
        best = None
        for s in self.stop:
            at = self.text.find(s, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stopped_by = best[1]

    def take(self, final: bool) -> str:
        """The newly final text since the last call (everything left when `final`)."""
        if final and self.stopped_by is None and self.read_offset < len(self.ids):
            # The request ended mid-character: emit what the tokenizer makes of the rest.
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(self.ids)
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
