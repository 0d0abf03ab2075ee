"""An HTTP disaggregated stack (prefill worker + decode worker behind `baton router`) answers
/v1/completions with the colocated engine's text for a pure SSM (Mamba: state only, no pages),
LFM2 (short-conv windows + rotary attention pages) and Jamba (Mamba1 state + attention pages +
experts)."""

from __future__ import annotations

import pytest

from tests.server_process import start_router, start_server
from tests.test_family_serve import FLAGS, expected_and_served


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("ssm-serve-logs")


@pytest.mark.parametrize("name", ["mamba_a", "lfm2_a", "jamba_moe"])
def test_disaggregated_http_stack_matches_colocated(ssm_models, logs, name):
    model_dir, _ = ssm_models(name)
    disagg = ("--disagg-timeout", "60")
    prefill = start_server(model_dir, logs, *FLAGS, "--disaggregation-mode", "prefill", *disagg)
    decode = start_server(model_dir, logs, *FLAGS, "--disaggregation-mode", "decode", *disagg)
    router = start_router(logs, [prefill.base_url], [decode.base_url])
    try:
        expected, got = expected_and_served(router.base_url, model_dir)
        assert got == expected
    finally:
        for part in (router, decode, prefill):
            part.stop()
