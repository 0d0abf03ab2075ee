"""HTTP disaggregated stacks (prefill worker + decode worker behind `baton router`) answer
/v1/completions with the colocated engine's text for the round-4 state kinds: Kimi Linear (KDA
slots + MLA latent pages) and LFM3 (short-conv slots, sliding-window attention beside full
attention: two page tables, the sliding pages released behind the window, the sliding pools
moved inside the full ones), with a prompt longer than the window. (MiniMax's lightning slots,
Bailing's and RecurrentGemma's kinds are the same handover code; their in-process pairs are in
test_kimi_serving.py and test_window_serving.py. Two stacks, not five: each stack's three
processes cost ~10 s of the suite in imports.)"""

from __future__ import annotations

import pytest

from tests.server_process import BATON, free_port, launch, launch_router, wait_ready
from tests.test_family_serve import FLAGS, expected_and_served

STACKS = [
    ("kimi_models", "kimi_moe"),
    ("window_models", "lfm3_mixed"),
]


@pytest.fixture(scope="module")
def stacks(request, tmp_path_factory):
    """name -> (model_dir, the router of its stack); every process starts at once (their
    imports overlap on 2 cores)."""
    logs = tmp_path_factory.mktemp("new-mixers-serve-logs")
    workers, started, dirs = {}, [], {}
    try:
        for fixture, name in STACKS:
            dirs[name], _ = request.getfixturevalue(fixture)(name)
            for mode in ("prefill", "decode"):
                port = free_port()
                command = [str(BATON), "serve", "--model", str(dirs[name]), "--port", str(port)]
                command += [*FLAGS, "--disaggregation-mode", mode, "--disagg-timeout", "60"]
                workers[name, mode] = launch(command, port, logs / f"{name}-{mode}.log", None)
                started.append(workers[name, mode])
        routers = {
            name: launch_router(
                logs, [workers[name, "prefill"].base_url], [workers[name, "decode"].base_url]
            )
            for _, name in STACKS
        }
        started += routers.values()
        for part in started:
            wait_ready(part)
        yield {name: (dirs[name], routers[name]) for name in routers}
    finally:
        for part in reversed(started):
            part.stop()


@pytest.mark.parametrize("name", [name for _, name in STACKS])
def test_disaggregated_http_stack_matches_colocated(stacks, name):
    model_dir, router = stacks[name]
    expected, got = expected_and_served(router.base_url, model_dir)
    assert got == expected
