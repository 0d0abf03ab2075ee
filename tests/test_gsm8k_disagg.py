"""The shipped model through router -> prefill -> decode (prefix caching on) on 200 held-out
questions: accuracy >= 0.8 and every output identical to a colocated server without the cache."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.gsm8k_data import HELDOUT_PATH
from tests.server_process import BATON, start_router, start_server

ASSETS = Path(__file__).parents[1] / "assets"


def run_eval(url: str, output: Path) -> dict:
    command = [
        str(BATON),
        "eval",
        "gsm8k",
        "--base-url",
        url,
        "--data",
        str(HELDOUT_PATH),
        "--num-questions",
        "200",
        "--parallel",
        "32",
        "--output",
        str(output),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return json.loads(output.read_text())


@pytest.mark.slow
def test_disaggregated_cached_run_scores_and_matches_colocated_uncached(tmp_path):
    prefill = start_server(ASSETS, tmp_path, "--disaggregation-mode", "prefill")
    decode = start_server(ASSETS, tmp_path, "--disaggregation-mode", "decode")
    router = start_router(tmp_path, [prefill.base_url], [decode.base_url])
    try:
        disaggregated = run_eval(router.base_url, tmp_path / "disagg.json")
    finally:
        for part in (router, decode, prefill):
            part.stop()
    colocated_server = start_server(ASSETS, tmp_path, "--no-prefix-cache")
    try:
        colocated = run_eval(colocated_server.base_url, tmp_path / "colocated.json")
    finally:
        colocated_server.stop()
    assert disaggregated["accuracy"] >= 0.8
    assert len(disaggregated["questions"]) == 200
    by_question = {q["question"]: q["output"] for q in colocated["questions"]}
    for q in disaggregated["questions"]:
        assert q["output"] == by_question[q["question"]], q["question"]
