"""deploy/'s manifests, read: valid Kubernetes objects (the schemas, offline), commands that
baton's own command line parses, probes on routes the processes serve without a key, and
ports, labels, Secrets, volumes and permissions that refer to each other. (They run locally in
tests/test_router_many_workers.py.)"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import kubernetes_validate
import pytest
from prometheus_client import Counter

from baton.server.app import build_app
from baton.server.args import ServerArgs
from baton.server.cli import build_parser
from baton.server.metrics import _ENGINE_METRICS
from baton.server.middleware import OPEN_PATHS
from baton.server.router.app import build_router_app
from baton.server.router.args import routing_args_from
from tests.deploy_local import LOCAL, expand, manifests, of_kind

KUBERNETES_VERSION = "1.30"
DOCS = manifests()
DEPLOYMENTS = of_kind(DOCS, "Deployment")
WORKERS = ("baton-prefill", "baton-decode")


def container(name: str) -> dict:
    (only,) = DEPLOYMENTS[name]["spec"]["template"]["spec"]["containers"]
    return only


def argv(name: str) -> list[str]:
    """The container's command after `baton`, its $(VAR)s named by its own env."""
    spec = container(name)
    names = {item["name"]: f"<{item['name']}>" for item in spec.get("env", [])}
    command = expand(spec["command"], names)  # KeyError: a $(VAR) its env does not define
    assert command[0] == "baton"
    return command[1:]


def flag(name: str, option: str) -> str:
    args = argv(name)
    return args[args.index(option) + 1]


def port(name: str, port_name: str) -> int:
    return next(p["containerPort"] for p in container(name)["ports"] if p["name"] == port_name)


def labels(name: str) -> dict[str, str]:
    return DEPLOYMENTS[name]["spec"]["template"]["metadata"]["labels"]


def test_every_manifest_is_a_valid_kubernetes_object():
    kinds = {doc["kind"] for doc in DOCS}
    assert {"Deployment", "Service", "Secret", "Role", "HorizontalPodAutoscaler"} <= kinds
    for doc in DOCS:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy(DEPLOYMENTS["baton-router"])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_each_command_is_one_baton_parses_flag_by_flag(name, monkeypatch):
    args = argv(name)
    for item in container(name).get("env", []):  # the pod's environment (the Secret's value)
        monkeypatch.setenv(item["name"], f"<{item['name']}>")
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "==SUPPRESS==" and a.choices]
    options = commands.choices[args[0]]._option_string_actions
    for token in args:
        if token.startswith("--"):
            assert token in options, f"{name}: baton {args[0]} has no {token}"  # no abbreviations
    namespace = parser.parse_args(args)
    if args[0] == "serve":  # its checks of the values too, on a model directory that is here
        namespace.model = LOCAL[namespace.model]
        fields = ServerArgs.field_names()
        ServerArgs(**{k: getattr(namespace, k) for k in fields if hasattr(namespace, k)})
    else:
        routing = routing_args_from(namespace)
        assert routing.discovery is not None and routing.prefill_policy == "cache_aware"
        assert routing.tokenizer is None  # learned from the workers: no model volume to mount


def _routes(name: str) -> set[str]:
    if argv(name)[0] == "router":
        app = build_router_app([], [])
    else:
        state = SimpleNamespace(
            args=SimpleNamespace(max_request_bytes=1024, api_key=None),
            metrics=SimpleNamespace(requests=Counter("unused", "unused", registry=None)),
        )
        app = build_app(state)

    def paths(routes) -> set[str]:
        found = set()
        for route in routes:
            if hasattr(route, "original_router"):  # an included router (the admin routes)
                found |= paths(route.original_router.routes)
            else:
                found.add(route.path)
        return found

    return paths(app.routes)


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_probes_ask_routes_the_process_serves_without_a_key(name):
    spec, routes = container(name), _routes(name)
    probes = [
        spec[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in spec
    ]
    assert {"readinessProbe", "livenessProbe"} <= set(spec)
    for probe in probes:
        path, target = probe["httpGet"]["path"], probe["httpGet"]["port"]
        assert path in routes and path in OPEN_PATHS, (name, path)
        assert port(name, target) == int(flag(name, "--port")), (name, target)


def test_worker_ports_are_the_ones_their_commands_listen_on():
    for name in WORKERS:
        assert port(name, "http") == int(flag(name, "--port"))
        assert container(name)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert port("baton-prefill", "transfer") == int(flag("baton-prefill", "--disagg-port"))
    assert flag("baton-prefill", "--disagg-host") == "<POD_IP>"  # advertised to decode pods
    pod_ip = next(e for e in container("baton-prefill")["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_the_router_finds_each_role_by_its_own_labels_on_its_port():
    router = argv("baton-router")
    for role, name in (("prefill", "baton-prefill"), ("decode", "baton-decode")):
        start = router.index(f"--{role}-selector") + 1
        end = next(
            i
            for i in range(start, len(router) + 1)
            if i == len(router) or router[i].startswith("--")
        )
        selector = dict(term.split("=", 1) for term in router[start:end])
        assert selector and selector.items() <= labels(name).items(), role
        other = "baton-decode" if role == "prefill" else "baton-prefill"
        assert not selector.items() <= labels(other).items(), role
        assert int(flag("baton-router", "--service-discovery-port")) == port(name, "http")
    assert flag("baton-router", "--service-discovery-namespace") == "<POD_NAMESPACE>"


def test_services_secrets_volumes_and_permissions_refer_to_what_exists():
    namespaces = {doc["metadata"].get("namespace") for doc in DOCS if doc["kind"] != "Namespace"}
    assert namespaces == {next(iter(of_kind(DOCS, "Namespace")))}
    for name, deployment in DEPLOYMENTS.items():
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels(name).items(), name
        for volume in deployment["spec"]["template"]["spec"].get("volumes", []):
            assert volume["persistentVolumeClaim"]["claimName"] in of_kind(
                DOCS, "PersistentVolumeClaim"
            )
    secrets = of_kind(DOCS, "Secret")
    for name in WORKERS:
        refs = [
            e["valueFrom"]["secretKeyRef"]
            for e in container(name)["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        ]
        assert [
            e["name"] for e in container(name)["env"] if "secretKeyRef" in e.get("valueFrom", {})
        ] == ["BATON_DISAGG_SECRET"]
        for ref in refs:
            assert ref["key"] in secrets[ref["name"]]["stringData"]
        assert not any("secret" in token.lower() for token in argv(name))  # never on argv
    (service,) = of_kind(DOCS, "Service").values()
    assert service["spec"]["selector"].items() <= labels("baton-router").items()
    assert port("baton-router", service["spec"]["ports"][0]["targetPort"])
    account = DEPLOYMENTS["baton-router"]["spec"]["template"]["spec"]["serviceAccountName"]
    assert account in of_kind(DOCS, "ServiceAccount")
    (binding,) = of_kind(DOCS, "RoleBinding").values()
    assert {"kind": "ServiceAccount", "name": account}.items() <= binding["subjects"][0].items()
    rules = of_kind(DOCS, "Role")[binding["roleRef"]["name"]]["rules"]
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in rules)


def test_workers_scale_on_the_queue_depth_they_export():
    exported = {name for name, _, _ in _ENGINE_METRICS.values()}
    for autoscaler in of_kind(DOCS, "HorizontalPodAutoscaler").values():
        target = autoscaler["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in WORKERS
        (metric,) = autoscaler["spec"]["metrics"]
        # prometheus-adapter's rule renames baton:X to baton_X (autoscaling.yaml)
        assert metric["pods"]["metric"]["name"].replace("baton_", "baton:", 1) in exported
