"""`baton bench ...` (registered by server/cli.py, the only place that imports bench/)."""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import httpx

from baton.bench.serving.serve_metrics import (
    LATENCY_METRICS,
    PERCENTILES,
    SLO_METRICS,
    parse_percentiles,
)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate")
# vLLM's `bench serve --backend` names of the APIs this client speaks -> their route, and
# SGLang's bench_serving name for its native one.
BACKENDS = {
    "vllm": ENDPOINTS[0],
    "openai": ENDPOINTS[0],
    "openai-chat": ENDPOINTS[1],
    "sglang": ENDPOINTS[2],
}
DEFAULT_VOCAB_SIZE = 1000  # token ids in [3, 1000) when neither a tokenizer nor a size is known
# Any of these in a directory makes it a tokenizer directory for AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _slo(text: str) -> tuple[str, float]:
    name, _, value = text.partition(":")
    if name not in SLO_METRICS or not value:
        raise argparse.ArgumentTypeError(
            f"expected METRIC:MS with METRIC in {list(SLO_METRICS)}, got {text!r}"
        )
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        return parse_percentiles(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _metric_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    unknown = [name for name in names if name not in LATENCY_METRICS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown metric(s) {unknown}; use {list(LATENCY_METRICS)}"
        )
    return names


def _module_doc(name: str) -> str:
    """A module's docstring, read without importing it: baton.bench.serving.serve brings aiohttp and numpy
    (~2 s on a busy 2-core machine), which every `baton` command would pay while it parses."""
    spec = importlib.util.find_spec(name)
    source = Path(spec.origin).read_text() if spec and spec.origin else ""
    return ast.get_docstring(ast.parse(source)) or ""


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks against a running server")
    kinds = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK", required=True)
    parser = kinds.add_parser(
        "serve",
        help="serving load test: TTFT, TPOT, ITL, throughput, goodput (like `vllm bench serve`)",
        description=_module_doc("baton.bench.serving.serve"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--base-url",
        help="server root, e.g. http://127.0.0.1:8000 (an OpenAI client's base_url ending in /v1 "
        "works too; default: http://HOST:PORT)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="without --base-url (default: 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=8000, help="without --base-url (default: 8000)")
    parser.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        help="API route (default: /v1/completions, or as --backend says)",
    )
    parser.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="vllm",
        help="vLLM's names for the API a server speaks: vllm / openai the completions route, "
        "openai-chat the chat route; sglang SGLang's native /generate (default: vllm)",
    )
    parser.add_argument(
        "--dataset-name",
        choices=["random"],
        default="random",
        help="the prompts: synthetic random ones (vLLM's `random` set; no dataset file is read)",
    )
    parser.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    parser.add_argument(
        "--input-len",
        "--random-input-len",
        type=int,
        default=128,
        help="prompt length (default: 128)",
    )
    parser.add_argument(
        "--output-len",
        "--random-output-len",
        type=int,
        default=64,
        help="max_tokens (default: 64)",
    )
    parser.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform within this fraction of --input-len/--output-len (default: 0)",
    )
    parser.add_argument(
        "--prompt-kind",
        choices=["ids", "text"],
        help="random token ids (exact lengths) or random words (default: ids; text for the chat "
        "route, which takes no token ids)",
    )
    parser.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizer (or model) directory: token ids come from its vocabulary, "
        "text prompts are cut to exact token counts (default: the served model's directory, "
        "when it is one on this machine)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="token ids are drawn from [3, this) (default: the tokenizer's vocabulary; "
        f"[3, {DEFAULT_VOCAB_SIZE}) without one)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: inf, all at once)",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed arrival gaps: 1 Poisson, < 1 burstier, > 1 more "
        "even (default: 1)",
    )
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos (baton, vLLM) for exact lengths"
    )
    parser.add_argument(
        "--num-warmups", type=int, default=1, help="untimed requests sent first (default: 1)"
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        type=_slo,
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000",
    )
    parser.add_argument(
        "--metric-percentiles",
        type=_percentiles,
        default=PERCENTILES,
        metavar="P[,P...]",
        help="percentiles reported for TTFT, TPOT, ITL and E2EL, e.g. 50,95,99.9 "
        "(default: 50,90,99)",
    )
    parser.add_argument(
        "--percentile-metrics",
        type=_metric_names,
        default=LATENCY_METRICS,
        metavar="M[,M...]",
        help="which of ttft,tpot,itl,e2el the table shows (default: all; the JSON has all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default: 0)")
    parser.add_argument("--result-json", type=Path, help="write the summary and records here")
    parser.add_argument(
        "--save-result",
        action="store_true",
        help="vLLM's spelling: write them to --result-dir/--result-filename",
    )
    parser.add_argument("--result-dir", type=Path, default=Path("."), help="(default: .)")
    parser.add_argument(
        "--result-filename",
        help="(default: baton-bench-serve-MODEL-RATEqps-YYYYmmdd-HHMMSS.json)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    parser.set_defaults(handler=_run_serve_bench)


def server_root(url: str) -> str:
    """The server's root URL from what a user may pass: `host:port` (http), a trailing slash,
    or an OpenAI client's base_url ending in /v1."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url.removesuffix("/v1")


def _served_models(base_url: str, api_key: str | None) -> list[dict]:
    """The entries of the server's /v1/models that name a model; ValueError when none does."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    try:
        data = response.json()["data"]
        models = [entry for entry in data if isinstance(entry.get("id"), str)]
    except (ValueError, LookupError, TypeError, AttributeError):
        models = []
    if not models:
        raise ValueError(
            f"{base_url}/v1/models did not list a model ({response.text[:200]!r}); pass --model"
        )
    return models


def _is_tokenizer_dir(path: object) -> bool:
    try:
        return isinstance(path, str) and any(
            (Path(path) / name).is_file() for name in TOKENIZER_FILES
        )
    except (OSError, ValueError):  # a name no file system holds (a NUL, too long)
        return False


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ValueError(f"--tokenizer {path}: not a directory (a local tokenizer or model dir)")
    if not _is_tokenizer_dir(path):
        raise ValueError(f"--tokenizer {path}: none of {', '.join(TOKENIZER_FILES)} is there")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"--tokenizer {path}: no tokenizer could be loaded there ({error})"
        ) from None


