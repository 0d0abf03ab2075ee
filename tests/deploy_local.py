"""deploy/'s manifests run on this machine: every pod of the worker Deployments and the router
started with its container's own command and environment, a stub Kubernetes API serving those
pods to the router's discovery.

What differs here, and only this (`LOCAL`): the model directory is assets/ (the manifests mount
a 9B model at /models/...), the device is the CPU and the dtype float32, each pod gets its own
loopback address (127.0.0.2, .3, ...) as its pod IP and listens there (pods share this
machine's ports, so the manifests' 8000 and 9100 become free ports, the same for every pod),
the Secret gets a value (as an operator creates it), and the small model's workers are sized
for the CPU (a track interval that its short prompts reach, one engine thread each).
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.server_process import BATON, ServerProcess, free_port, launch, wait_ready
from tests.stub_kubernetes import StubKubernetes

DEPLOY = Path(__file__).parents[1] / "deploy"
ASSETS = Path(__file__).parents[1] / "assets"
MODEL_MOUNT = "/models/NVIDIA-Nemotron-Nano-9B-v2"
LOCAL = {MODEL_MOUNT: str(ASSETS), "cuda": "cpu", "bfloat16": "float32"}
SMALL_MODEL_ON_CPU = ["--mamba-track-interval", "64", "--max-mamba-slots", "1024", "--cpu-threads", "1"]  # fmt: skip


def manifests() -> list[dict]:
    return [
        doc
        for path in sorted(DEPLOY.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in a container's command."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in argv]


def container_env(container: dict, pod_ip: str, namespace: str, secrets_by_name: dict) -> dict:
    """The container's environment as the kubelet would build it for a pod at `pod_ip`."""
    env = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            env[item["name"]] = {"status.podIP": pod_ip, "metadata.namespace": namespace}[field]
        else:
            ref = source["secretKeyRef"]
            env[item["name"]] = secrets_by_name[ref["name"]]["stringData"][ref["key"]]
    return env


@dataclass
class LocalPod:
    name: str
    ip: str
    server: ServerProcess


class LocalDeployment:
    """Start with `start()`, stop with `stop()`; `pods[role]` and `router` while it runs."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.docs = manifests()
        self.kubernetes = StubKubernetes()
        self.pods: dict[str, list[LocalPod]] = {}
        self.router: ServerProcess | None = None
        self.http_port, self.transfer_port = free_port(), free_port()
        # the operator's step: the Secret with a random value
        self.secrets = of_kind(self.docs, "Secret")
        for secret in self.secrets.values():
            secret["stringData"] = {key: secrets.token_hex(16) for key in secret["stringData"]}

    def _launch(self, deployment: dict, index: int, ip: str, extra_env: dict) -> ServerProcess:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        namespace = deployment["metadata"]["namespace"]
        env = container_env(container, ip, namespace, self.secrets)
        argv = expand(container["command"], env)
        assert argv[0] == "baton", argv
        ports = {"8000": str(self.http_port), "9100": str(self.transfer_port), "0.0.0.0": ip}
        argv = [LOCAL.get(a, ports.get(a, a)) for a in argv[1:]]
        if argv[0] == "serve":
            argv += SMALL_MODEL_ON_CPU
        name = f"{deployment['metadata']['name']}-{index}"
        log = self.logs / f"{name}.log"
        environment = {**os.environ, **env, **extra_env}
        return launch([str(BATON), *argv], self.http_port, log, None, env=environment, host=ip)

    def start(self) -> LocalDeployment:
        self.kubernetes.__enter__()
        deployments = of_kind(self.docs, "Deployment")
        next_ip = 2
        for name in ("baton-prefill", "baton-decode"):
            deployment = deployments[name]
            role = deployment["spec"]["template"]["metadata"]["labels"][
                "app.kubernetes.io/component"
            ]
            self.pods[role] = []
            for index in range(deployment["spec"]["replicas"]):
                ip = f"127.0.0.{next_ip}"
                next_ip += 1
                self.pods[role].append(
                    LocalPod(f"{name}-{index}", ip, self._launch(deployment, index, ip, {}))
                )
        for pods in self.pods.values():
            for pod in pods:
                wait_ready(pod.server)
        for role, pods in self.pods.items():
            template = deployments[f"baton-{role}"]["spec"]["template"]
            for pod in pods:
                self.kubernetes.put(self._pod(pod, template, deployments[f"baton-{role}"]))
        router = deployments["baton-router"]
        kubeconfig = self.kubernetes.kubeconfig(self.logs)
        self.router = self._launch(router, 0, "127.0.0.1", {"KUBECONFIG": str(kubeconfig)})
        wait_ready(self.router)
        return self

    @staticmethod
    def _pod(pod: LocalPod, template: dict, deployment: dict) -> dict:
        from tests.stub_kubernetes import pod as pod_object

        return pod_object(
            pod.name,
            template["metadata"]["labels"],
            pod.ip,
            namespace=deployment["metadata"]["namespace"],
        )

    def stop(self) -> None:
        for server in [self.router, *(p.server for pods in self.pods.values() for p in pods)]:
            if server is not None:
                server.stop()
        self.kubernetes.__exit__(None, None, None)
