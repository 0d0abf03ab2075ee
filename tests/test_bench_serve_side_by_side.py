"""bench.serve_side_by_side gives every server the same limits and the PD pair its flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve_side_by_side import LIMITS, server_commands


def test_every_server_gets_the_same_limits_and_no_prefix_cache():
    commands = {
        kind: server_commands(kind, "/m", "bfloat16", 9000, "/tmp/vcpu")
        for kind in ("baton", "baton-pd", "vllm")
    }
    for kind in ("baton", "baton-pd"):
        command = commands[kind]
        assert "--no-prefix-cache" in command
        for name, value in LIMITS.items():
            assert f"--{name.replace('_', '-')}={value}" in command, (kind, name)
    # baton up forwards worker flags after `--`: the limits must follow it to reach the engines
    pd = commands["baton-pd"]
    assert pd.index("--") < pd.index("--no-prefix-cache")
    vllm = commands["vllm"]
    assert "--no-enable-prefix-caching" in vllm
    assert vllm[vllm.index("--max-num-seqs") + 1] == str(LIMITS["max_running_requests"])
    assert vllm[vllm.index("--max-num-batched-tokens") + 1] == str(LIMITS["max_num_batched_tokens"])


HELPER = """
import subprocess, sys
from pathlib import Path
from bench.serve_side_by_side import share_autogroup_nice
Path("/proc/self/autogroup").write_text("7")  # raising one's own nice needs no privilege
server = subprocess.Popen(["sleep", "30"], start_new_session=True)
try:
    share_autogroup_nice(server.pid)
    print(Path(f"/proc/{server.pid}/autogroup").read_text().split("nice")[-1].strip())
finally:
    server.kill()
    server.wait()
"""


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="no Linux autogroups")
def test_a_server_in_its_own_session_gets_the_benchmarks_scheduling_priority():
    """Started with start_new_session (so stop() can signal its group), a server lands in a new
    autogroup at nice 0: a boosted benchmark would boost only its own load generator."""
    helper = subprocess.run(
        [sys.executable, "-c", HELPER],
        start_new_session=True,  # the helper's nice 7 must not touch the test's own autogroup
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert helper.returncode == 0, helper.stderr
    assert helper.stdout.strip() == "7"


SIGTERM_HELPER = """
import os, signal, subprocess, sys
import bench.serve_side_by_side as sbs
started = []
def start(command, port, log, timeout_s):
    started.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
    print(started[-1].pid, flush=True)
    return started[-1]
def run_rate(port, model, prompts, rate):
    os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` does mid-run
    raise AssertionError("SIGTERM did not interrupt the run")
sbs.start, sbs.run_rate = start, run_rate
sbs.save_model = sbs.save_word_tokenizer = lambda *args: None
sys.argv = ["serve_side_by_side", "--servers", "baton", "--rates", "1"]
sbs.main()
"""


def test_sigterm_stops_the_server_the_benchmark_started():
    helper = subprocess.run(
        [sys.executable, "-c", SIGTERM_HELPER],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert helper.returncode == 128 + 15, helper.stderr
    server_pid = int(helper.stdout.split()[0])
    assert (
        not Path(f"/proc/{server_pid}").exists()
        or "Z" in Path(f"/proc/{server_pid}/stat").read_text().split()[2]
    ), "the benchmark's server outlived SIGTERM"
