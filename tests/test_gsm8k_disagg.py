"""The shipped model through router -> prefill -> decode (prefix caching on) on 200 held-out
questions: accuracy >= 0.8 and every output identical to a colocated server without the cache.

The track interval is 64 (the shortest the shipped model allows): the shared 5-shot prefix
(~325 tokens) then spans checkpointed blocks, so both workers really serve prompts from their
caches (at the default interval, 512, no prompt would ever reach a checkpoint)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from baton.bench.accuracy.gsm8k_data import HELDOUT_PATH
from tests.server_process import BATON, start_router, start_server
from tests.test_seed_regression import metric

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
    cache = ("--mamba-track-interval", "64")
    prefill = start_server(ASSETS, tmp_path, *cache, "--disaggregation-mode", "prefill")
    decode = start_server(ASSETS, tmp_path, *cache, "--disaggregation-mode", "decode")
    router = start_router(tmp_path, [prefill.base_url], [decode.base_url])
    try:
        disaggregated = run_eval(router.base_url, tmp_path / "disagg.json")
        # Every prompt after the first few shares the 5-shot prefix's blocks: the prefill worker
        # resumes from their checkpoints, the decode worker holds their pages (not re-sent).
        for worker in (prefill, decode):
            queried = metric(worker, "baton:prefix_cache_queries_total")
            assert metric(worker, "baton:prefix_cache_hits_total") > 0.5 * queried
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
