"""Kubernetes service discovery: worker pods found by label, added and drained as they come
and go, through the official `kubernetes` client.

    one thread per selector:  list pods ──> reconcile (every Ready pod is a worker, every other
                                │            one that was drains)
                                └─> watch from the list's resourceVersion ──> each event
                                    reconciles its pod; the watch ends every WATCH_S (or on an
                                    error: after RETRY_S) and the loop lists again, so an event
                                    missed while disconnected is caught up by the next list

A pod is a worker at http://POD_IP:--service-discovery-port once it is Running and Ready and not
being deleted. Its role is its selector's (`--prefill-selector`, `--decode-selector`) or, for
`--selector`, what its `/disagg/info` says; its transfer address always comes from there (the
router's probes read it). The client reads the in-cluster service account, or else the
kubeconfig ($KUBECONFIG): the router's pod needs list and watch on pods (deploy/ has the Role).
The client is synchronous, so each watch runs in a thread and hands its pods to the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass

import httpx

from baton.server.router.args import DiscoveryArgs
from baton.server.router.info import Role, read_info
from baton.server.router.urls import worker_url
from baton.server.router.workers import WorkerSet, describe

logger = logging.getLogger("baton.router.discovery")

WATCH_S = 30  # a watch is closed and the pods listed again this often
RETRY_S = 1.0  # after an error talking to the API server


@dataclass(frozen=True, kw_only=True)
class PodState:
    key: str  # namespace/name
    url: str | None  # None: not (or no longer) a usable worker


def pod_state(pod, port: int) -> PodState:
    """What a pod (a V1Pod) means to the router."""
    meta, status = pod.metadata, pod.status
    key = f"{meta.namespace}/{meta.name}"
    if (
        status is None
        or meta.deletion_timestamp is not None
        or status.phase != "Running"
        or not status.pod_ip
        or not any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
    ):
        return PodState(key=key, url=None)
    ip = status.pod_ip
    host = f"[{ip}]" if ":" in ip else ip
    try:
        return PodState(key=key, url=worker_url(f"http://{host}:{port}"))
    except ValueError as error:  # not an address: the API server's answer is checked too
        logger.warning("pod %s: %s", key, error)
        return PodState(key=key, url=None)


def _selector_text(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


class PodWatch:
    """One selector's pods, watched in a thread; its changes applied on the event loop."""

    def __init__(
        self,
        workers: WorkerSet,
        args: DiscoveryArgs,
        labels: dict[str, str],
        role: Role | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.workers, self.args, self.role, self.loop = workers, args, role, loop
        self.selector = _selector_text(labels)
        self.pods: dict[str, str] = {}  # pod key -> its worker URL (event loop only)
        self.stopped = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"discovery {self.selector}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        from kubernetes import client, watch

        api = client.CoreV1Api(_api_client())
        # The API function itself, not a wrapper: the watch reads its docstring to know the
        # objects it streams (V1Pod).
        if self.args.namespace:
            list_pods, where = api.list_namespaced_pod, (self.args.namespace,)
        else:
            list_pods, where = api.list_pod_for_all_namespaces, ()
        while not self.stopped.is_set():
            try:
                listed = list_pods(*where, label_selector=self.selector)
                states = [pod_state(pod, self.args.port) for pod in listed.items]
                self._hand_over(states, complete=True)
                stream = watch.Watch().stream(
                    list_pods,
                    *where,
                    label_selector=self.selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=WATCH_S,
                )
                for event in stream:
                    if self.stopped.is_set():
                        return
                    state = pod_state(event["object"], self.args.port)
                    if event["type"] == "DELETED":
                        state = PodState(key=state.key, url=None)
                    self._hand_over([state], complete=False)
            except Exception as error:  # the API server away, a 410 Gone, a broken stream
                logger.warning("watching pods %s: %s", self.selector, describe(error))
                self.stopped.wait(RETRY_S)

    def _hand_over(self, states: list[PodState], complete: bool) -> None:
        future = asyncio.run_coroutine_threadsafe(self.apply(states, complete), self.loop)
        while not self.stopped.is_set():  # (a loop that closed never completes it)
            try:
                future.result(timeout=RETRY_S)
                return
            except concurrent.futures.TimeoutError:
                continue

    # -- the event loop ---------------------------------------------------------------------------

    async def apply(self, states: list[PodState], complete: bool) -> None:
        """Add the pods that became workers, drain the ones that stopped being; `complete`: the
        states are every pod of the selector (a list), so the ones not named are gone."""
        seen = {state.key for state in states}
        gone = [key for key in self.pods if complete and key not in seen]
        for state in states:
            if state.url is None or self.pods.get(state.key) not in (None, state.url):
                gone.append(state.key)
        for key in gone:
            url = self.pods.pop(key, None)
            if url is not None:
                logger.info("pod %s went away: its worker %s drains", key, url)
                self.workers.remove(url)
        for state in states:
            if state.url is not None and state.key not in self.pods:
                await self._add(state)

    async def _add(self, state: PodState) -> None:
        role = self.role
        if role is None:
            try:
                role = (await read_info(self.workers.probe_client, state.url)).role
            except (httpx.HTTPError, KeyError, TypeError, ValueError) as error:
                logger.warning(
                    "pod %s: cannot read %s/disagg/info yet (%s)",
                    state.key,
                    state.url,
                    describe(error),
                )
                return  # the next list tries again
        try:
            worker = self.workers.add(state.url, role)
        except ValueError as error:
            logger.warning("pod %s: %s", state.key, error)
            return
        self.pods[state.key] = state.url
        logger.info("pod %s is a %s worker at %s", state.key, role, state.url)
        await self.workers.probe(worker)


def _api_client():
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def start_discovery(
    workers: WorkerSet, args: DiscoveryArgs, loop: asyncio.AbstractEventLoop
) -> list[PodWatch]:
    watches = [
        PodWatch(workers, args, labels, role, loop)
        for labels, role in (
            (args.selector, None),
            (args.prefill_selector, "prefill"),
            (args.decode_selector, "decode"),
        )
        if labels
    ]
    for pod_watch in watches:
        pod_watch.start()
    return watches
