"""`baton` command line: one subcommand per tool (`serve`, `router`, `up`, `eval`, `bench`)."""

from __future__ import annotations

import argparse
import os
import sys

from baton.engine.config import DTYPE_NAMES, QUANTIZATION_NAMES
from baton.engine.runtime.torch_import import defer_torch
from baton.server.args import ServerArgs
from baton.server.lora_args import add_lora_arguments
from baton.server.parsers.reasoning import REASONING_PARSERS
from baton.server.parsers.tools import TOOL_CALL_PARSERS
from baton.server.secret_flags import (
    API_KEY_ENV,
    DISAGG_SECRET_ENV,
    add_api_key_flags,
    add_disagg_secret_file_flag,
    secret,
)
from baton.server.spec_args import add_speculative_arguments
from baton.server.tier_args import add_tier_arguments

_DEFAULTS = ServerArgs.__dataclass_fields__


def _default(name: str):
    return _DEFAULTS[name].default


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """Show a flag's default when it has one (unset-by-default flags say what happens instead)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in help_text:
            help_text += " (default: %(default)s)"
        return help_text


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model behind an OpenAI-compatible HTTP API",
        description="Start an engine process for MODEL and an OpenAI-compatible HTTP server in front of it "
        "(/v1/completions, /v1/chat/completions, /v1/responses, /v1/models, /health, /metrics, /tokenize, "
        "/detokenize).",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL",
        help="the model directory, as `vllm serve MODEL` takes it (or --model)",
    )
    parser.add_argument(
        "--model",
        "--model-path",
        help="Hugging Face model directory (config.json, safetensors, tokenizer)",
    )
    parser.add_argument("--host", default=_default("host"), help="address to listen on")
    parser.add_argument("--port", type=int, default=_default("port"), help="port to listen on")
    parser.add_argument(
        "--served-model-name", help="name clients pass as `model` (default: the --model path)"
    )
    parser.add_argument(
        "--tokenizer",
        help="Hugging Face tokenizer directory, for a model directory without one "
        "(default: the --model directory)",
    )
    add_api_key_flags(parser, "/v1/*, /tokenize, /detokenize, /disagg/*, /docs and /openapi.json")
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=_default("max_request_bytes"),
        help="answer 413 to a request body larger than this",
    )
    parser.add_argument(
        "--log-level",
        default=_default("log_level"),
        choices=["debug", "info", "warning", "error"],
        help="logging level",
    )

    engine = parser.add_argument_group(
        "engine", "unset sizes are chosen by the engine from the model and the machine"
    )
    engine.add_argument(
        "--dtype",
        default=_default("dtype"),
        choices=DTYPE_NAMES,
        help="weights and activations dtype; auto: the checkpoint's own (its config.json)",
    )
    engine.add_argument(
        "--device", default=_default("device"), help="torch device: cpu, cuda, cuda:1…"
    )
    engine.add_argument(
        "--max-model-len", type=_non_negative_int, help="longest prompt + completion, in tokens"
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=_non_negative_int,
        help="tokens one engine step may process",
    )
    engine.add_argument(
        "--chunked-prefill-size",
        type=_non_negative_int,
        help="longest prefill chunk of one request per step",
    )
    engine.add_argument(
        "--max-running-requests",
        "--max-num-seqs",
        type=_non_negative_int,
        help="requests decoded together at most",
    )
    engine.add_argument(
        "--max-total-tokens", type=_non_negative_int, help="KV cache size in tokens"
    )
    engine.add_argument(
        "--max-mamba-slots",
        type=_non_negative_int,
        help="Mamba state slots (one per running request)",
    )
    engine.add_argument(
        "--cpu-threads",
        type=int,
        help="CPU threads of the engine process (default: one per core; `baton up` gives each "
        "worker half the cores)",
    )
    engine.add_argument("--page-size", type=_non_negative_int, help="tokens per KV cache page")
    engine.add_argument(
        "--seed",
        type=int,
        help="engine random seed for requests that give none (default: chosen by the engine)",
    )
    engine.add_argument(
        "--engine-start-timeout",
        type=float,
        default=_default("engine_start_timeout"),
        help="seconds to wait for the model to load",
    )

    engine.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATION_NAMES,
        help="as vLLM spells it: fp8 (fine-grained or per-tensor FP8 checkpoints; on an "
        "unquantized checkpoint, FP8 weights quantized at load), modelopt / modelopt_fp4 / "
        "modelopt_mixed (NVIDIA ModelOpt FP8 / NVFP4 / mixed checkpoints) (default: what the "
        "checkpoint's quantization_config says, else none)",
    )
    engine.add_argument(
        "--tensor-parallel-size",
        "--tp",
        "--tp-size",
        dest="tensor_parallel_size",
        type=int,
        help="ranks (processes) the model is sharded over; rank 0 is the engine process "
        "(default: 1)",
    )
    engine.add_argument(
        "--tp-timeout",
        type=float,
        help="seconds a tensor-parallel rank may take in one step before the engine fails "
        "its requests and exits (default: 60)",
    )
    engine.add_argument(
        "--mem-fraction",
        type=float,
        help="fraction of the free GPU memory for the KV and Mamba pools; on the CPU, of the "
        "available memory, and at most 4 GiB (default: 0.85)",
    )
    engine.add_argument(
        "--kv-cache-memory-bytes",
        type=_non_negative_int,
        help="memory for the KV and Mamba pools, in bytes, instead of --mem-fraction; the pools "
        "hold --max-running-requests requests at --max-model-len within it (CPU pools take "
        "memory as requests use them)",
    )
    engine.add_argument(
        "--disable-cuda-graph", action="store_true", help="CUDA: run decode steps eagerly"
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly: no CUDA graphs, no captured CPU decode step",
    )
    engine.add_argument(
        "--cuda-graph-max-bs",
        type=_non_negative_int,
        help="largest decode batch captured: in a CUDA graph (default: --max-running-requests) "
        "or a CPU plan (default: 16)",
    )

    engine.add_argument(
        "--schedule-policy",
        default=_default("schedule_policy"),
        choices=["mixed", "prefill-first"],
        help="mixed (default, vLLM V1's): each step runs the running requests' decodes, then new "
        "prefills with the rest of the token budget; prefill-first (SGLang's): while requests "
        "wait, a step runs prefills only (within --max-prefill-tokens) and the decodes wait one "
        "step (first tokens sooner, running requests' next tokens later)",
    )
    engine.add_argument(
        "--max-prefill-tokens",
        type=_non_negative_int,
        help="tokens of one prefill-first step (default: 512 on the CPU, else "
        "--max-num-batched-tokens)",
    )
    engine.add_argument(
        "--request-metrics",
        action="store_true",
        help="time every request inside the engine and expose queue / prefill / decode time, "
        "steps waited and first-step size as baton:request_* histograms on /metrics",
    )

    add_lora_arguments(parser)

    cache = parser.add_argument_group("prefix cache")
    cache.add_argument(
        "--no-prefix-cache",
        "--no-enable-prefix-caching",
        "--disable-radix-cache",
        dest="no_prefix_cache",
        action="store_true",
        help="turn prefix caching (shared KV pages + Mamba checkpoints) off",
    )
    cache.add_argument(
        "--mamba-track-interval",
        type=_non_negative_int,
        help="tokens between Mamba state checkpoints; a multiple of the SSD chunk size and the "
        "page size (default: near 512)",
    )

    disagg = parser.add_argument_group(
        "disaggregation", "run as one half of a prefill/decode pair behind `baton router`"
    )
    disagg.add_argument(
        "--disaggregation-mode",
        choices=["prefill", "decode"],
        help="prefill: compute prompts and push their state; decode: receive it and generate "
        "(default: colocated, both in one worker)",
    )
    disagg.add_argument(
        "--disagg-host",
        default=_default("disagg_host"),
        help="prefill: address the transfer socket binds to and advertises",
    )
    disagg.add_argument(
        "--disagg-port",
        type=_non_negative_int,
        default=_default("disagg_port"),
        help="prefill: transfer port (0 picks a free one)",
    )
    disagg.add_argument(
        "--disagg-secret",
        help="shared secret authenticating worker-to-worker messages (or $BATON_DISAGG_SECRET;"
        " visible in `ps`: prefer --disagg-secret-file or the variable)",
    )
    add_disagg_secret_file_flag(disagg)
    disagg.add_argument(
        "--disagg-timeout",
        type=float,
        default=_default("disagg_timeout"),
        help="seconds a room may wait for its peer or its state before failing, queueing on the "
        "prefill worker included; a dead peer is noticed within 10 s by heartbeats (default: 300)",
    )
    disagg.add_argument(
        "--disaggregation-transfer-backend",
        choices=["zmq", "nixl"],
        default=_default("disaggregation_transfer_backend"),
        help="how the KV pages and state move between the pair (both workers must agree): zmq"
        " frames on the authenticated control channel, or nixl READs by the decode worker from"
        " the prefill worker's pools (UCX; pip install 'baton[nixl]'; UCX_TLS picks the"
        " transports) (default: zmq)",
    )
    disagg.add_argument(
        "--disagg-max-rooms-per-peer",
        type=int,
        default=_default("disagg_max_rooms_per_peer"),
        help="prefill: rooms one decode worker may hold open at once (more are rejected)",
    )

    chat = parser.add_argument_group("chat", "tool calls, reasoning and templates, as vLLM's flags")
    chat.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="read tool calls in the model's answers in this format: hermes (Qwen3, "
        "Qwen3-Next, Falcon-H1, the shipped model), granite4 (Granite-4.0), qwen3_coder "
        "(Nemotron 3, Qwen3.5), nemotron_json (Nemotron Nano 9B v2)",
    )
    chat.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide to call tools (tool_choice "auto", the default with tools); '
        "needs --tool-call-parser",
    )
    chat.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="put the model's thinking (<think>...</think>) in the message's `reasoning` field",
    )
    chat.add_argument(
        "--chat-template",
        help="a Jinja chat template file (or the template itself) to use instead of the model's",
    )

    add_tier_arguments(parser)
    add_speculative_arguments(parser)

    server = parser.add_argument_group("admission")
    server.add_argument(
        "--max-queued-requests",
        type=_non_negative_int,
        help="answer 503 while this many requests wait to be scheduled (default: no limit)",
    )
    parser.set_defaults(handler=_run_serve)


def _run_serve(namespace: argparse.Namespace) -> int:
    from baton.server.launch import ENGINE_DIED_EXIT_CODE, EngineDied, run

    if namespace.model_dir and namespace.model and namespace.model_dir != namespace.model:
        print(
            f"baton serve: two models given ({namespace.model_dir} and --model "
            f"{namespace.model}); pass one",
            file=sys.stderr,
        )
        return 2
    namespace.model = namespace.model or namespace.model_dir
    if not namespace.model:
        print("baton serve: no model given: baton serve DIR (or --model DIR)", file=sys.stderr)
        return 2

    try:
        namespace.api_key = secret(
            namespace.api_key, namespace.api_key_file, "--api-key", os.environ, API_KEY_ENV
        )
        namespace.disagg_secret = secret(
            namespace.disagg_secret,
            namespace.disagg_secret_file,
            "--disagg-secret",
            os.environ,
            DISAGG_SECRET_ENV,
        )
        options = {
            name: getattr(namespace, name)
            for name in ServerArgs.field_names()
            if hasattr(namespace, name)
        }
        args = ServerArgs(**options)
    except ValueError as error:
        print(f"baton serve: {error}", file=sys.stderr)
        return 2
    try:
        run(args)
    except EngineDied as error:
        print(f"baton serve: {error}", file=sys.stderr)
        return ENGINE_DIED_EXIT_CODE
    except RuntimeError as error:
        print(f"baton serve: {error}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton",
        description="baton: serve hybrid Mamba2 + attention LLMs (Nemotron-H) behind an OpenAI-compatible API.",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    add_serve_parser(subparsers)
    from baton.server.router.cli import add_router_parser
    from baton.server.up import add_up_parser

    add_router_parser(subparsers)
    add_up_parser(subparsers)
    from baton.bench.accuracy.gsm8k import (
        add_eval_parser,  # bench/ is a client of baton; only the CLI imports it
    )

    add_eval_parser(subparsers)
    from baton.bench.cli import add_bench_parser

    add_bench_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # No baton command holds tensors in this process (the engines run in their own): torch is
    # kept out, and transformers (tokenizers, configs) runs without it, see torch_import.py.
    defer_torch()
    namespace = build_parser().parse_args(argv)
    return namespace.handler(namespace)


if __name__ == "__main__":
    sys.exit(main())
