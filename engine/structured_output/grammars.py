"""Structured outputs inside the engine: grammars compiled off the step loop, one token bitmask
per step for the whole batch, matchers advanced by every accepted token.

    Engine.add_request / preallocate ──add(req)──> compile thread (xgrammar, cached per spec)
    Engine.add_request / install ──hold(req, start)
    Engine.step ──release()──> compiled: the matcher is built, start(req) hands the request to
                │              the scheduler; refused (the grammar admits no output): the request
                │              ends and the server answers 400
                ├──constrain(reqs)──> the sampler masks grammar rows after taking logprobs
                └──_append_token ──accept(req, token)──> None | "stop" (grammar complete) |
                                                        "abort" (the token does not fit)

A request enters the scheduler only once its grammar is compiled, so a schema that takes
seconds to compile never stalls the steps of other requests (xgrammar releases the GIL while it
compiles). `after_token_ids`: the grammar is inactive until the generated ids contain that
sequence (the end of a reasoning section); the sequence itself is not fed to the matcher.
Tokens accepted before the matcher exists (the first token a disaggregated prefill sampled,
installed while this side still compiles) are replayed into it when it is built.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from baton.engine.core.request import Request
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.structured_output.compiled_cache import CompiledCache
from baton.engine.structured_output.spec import compile_structured, compiled_spec_limit, xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr

# Compiled grammars kept for specs that come again (compiled_cache.py: LRU beyond this).
CACHE_LIMIT_BYTES = 256 << 20
# How long an engine with nothing to run but compiling grammars waits for one in a step.
IDLE_WAIT_S = 0.02
# A matcher's work (mask fills and token advances) runs on the step loop, and an ambiguous
# grammar (`s ::= s s | "a"`) makes it grow with every token: 200 ms a token after 300 tokens.
# A request whose matcher has spent more than this, and more than this per token, ends with
# "abort" (legitimate grammars take ~0.01-0.1 ms a token), so no grammar stalls the others.
MATCHER_BUDGET_S = 1.0
MATCHER_BUDGET_PER_TOKEN_S = 0.002

GrammarEnd = Literal["stop", "abort"]

logger = logging.getLogger("baton.engine")


@dataclass(eq=False)
class _RequestGrammar:
    compiled: Future[xgr.CompiledGrammar]
    after: tuple[int, ...]
    active: bool  # the after_token_ids sequence has been generated (or there is none)
    matcher: xgr.GrammarMatcher | None = None
    backlog: list[int] = field(default_factory=list)  # accepted before the matcher existed
    seconds: float = 0.0  # spent in this request's matcher on the step loop
    tokens: int = 0  # accepted by the matcher

    def over_budget(self) -> bool:
        return self.seconds > max(MATCHER_BUDGET_S, MATCHER_BUDGET_PER_TOKEN_S * self.tokens)


@dataclass
class MaskTiming:
    """Time spent filling and applying bitmasks (bench/offline/structured_output.py reports it)."""

    steps: int = 0
    rows: int = 0
    seconds: float = 0.0  # filling and applying the bitmask
    accept_seconds: float = 0.0  # advancing the matchers by the sampled tokens


class Grammars:
    """The engine's structured-output state: one compile thread and one matcher per request."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        compile_threads: int,
    ) -> None:
        self.tokenizer = tokenizer  # a LazyTokenizer (engine/core/tokenizer.py)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.compile_threads = compile_threads
        self.requests: dict[str, _RequestGrammar] = {}
        # request id -> (request, what hands it to the scheduler) until its grammar is compiled
        self.held: dict[str, tuple[Request, Callable[[Request], None]]] = {}
        self.timing = MaskTiming()
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        self.compiled = CompiledCache(CACHE_LIMIT_BYTES)  # (touched on the compile thread only)
        # (rows, words) int32, grown to the largest batch that had a grammar row; xgrammar is
        # imported at the first grammar (engine/structured_output/spec.py), not here
        self._bitmask: torch.Tensor | None = None

    # -- admission -------------------------------------------------------------------------

    def check(self, params: SamplingParams) -> None:
        """What the engine refuses at once (ValueError); the spec's own check is the server's
        (engine/structured_output/spec.py), and a compile that fails anyway refuses later."""
        structured = params.structured_outputs
        if structured is None:
            return
        if not self.tokenizer.available:
            raise ValueError("structured_outputs need the model's tokenizer (none in its folder)")
        limit = compiled_spec_limit(structured.kind)
        if len(structured.spec) > limit:
            raise ValueError(f"structured_outputs: the spec is longer than {limit} characters")

    def add(self, req: Request) -> None:
        """Begin compiling the request's grammar, if it has one (on the compile thread)."""
        structured = req.params.structured_outputs
        if structured is None:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="baton-grammar")
        self.requests[req.request_id] = _RequestGrammar(
            compiled=self._executor.submit(self._compile, structured),
            after=structured.after_token_ids,
            active=not structured.after_token_ids,
        )

    def hold(self, req: Request, start: Callable[[Request], None]) -> None:
        """start(req) now if it has no grammar, else at the first release() after its grammar
        is compiled."""
        if req.request_id in self.requests:
            self.held[req.request_id] = (req, start)
        else:
            start(req)

    def release(self) -> list[tuple[Request, str]]:
        """Start the held requests whose grammar is compiled; return the refused ones with the
        reason (the engine ends them)."""
        refused = []
        for request_id, (req, start) in list(self.held.items()):
            grammar = self.requests[request_id]
            if not grammar.compiled.done():
                continue
            del self.held[request_id]
            error = grammar.compiled.exception()
            if error is None:
                error = self._build_matcher(grammar)
            if error is None:
                start(req)
            else:
                del self.requests[request_id]
                refused.append((req, str(error)))
        return refused

    def wait(self) -> None:
        """Block briefly until a held grammar is compiled (an engine with nothing else to run
        would otherwise spin on the CPU the compile needs)."""
        pending = [self.requests[request_id].compiled for request_id in self.held]
        if pending:
            futures.wait(pending, timeout=IDLE_WAIT_S, return_when=futures.FIRST_COMPLETED)

    def forget(self, request_id: str) -> None:
        """The request ended (finished or aborted); a compile not yet begun is cancelled."""
        grammar = self.requests.pop(request_id, None)
        self.held.pop(request_id, None)
        if grammar is not None:
            grammar.compiled.cancel()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def num_held(self) -> int:
        return len(self.held)

    # -- compile thread ----------------------------------------------------------------------

    def _compile(self, structured) -> xgr.CompiledGrammar:
        xgr = xgrammar()
        if self._compiler is None:  # built here, off the step loop: ~1 s for a large vocabulary
            self._compiler = xgr.GrammarCompiler(
                _tokenizer_info(self.tokenizer.get(), self.vocab_size, self.stop_token_ids),
                max_threads=self.compile_threads,
                cache_enabled=False,  # (its memory is not bounded: compiled_cache.py)
            )
        compiler = self._compiler
        try:
            compiled = self.compiled.get(
                (structured.kind, structured.spec),
                lambda: compile_structured(compiler, structured),
            )
        except (RuntimeError, ValueError) as error:  # a spec the server's check would refuse
            logger.warning("a %s spec failed to compile: %s", structured.kind, error)
            raise ValueError(
                f"structured_outputs: the {structured.kind} spec could not be compiled"
            ) from None
        probe = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        probe.fill_next_token_bitmask(bitmask)
        if not bitmask.any() and not probe.is_completed():
            raise ValueError(
                f"structured_outputs: the {structured.kind} admits no output (no token can "
                "start it: a grammar without terminals, or an empty language)"
            )
        return compiled

    def _build_matcher(self, grammar: _RequestGrammar) -> ValueError | None:
        grammar.matcher = xgrammar().GrammarMatcher(
            grammar.compiled.result(), override_stop_tokens=self.stop_token_ids
        )
        for token in grammar.backlog:
            if not grammar.matcher.accept_token(token):
                return ValueError(
                    f"structured_outputs: token {token}, sampled by the prefill worker, does "
                    "not fit the grammar"
                )
        grammar.backlog = []
        return None

    # -- every step ---------------------------------------------------------------------------

    def constrain(
        self, reqs: Sequence[Request], pending: Sequence[tuple[int, ...]] | None = None
    ) -> Callable[[torch.Tensor], None] | None:
        """The mask for this step's sampled rows (`reqs`, one per logits row), or None when no
        row follows a grammar: fills one bitmask for the batch now, applies it to the logits
        (rows, vocab) in place when called (the sampler calls it after taking logprobs).
        `pending[row]`: drafts a speculative verify row sits after; its mask is the matcher's
        after them (advanced, filled, rolled back: the matcher ends where it began)."""
        if not self.requests:
            return None
        start = time.perf_counter()
        rows, grammars, fed = [], [], []
        for row, req in enumerate(reqs):
            grammar = self.requests.get(req.request_id)
            if grammar is None:
                continue
            drafts = pending[row] if pending else ()
            # (a verify row's context lists the drafts after the output already)
            output = req.output_ids[: len(req.output_ids) - len(drafts)]
            tokens = _fed_to_matcher(grammar, output, drafts)
            if tokens is not None:
                rows.append(row)
                grammars.append(grammar)
                fed.append(tokens)
        if not rows:
            return None
        if self._bitmask is None or self._bitmask.shape[0] < len(reqs):
            self._bitmask = xgrammar().allocate_token_bitmask(len(reqs), self.vocab_size)
        bitmask = self._bitmask[: len(reqs)]
        for row, grammar, tokens in zip(rows, grammars, fed):
            began = time.perf_counter()
            advanced = 0
            for token in tokens:  # a draft the grammar refuses: this row is never reached
                if not grammar.matcher.accept_token(token):
                    break
                advanced += 1
            grammar.matcher.fill_next_token_bitmask(bitmask, row)
            if advanced:
                grammar.matcher.rollback(advanced)
            grammar.seconds += time.perf_counter() - began
        for row, alive in zip(rows, bitmask[rows].any(dim=1).tolist()):
            if not alive:  # a dead end: the model may only stop (accept() then says "abort")
                self._allow_only(bitmask[row], self.stop_token_ids)
        self.timing.seconds += time.perf_counter() - start

        def apply(logits: torch.Tensor) -> None:
            began = time.perf_counter()
            mask = bitmask if logits.device.type == "cpu" else bitmask.to(logits.device)
            xgrammar().apply_token_bitmask_inplace(
                logits, mask, vocab_size=self.vocab_size, indices=rows
            )
            self.timing.steps += 1
            self.timing.rows += len(rows)
            self.timing.seconds += time.perf_counter() - began

        return apply

    @staticmethod
    def _allow_only(row: torch.Tensor, token_ids: list[int]) -> None:
        """row: (words,) int32 bitmask, bit t % 32 of word t // 32 set for allowed token t."""
        row.zero_()
        for token in token_ids:
            bit = 1 << (token % 32)
            row[token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32's sign bit

    def accept(self, req: Request, token: int) -> GrammarEnd | None:
        """Advance the request's matcher by the token just appended to its output: "stop" when
        the grammar has ended (its stop token accepted), "abort" when the token does not fit (a
        dead end, where the grammar allowed no token and the model was made to stop) or the
        matcher is over its time budget, else None."""
        grammar = self.requests.get(req.request_id)
        if grammar is None:
            return None
        if not grammar.active:
            n = len(grammar.after)
            grammar.active = tuple(req.output_ids[-n:]) == grammar.after
            return None
        if grammar.matcher is None:
            grammar.backlog.append(token)
            return None
        began = time.perf_counter()
        accepted = grammar.matcher.accept_token(token)
        took = time.perf_counter() - began
        grammar.seconds += took
        self.timing.accept_seconds += took
        grammar.tokens += 1
        if not accepted:
            return "abort"
        if grammar.over_budget():
            logger.warning(
                "request %s: its grammar took %.2f s for %d tokens; ended (abort)",
                req.request_id,
                grammar.seconds,
                grammar.tokens,
            )
            return "abort"
        return "stop" if grammar.matcher.is_terminated() else None


def _fed_to_matcher(
    grammar: _RequestGrammar, output_ids: list[int], drafts: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The drafts the matcher must take before a row sitting after `drafts` (all of them once
    the grammar is active, those after its `after_token_ids` otherwise), or None when the
    grammar is not active at that row (no mask)."""
    if grammar.active:
        return drafts
    n = len(grammar.after)
    for i in range(len(drafts)):
        if tuple((output_ids + list(drafts[: i + 1]))[-n:]) == grammar.after:
            return drafts[i + 1 :]
    return None


def _tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with special tokens other than the stop tokens
    removed (xgrammar would otherwise spell "<pad>" or "<s>" inside a JSON string, text that
    skip_special_tokens then drops from the answer)."""
    xgr = xgrammar()
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    special = set(getattr(tokenizer, "all_special_ids", [])) - set(stop_token_ids)
    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special:
            encoded[index] = token
    return xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )
