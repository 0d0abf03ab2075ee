"""An HTTP disaggregated stack (prefill worker + decode worker behind `baton router`) answers
/v1/completions with the colocated engine's text for a pure SSM (Mamba: state only, no pages),
LFM2 (short-conv windows + rotary attention pages) and Jamba (Mamba1 state + attention pages +
experts)."""

from __future__ import annotations

import pytest

from tests.server_process import BATON, free_port, launch, launch_router, wait_ready
from tests.test_family_serve import FLAGS, expected_and_served

NAMES = ["mamba_a", "lfm2_a", "jamba_moe"]


@pytest.fixture(scope="module")
def routers(ssm_models, tmp_path_factory):
    """name -> the router of its stack. The three stacks' nine processes start at once: one after
    another they spent ~25 s of the suite on 2 cores, mostly each process's imports in turn."""
    logs = tmp_path_factory.mktemp("ssm-serve-logs")
    workers, started = {}, []
    try:
        for name in NAMES:
            model_dir, _ = ssm_models(name)
            for mode in ("prefill", "decode"):
                port = free_port()
                command = [str(BATON), "serve", "--model", str(model_dir), "--port", str(port)]
                command += [*FLAGS, "--disaggregation-mode", mode, "--disagg-timeout", "60"]
                workers[name, mode] = launch(command, port, logs / f"{name}-{mode}.log", None)
                started.append(workers[name, mode])
        by_name = {
            name: launch_router(
                logs, [workers[name, "prefill"].base_url], [workers[name, "decode"].base_url]
            )
            for name in NAMES
        }
        started += by_name.values()
        for part in started:
            wait_ready(part)
        yield by_name
    finally:
        for part in reversed(started):
            part.stop()


@pytest.mark.parametrize("name", NAMES)
def test_disaggregated_http_stack_matches_colocated(ssm_models, routers, name):
    model_dir, _ = ssm_models(name)
    expected, got = expected_and_served(routers[name].base_url, model_dir)
    assert got == expected
