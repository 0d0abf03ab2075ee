"""`make gsm8k` as the README runs it (default settings: `baton up`, then `baton eval gsm8k` with 64
requests in flight on the 200 held-out questions): more than 50 concurrent requests through the real
router to a real prefill + decode pair. Before issue 22 the router's shared connection pool (100,
two per request) starved its own health probes above 50 requests in flight, both workers were
declared unhealthy and every request after that got 503."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_make_gsm8k_passes_with_64_in_flight_and_no_worker_marked_unhealthy():
    finished = subprocess.run(
        [sys.executable, "-m", "baton.bench.accuracy.run_gsm8k"],  # what `make gsm8k` runs
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    out = finished.stdout
    assert finished.returncode == 0, out[-3000:] + finished.stderr[-3000:]
    assert "Failed requests: 0" in out and "Retried requests: 0" in out, out
    (router,) = re.findall(r"^router: .*$", out, flags=re.M)
    assert "workers marked unhealthy: 0" in router, router
    # the router counts every answer: the 200 questions and the client's one /v1/models lookup
    assert re.search(r"\b201 x 200\b", router) and not re.search(r"x (4\d\d|5\d\d)", router), router
    accuracy = float(re.search(r"^Accuracy: ([\d.]+)$", out, flags=re.M).group(1))
    assert accuracy >= 0.8, out
