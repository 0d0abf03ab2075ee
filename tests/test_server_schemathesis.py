"""A short schemathesis run over /openapi.json: whatever it sends, the server never answers 5xx."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_process import start_server, tiny_model

pytest.importorskip("schemathesis")
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A short context keeps every generated request cheap: the run stays well under a minute.
    server = start_server(
        tiny_model(tmp_path_factory), tmp_path_factory.mktemp("logs"), "--max-model-len", "48"
    )
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def test_schemathesis_finds_no_server_error(server, tmp_path):
    run = subprocess.run(
        [
            str(SCHEMATHESIS), "run", f"{server.base_url}/openapi.json",
            "--checks", "not_a_server_error",
            "--phases", "examples,fuzzing",
            "--max-examples", "30",
            "--seed", "7",
            "--request-timeout", "20",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,  # it keeps a .schemathesis/ cache in its working directory
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-5000:]
    assert re.search(r"\d+ generated, \d+ passed", run.stdout), run.stdout[-2000:]
    statuses = re.findall(r'" (\d{3}) ', server.log())
    assert statuses and not [status for status in statuses if status.startswith("5")]