def _default_tokenizer(model: str, listed: list[dict]) -> str | None:
    """The served model's directory when it is one on this machine (vLLM's `bench serve` also
    takes the model for the tokenizer): --model, else what /v1/models says of it (root)."""
    candidates = [model] + [entry.get("root") for entry in listed if entry.get("id") == model]
    return next((path for path in candidates if _is_tokenizer_dir(path)), None)


def _run_serve_bench(namespace: argparse.Namespace) -> int:
    from baton.bench.serving.serve import (
        BenchConfig,
        WarmupFailed,
        run_benchmark,
        synthetic_prompts,
    )
    from baton.bench.serving.serve_metrics import format_summary

    base_url = server_root(namespace.base_url or f"http://{namespace.host}:{namespace.port}")
    endpoint = namespace.endpoint or BACKENDS[namespace.backend]
    prompt_kind = namespace.prompt_kind or ("text" if endpoint == ENDPOINTS[1] else "ids")
    tokenizer_path = namespace.tokenizer
    vocab_size = namespace.vocab_size
    try:
        listed = [] if namespace.model else _served_models(base_url, namespace.api_key)
        model = namespace.model or str(listed[0]["id"])
        if tokenizer_path is None and (vocab_size is None or prompt_kind == "text"):
            tokenizer_path = _default_tokenizer(model, listed)
            if tokenizer_path is not None:
                print(f"baton bench serve: the tokenizer in {tokenizer_path}", file=sys.stderr)
        tokenizer = None if tokenizer_path is None else _load_tokenizer(tokenizer_path)
        if tokenizer is None and vocab_size is None:
            vocab_size = DEFAULT_VOCAB_SIZE
        prompts = synthetic_prompts(
            num_prompts=namespace.num_prompts,
            input_len=namespace.input_len,
            output_len=namespace.output_len,
            range_ratio=namespace.range_ratio,
            kind=prompt_kind,
            vocab_size=vocab_size,
            seed=namespace.seed,
            tokenizer=tokenizer,
        )
        config = BenchConfig(
            base_url=base_url,
            endpoint=endpoint,
            model=model,
            prompts=prompts,
            request_rate=namespace.request_rate,
            burstiness=namespace.burstiness,
            max_concurrency=namespace.max_concurrency,
            ignore_eos=namespace.ignore_eos,
            num_warmups=namespace.num_warmups,
            slos_ms=dict(namespace.goodput),
            percentiles=namespace.metric_percentiles,
            api_key=namespace.api_key,
            seed=namespace.seed,
            progress=not namespace.no_progress,
        )
        result = asyncio.run(run_benchmark(config))
    except WarmupFailed as error:
        print(f"baton bench serve: {error}", file=sys.stderr)
        if "HTTP 400" in str(error) and prompt_kind == "ids" and not tokenizer_path:
            print(
                f"  (the prompts were random token ids in [3, {vocab_size}): pass --tokenizer "
                "DIR or --vocab-size N for this model, or --prompt-kind text)",
                file=sys.stderr,
            )
        return 1
    except (ValueError, RuntimeError, httpx.HTTPError) as error:
        print(f"baton bench serve: {error}", file=sys.stderr)
        return 1
    print(format_summary(result, namespace.percentile_metrics))
    path = namespace.result_json
    if path is None and namespace.save_result:
        rate = "inf" if math.isinf(namespace.request_rate) else f"{namespace.request_rate:g}"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"baton-bench-serve-{Path(model).name or 'model'}-{rate}qps-{stamp}.json"
        path = namespace.result_dir / (namespace.result_filename or name)
    if path is not None:
        settings = {
            key: str(value) if isinstance(value, Path) else value
            for key, value in vars(namespace).items()
            if key not in ("handler", "api_key")
        }
        settings.update(
            base_url=base_url,
            endpoint=endpoint,
            prompt_kind=prompt_kind,
            goodput=dict(namespace.goodput),
            model=model,
            tokenizer=tokenizer_path,
            vocab_size=vocab_size,
            result_json=str(path),
        )
        if math.isinf(namespace.request_rate):
            settings["request_rate"] = "inf"  # JSON has no infinity
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"config": settings, **result}, indent=1))
        except OSError as error:
            print(f"baton bench serve: cannot write {path}: {error}", file=sys.stderr)
            return 1
        print(f"results: {path}")
    return 0 if result["completed"] else 1
