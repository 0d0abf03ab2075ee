"""The container files cannot be built here; check what can be checked by reading them."""

from __future__ import annotations

from pathlib import Path

import yaml

from baton.server.cli import build_parser

DOCKER = Path(__file__).parents[1] / "docker"


def test_compose_services_run_commands_baton_accepts():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"prefill", "decode", "router"}
    parser = build_parser()
    modes = {}
    for name, service in services.items():
        namespace = parser.parse_args(service["command"])  # exits (SystemExit) on an unknown flag
        modes[name] = getattr(namespace, "disaggregation_mode", "router")
    assert modes == {"prefill": "prefill", "decode": "decode", "router": "router"}
    router = services["router"]["command"]
    assert "http://prefill:8000" in router and "http://decode:8000" in router


def test_dockerfile_installs_the_pinned_torch_and_the_console_script():
    text = (DOCKER / "Dockerfile").read_text()
    assert "torch==2.13.0" in text and 'ENTRYPOINT ["baton"]' in text
    for package in ("server", "engine", "kernels", "disagg"):
        assert f"COPY {package} ./{package}" in text


def test_compose_requires_a_disagg_secret_and_restarts_what_exits():
    """No fallback secret (`change-me` authenticated anyone); a worker that exits because its
    engine died is restarted by the policy."""
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    for name in ("prefill", "decode"):
        service = compose["services"][name]
        secret = service["environment"]["BATON_DISAGG_SECRET"]
        assert secret.startswith("${BATON_DISAGG_SECRET:?") and secret.endswith("}"), secret
        assert ":-" not in secret and "change-me" not in secret
    for service in compose["services"].values():
        assert service["restart"] == "unless-stopped"
