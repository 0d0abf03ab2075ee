r"""`baton bench serve`: load an OpenAI-compatible server and report TTFT, TPOT, ITL, throughput.

Works against any `/v1/completions` (or `/v1/chat/completions`) server: `baton serve`, a
`baton router` in front of a prefill/decode pair, vLLM's OpenAI server; and, with `--backend
sglang`, against SGLang's native `/generate` (SGLang's servers, and baton's). Requests arrive as a
Poisson process at `--request-rate` (inf: all at once; `--burstiness` below 1 makes arrivals
burstier, above 1 more even, as vLLM's gamma arrivals), at most `--max-concurrency` in flight;
prompts are synthetic, of `--input-len` tokens (token ids, exact) or words (text, about that
many tokens), their lengths drawn uniformly within `--range-ratio` of the given one. With a
tokenizer (`--tokenizer`, by default the served model's directory when it is on this machine),
token ids come from its vocabulary less its special tokens and text prompts are cut to exact
token counts. Every request streams with `stream_options.include_usage`, so output tokens are
the server's count.
Metric definitions are those of `vllm bench serve`; see bench/serving/serve_metrics.py.

    baton bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --input-len 128 \
        --output-len 64 --ignore-eos --request-rate 4 --goodput ttft:500 tpot:50 --result-json out.json
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import Literal

import aiohttp
import numpy as np
from tqdm import tqdm

from baton.bench.serving.serve_metrics import RequestRecord, summarize

PromptKind = Literal["ids", "text"]
Clock = Callable[[], float]

# Text prompts draw from short common words, most of which are one token in BPE vocabularies.
_WORDS = (
    "the of and to in is it you that he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than first"
).split()


class WarmupFailed(RuntimeError):
    """The server answered the first (untimed) request with an error: nothing is measured."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchPrompt:
    prompt: list[int] | str
    prompt_len: int  # tokens (ids, or text measured by a tokenizer) or words (text without one)
    output_len: int  # max_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    base_url: str  # server root, e.g. http://127.0.0.1:8000
    endpoint: Literal["/v1/completions", "/v1/chat/completions", "/generate"]
    model: str
    prompts: list[BenchPrompt]
    request_rate: float  # requests/s of the Poisson process; math.inf: all at once
    burstiness: float  # shape of the gamma-distributed gaps (1.0: Poisson)
    max_concurrency: int | None  # requests in flight at most (None: no limit)
    ignore_eos: bool
    num_warmups: int
    slos_ms: dict[str, float]  # ttft / tpot / e2el -> limit in ms, for goodput
    percentiles: tuple[float, ...]  # reported for every latency metric, e.g. (50, 90, 99)
    api_key: str | None
    seed: int
    progress: bool

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("--num-prompts must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        arrival_gaps(0, self.request_rate, self.seed, self.burstiness)  # checks both


def synthetic_prompts(
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    kind: PromptKind,
    vocab_size: int | None,
    seed: int,
    tokenizer=None,
) -> list[BenchPrompt]:
    """Prompts of random token ids or words; lengths uniform in
    [len * (1 - range_ratio), len * (1 + range_ratio)] like vLLM's random set.

    Ids: from [3, vocab_size) (past the usual pad/bos/eos) when `vocab_size` is given, else from
    `tokenizer`'s (a Hugging Face tokenizer) vocabulary less its special tokens. Text: random
    words; with `tokenizer`, cut to exactly the drawn number of tokens."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    ids = None
    if kind == "ids":
        if vocab_size is not None:
            if vocab_size <= 3:
                raise ValueError(f"--vocab-size must be > 3, got {vocab_size}")
            ids = np.arange(3, vocab_size)
        elif tokenizer is not None:
            special = set(tokenizer.all_special_ids)
            ids = np.array([i for i in range(len(tokenizer)) if i not in special])
            if not len(ids):
                raise ValueError("the tokenizer has no token that is not a special token")
        else:
            raise ValueError("token-id prompts need --vocab-size or --tokenizer")
    rng = np.random.default_rng(seed)

    def lengths(center: int) -> np.ndarray:
        low = max(1, math.floor(center * (1 - range_ratio)))
        high = max(low, math.ceil(center * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_prompts)

    prompts = []
    for n_in, n_out in zip(lengths(input_len), lengths(output_len)):
        n_in = int(n_in)
        if ids is not None:
            prompt: list[int] | str = rng.choice(ids, size=n_in).tolist()
        elif tokenizer is None:
            prompt = " ".join(rng.choice(_WORDS, size=n_in).tolist())
        else:
            prompt, n_in = _exact_text(tokenizer, rng, n_in)
        prompts.append(BenchPrompt(prompt=prompt, prompt_len=n_in, output_len=int(n_out)))
    return prompts


def _exact_text(tokenizer, rng: np.random.Generator, tokens: int) -> tuple[str, int]:
    """Random words cut to `tokens` tokens, and the count the text re-encodes to (a cut inside
    a word can re-encode one token more or less)."""
    words: list[str] = []
    encoded: list[int] = []
    while len(encoded) < tokens:
        before = len(encoded)
        words += rng.choice(_WORDS, size=tokens).tolist()
        encoded = tokenizer.encode(" ".join(words), add_special_tokens=False)
        if len(encoded) <= before:
            raise ValueError("the tokenizer encodes the prompt words to no tokens")
    text = tokenizer.decode(encoded[:tokens])
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def arrival_gaps(
    num_prompts: int, request_rate: float, seed: int, burstiness: float = 1.0
) -> list[float]:
    """Seconds to wait after sending each request: gamma-distributed gaps with mean
    1 / request_rate and shape `burstiness` (1: exponential, a Poisson process), as vLLM's."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"--burstiness must be a positive number, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_prompts
    rng = np.random.default_rng(seed + 1)
    return rng.gamma(burstiness, 1.0 / (request_rate * burstiness), num_prompts).tolist()


def _payload(config: BenchConfig, prompt: BenchPrompt) -> dict:
    if config.endpoint == "/generate":  # SGLang's native route (baton serves it too)
        sampling = {"max_new_tokens": prompt.output_len, "temperature": 0.0}
        if config.ignore_eos:
            sampling["ignore_eos"] = True
        key = "text" if isinstance(prompt.prompt, str) else "input_ids"
        return {key: prompt.prompt, "sampling_params": sampling, "stream": True}
    payload: dict = {
        "model": config.model,
        "max_tokens": prompt.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True  # a vLLM / baton extension of the OpenAI API
    if config.endpoint == "/v1/chat/completions":
        if not isinstance(prompt.prompt, str):
            raise ValueError("the chat endpoint takes text prompts (--prompt-kind text)")
        payload["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        payload["prompt"] = prompt.prompt
    return payload


def _failure(prompt: BenchPrompt, error: str, latency: float, retried: bool) -> RequestRecord:
    return RequestRecord(
        success=False,
        error=error,
        prompt_tokens=prompt.prompt_len,
        output_tokens=0,
        ttft=0.0,
        itl=(),
        latency=latency,
        retried=retried,
    )


class NotSent(Exception):
    """The connection failed before a byte of an answer came back: a kept-alive connection the
    server had already closed (llama-server closes one after each streamed answer although its
    headers say keep-alive). The request never reached the server's queue."""


def _count(usage: dict, key: str, fallback: int) -> int:
    """usage[key] when the server sent a non-negative integer there, else `fallback`."""
    value = usage.get(key)
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else fallback
    )


async def _sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The `data:` payloads of a server-sent event stream, as they arrive (no line-length
    limit: a chunk with many logprobs can be long)."""
    pending = b""
    async for data in response.content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()


async def send_request(
    session: aiohttp.ClientSession,
    config: BenchConfig,
    prompt: BenchPrompt,
    clock: Clock,
    fresh: aiohttp.ClientSession | None,
) -> RequestRecord:
    """Stream one request. `clock` is read once at the send and once per chunk with choices
    (the e2e latency ends at the last of them, as in vLLM). A request whose connection failed
    before any answer (NotSent) is sent once more on a connection of its own from `fresh`
    (None: not retried), timed from that send, and counted as retried in the summary."""
    try:
        return await _attempt(session, config, prompt, clock, retried=False)
    except NotSent as error:
        if fresh is None:
            return _failure(prompt, str(error), 0.0, retried=False)
    try:
        return await _attempt(fresh, config, prompt, clock, retried=True)
    except NotSent as error:
        return _failure(prompt, str(error), 0.0, retried=True)


async def _attempt(
    session: aiohttp.ClientSession,
    config: BenchConfig,
    prompt: BenchPrompt,
    clock: Clock,
    retried: bool,
) -> RequestRecord:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    start = clock()
    last = start
    ttft, gaps, chunks = None, [], 0
    usage: dict = {}
    answered = False
    try:
        async with session.post(
            config.base_url + config.endpoint,
            json=_payload(config, prompt),
            headers=headers,
        ) as response:
            answered = True
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                return _failure(prompt, f"HTTP {response.status}: {body[:300]}", 0.0, retried)
            async for data in _sse_data(response):
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(f"a stream chunk that is not an object: {data[:80]!r}")
                if chunk.get("error"):
                    error = chunk["error"]
                    message = error.get("message", error) if isinstance(error, dict) else error
                    return _failure(prompt, f"stream error: {message}", last - start, retried)
                if config.endpoint == "/generate":
                    # SGLang streams each output's whole text so far, with its token counts:
                    # a chunk brings tokens when completion_tokens grows.
                    meta = chunk.get("meta_info")
                    meta = meta if isinstance(meta, dict) else {}
                    grown = _count(meta, "completion_tokens", 0) > _count(
                        usage, "completion_tokens", 0
                    )
                    usage = meta
                    chunk = {"choices": grown}
                if chunk.get("choices"):
                    now = clock()
                    if ttft is None:
                        ttft = now - start
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
                if isinstance(chunk.get("usage"), dict):
                    # Usually its own last chunk; some servers put it on the last choice chunk,
                    # or on every chunk (vLLM's continuous_usage_stats): the last one counts.
                    usage = chunk["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        # ValueError: a payload that is not JSON (json.JSONDecodeError is one)
        if isinstance(error, aiohttp.ClientConnectionError) and not answered:
            raise NotSent(f"{type(error).__name__}: {error}") from error
        return _failure(prompt, f"{type(error).__name__}: {error}", last - start, retried)
    if ttft is None:
        return _failure(prompt, "the stream ended without a single token", last - start, retried)
    return RequestRecord(
        success=True,
        error="",
        prompt_tokens=_count(usage, "prompt_tokens", prompt.prompt_len),
        output_tokens=_count(usage, "completion_tokens", chunks),
        ttft=ttft,
        itl=tuple(gaps),
        latency=last - start,
        retried=retried,
    )


async def run_benchmark(
    config: BenchConfig,
    clock: Clock = time.perf_counter,
    after_warmup: Callable[[], None] | None = None,
) -> dict:
    """Warm up, send every prompt on the arrival schedule, and return the summary plus the
    per-request records (`requests`). `after_warmup` runs between the warm-up and the first
    request (a scrape of the server's /metrics, so that the warm-up is not counted in it).
    Raises WarmupFailed when the warm-up fails."""
    # aiohttp, not httpx: its C stream reader costs ~3x less CPU per streamed chunk (24-29 vs
    # 73-83 us), and on a small machine the load generator's CPU is taken from the server it
    # measures (vLLM's `bench serve` uses aiohttp too).
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or len(config.prompts) or 1)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)
    semaphore = asyncio.Semaphore(config.max_concurrency or max(1, len(config.prompts)))
    # Retries go on connections used once (force_close): the pool may hold more stale ones.
    fresh = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True, limit=0), timeout=timeout
    )
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client, fresh:

        async def limited(prompt: BenchPrompt, clock: Clock) -> RequestRecord:
            async with semaphore:
                return await send_request(client, config, prompt, clock, fresh)

        if config.num_warmups and config.prompts:
            warm = await asyncio.gather(
                *(limited(config.prompts[0], time.perf_counter) for _ in range(config.num_warmups))
            )
            failed = [record.error for record in warm if not record.success]
            if failed:
                raise WarmupFailed(f"warm-up request failed: {failed[0]}")
        if after_warmup is not None:
            after_warmup()
        bar = tqdm(total=len(config.prompts), disable=not config.progress, desc="bench serve")
        gaps = arrival_gaps(
            len(config.prompts), config.request_rate, config.seed, config.burstiness
        )
        tasks = []
        started = clock()
        for prompt, gap in zip(config.prompts, gaps):
            task = asyncio.create_task(limited(prompt, clock))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
            if gap:
                await asyncio.sleep(gap)
        records = await asyncio.gather(*tasks)
        duration = clock() - started
        bar.close()
    summary = summarize(list(records), duration, config.slos_ms, config.percentiles)
    return {**summary, "requests": [{**asdict(r), "itl": list(r.itl)} for r in records]}
