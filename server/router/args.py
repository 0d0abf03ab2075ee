"""`baton router`'s routing settings: policies, retries, circuits, Kubernetes discovery (the
command-line boundary, where their defaults live; SGLang's model gateway's flag names)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from baton.server.router.circuit import CircuitSettings
from baton.server.router.policies import POLICY_NAMES
from baton.server.router.policies.cache_aware import CacheAwareSettings


@dataclass(frozen=True, kw_only=True)
class DiscoveryArgs:
    """Which Kubernetes pods are workers: `selector` pods say their role on /disagg/info;
    `prefill_selector` / `decode_selector` pods have the role of their selector."""

    selector: dict[str, str]
    prefill_selector: dict[str, str]
    decode_selector: dict[str, str]
    namespace: str | None  # None: every namespace (needs cluster-wide permission)
    port: int  # the workers' HTTP port


@dataclass(frozen=True, kw_only=True)
class RetryArgs:
    max_retries: int  # further tries of a request that failed before any byte reached the client
    initial_backoff_s: float
    max_backoff_s: float


@dataclass(frozen=True, kw_only=True)
class RoutingArgs:
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    cache_aware: CacheAwareSettings = CacheAwareSettings(
        cache_threshold=0.3,
        balance_abs_threshold=64,
        balance_rel_threshold=1.5,
        max_tree_size=2**16,
    )
    # the model's tokenizer directory, over the one cache_aware learns from the workers
    tokenizer: str | None = None
    # a try's first token must come within this (router/relay.py says from which worker)
    first_byte_timeout_s: float = 60.0
    retry: RetryArgs = RetryArgs(max_retries=3, initial_backoff_s=0.05, max_backoff_s=1.0)
    circuit: CircuitSettings = CircuitSettings(failure_threshold=5, open_s=30.0)
    discovery: DiscoveryArgs | None = None  # None: only the workers given (and the admin routes)

    def __post_init__(self) -> None:
        for name in (self.prefill_policy, self.decode_policy):
            if name not in POLICY_NAMES:
                raise ValueError(
                    f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
                )
        if not self.first_byte_timeout_s > 0:
            raise ValueError(
                f"--worker-first-byte-timeout-secs must be > 0, got {self.first_byte_timeout_s}"
            )


def _selector(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"a label selector is key=value, got {text!r}")
    return key, value


def _non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value

    return parse


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = RoutingArgs()
    policy = parser.add_argument_group("routing policy")
    policy.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default=defaults.prefill_policy,
        help="how a worker is picked, on both sides: round_robin, random, power_of_two (the less "
        "loaded of two random ones), cache_aware (the one holding the longest prefix that ends at "
        "a Mamba checkpoint, unless the load is too uneven) (default: %(default)s)",
    )
    policy.add_argument(
        "--prefill-policy", choices=POLICY_NAMES, help="prefill side (default: --policy)"
    )
    policy.add_argument(
        "--decode-policy", choices=POLICY_NAMES, help="decode side (default: --policy)"
    )
    settings = defaults.cache_aware
    policy.add_argument(
        "--cache-threshold",
        type=float,
        default=settings.cache_threshold,
        help="cache_aware: a prefix match decides the pick when it covers more than this fraction "
        "of the prompt; below it, the worker remembered to hold the least (default: %(default)s)",
    )
    policy.add_argument(
        "--balance-abs-threshold",
        type=_non_negative(int),
        default=settings.balance_abs_threshold,
        help="cache_aware: balance load instead when the most and least loaded workers differ by "
        "more than this many requests in flight ... (default: %(default)s)",
    )
    policy.add_argument(
        "--balance-rel-threshold",
        type=_non_negative(float),
        default=settings.balance_rel_threshold,
        help="... and the most loaded has more than this times the least's (default: %(default)s)",
    )
    policy.add_argument(
        "--max-tree-size",
        type=_non_negative(int),
        default=settings.max_tree_size,
        help="cache_aware: Mamba checkpoint blocks remembered per worker, least recently used "
        "forgotten first (default: %(default)s)",
    )
    policy.add_argument(
        "--tokenizer",
        "--tokenizer-path",
        help="cache_aware: the served model's tokenizer directory, an override: without it the "
        "router learns the tokenizer from its workers (prompts are matched in tokens, at each "
        "worker's Mamba checkpoint interval)",
    )
    retry = parser.add_argument_group(
        "retries",
        "a request that failed before any byte reached the client (refused, reset, "
        "503, a failed handover) is tried again on another worker pair",
    )
    retry.add_argument(
        "--retry-max-retries",
        type=_non_negative(int),
        default=defaults.retry.max_retries,
        help="further tries at most; 0 turns retries off (default: %(default)s)",
    )
    retry.add_argument(
        "--retry-initial-backoff-ms",
        type=_non_negative(int),
        default=int(defaults.retry.initial_backoff_s * 1000),
        help="wait before the first retry, doubled for each next one (default: %(default)s)",
    )
    retry.add_argument(
        "--retry-max-backoff-ms",
        type=_non_negative(int),
        default=int(defaults.retry.max_backoff_s * 1000),
        help="the longest wait between tries (default: %(default)s)",
    )
    retry.add_argument(
        "--worker-first-byte-timeout-secs",
        type=float,
        default=defaults.first_byte_timeout_s,
        help="a try fails (504, tried elsewhere) when the worker that owes its first token sends "
        "none within this: the prefill half's answer, a stream's first output line (a queue "
        "deeper than this counts too) (default: %(default)s)",
    )
    retry.add_argument(
        "--cb-failure-threshold",
        type=int,
        default=defaults.circuit.failure_threshold,
        help="failures in a row that open a worker's circuit: no requests until a trial one "
        "(default: %(default)s)",
    )
    retry.add_argument(
        "--cb-timeout-duration-secs",
        type=_non_negative(float),
        default=defaults.circuit.open_s,
        help="how long an open circuit waits before its trial request (default: %(default)s)",
    )
    discovery = parser.add_argument_group(
        "Kubernetes service discovery",
        "watch pods by label (in-cluster, or the kubeconfig of $KUBECONFIG); a Ready pod is a "
        "worker at http://POD_IP:PORT, one that goes away drains",
    )
    discovery.add_argument("--service-discovery", action="store_true", help="turn it on")
    for flag, what in (
        ("--selector", "pods that are workers of the role their /disagg/info says"),
        ("--prefill-selector", "prefill worker pods"),
        ("--decode-selector", "decode worker pods"),
    ):
        discovery.add_argument(
            flag, nargs="+", type=_selector, default=[], metavar="KEY=VALUE", help=what
        )
    discovery.add_argument(
        "--service-discovery-namespace",
        help="namespace to watch (default: all, which needs cluster-wide list/watch on pods)",
    )
    discovery.add_argument(
        "--service-discovery-port",
        type=int,
        default=8000,
        help="the workers' HTTP port (default: %(default)s)",
    )


def routing_args_from(namespace: argparse.Namespace) -> RoutingArgs:
    """RoutingArgs from parsed flags (ValueError names what does not fit together)."""
    discovery = None
    selectors = (namespace.selector, namespace.prefill_selector, namespace.decode_selector)
    if namespace.service_discovery:
        if not any(selectors):
            raise ValueError(
                "--service-discovery needs --selector, --prefill-selector or --decode-selector"
            )
        discovery = DiscoveryArgs(
            selector=dict(namespace.selector),
            prefill_selector=dict(namespace.prefill_selector),
            decode_selector=dict(namespace.decode_selector),
            namespace=namespace.service_discovery_namespace,
            port=namespace.service_discovery_port,
        )
    elif any(selectors):
        raise ValueError("selectors are for --service-discovery, which is off")
    if not 0 <= namespace.cache_threshold <= 1:
        raise ValueError(f"--cache-threshold must be in [0, 1], got {namespace.cache_threshold}")
    if namespace.cb_failure_threshold < 1:
        raise ValueError(
            f"--cb-failure-threshold must be >= 1, got {namespace.cb_failure_threshold}"
        )
    return RoutingArgs(
        prefill_policy=namespace.prefill_policy or namespace.policy,
        decode_policy=namespace.decode_policy or namespace.policy,
        cache_aware=CacheAwareSettings(
            cache_threshold=namespace.cache_threshold,
            balance_abs_threshold=namespace.balance_abs_threshold,
            balance_rel_threshold=namespace.balance_rel_threshold,
            max_tree_size=max(1, namespace.max_tree_size),
        ),
        tokenizer=namespace.tokenizer,
        first_byte_timeout_s=namespace.worker_first_byte_timeout_secs,
        retry=RetryArgs(
            max_retries=namespace.retry_max_retries,
            initial_backoff_s=namespace.retry_initial_backoff_ms / 1000,
            max_backoff_s=namespace.retry_max_backoff_ms / 1000,
        ),
        circuit=CircuitSettings(
            failure_threshold=namespace.cb_failure_threshold,
            open_s=namespace.cb_timeout_duration_secs,
        ),
        discovery=discovery,
    )
