"""`baton router`'s command line, apart from the router itself (server/router/app.py): every `baton`
command builds this parser, and the router's module brings fastapi and transformers (~1 s on an
idle 2-core machine), which `baton serve` should not wait for before it starts its engine."""

from __future__ import annotations

import logging
import os
import sys

from baton.server.args import DEFAULT_MAX_REQUEST_BYTES, HTTP_PROTOCOL, SERVER_KEEP_ALIVE_S
from baton.server.router.args import add_routing_arguments, routing_args_from
from baton.server.secret_flags import API_KEY_ENV, SecretError, add_api_key_flags, secret

DEFAULT_MAX_CONCURRENT_REQUESTS = 1024


def add_router_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "router",
        help="route requests across prefill and decode workers",
        description="Serve the OpenAI API by sending each request to one prefill and one decode worker "
        "(started with `baton serve --disaggregation-mode prefill|decode`).",
    )
    parser.add_argument("--prefill", default="", help="prefill worker URL(s), comma-separated")
    parser.add_argument("--decode", default="", help="decode worker URL(s), comma-separated")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    add_api_key_flags(
        parser,
        "/v1/*, /generate, /tokenize and /detokenize; forwarded to the workers (requests and "
        "/disagg/info), so give them the same key",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"answer 413 to a request body larger than this (default: {DEFAULT_MAX_REQUEST_BYTES})",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=_positive_int,
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help="generation requests in flight at most; past it the router answers 429 with "
        f"Retry-After (default: {DEFAULT_MAX_CONCURRENT_REQUESTS})",
    )
    add_routing_arguments(parser)
    parser.set_defaults(handler=_run_router)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _run_router(namespace) -> int:
    import uvicorn

    from baton.engine.runtime.gc_freeze import freeze_startup_objects
    from baton.server.router.app import build_router_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    try:
        api_key = secret(
            namespace.api_key, namespace.api_key_file, "--api-key", os.environ, API_KEY_ENV
        )
    except SecretError as error:
        print(f"baton router: {error}", file=sys.stderr)
        return 2
    prefill = [u for u in namespace.prefill.split(",") if u]
    decode = [u for u in namespace.decode.split(",") if u]
    try:
        routing = routing_args_from(namespace)
        if not (prefill and decode) and routing.discovery is None:
            raise ValueError("give --prefill and --decode worker URLs, or --service-discovery")
        app = build_router_app(
            prefill,
            decode,
            api_key,
            namespace.max_concurrent_requests,
            namespace.max_request_bytes,
            routing=routing,
        )
    except (ValueError, RuntimeError) as error:
        print(f"baton router: {error}", file=sys.stderr)
        return 2
    freeze_startup_objects()
    uvicorn.run(
        app,
        host=namespace.host,
        port=namespace.port,
        log_level="warning",
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        http=HTTP_PROTOCOL,
    )
    return 0
