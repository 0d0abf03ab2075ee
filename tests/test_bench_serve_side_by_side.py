"""baton.bench.serving.serve_side_by_side gives every server the same limits and the PD pair its flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton.bench.serving.serve_side_by_side import (
    LIMITS,
    llama_command,
    matmul_dtype_choices,
    server_commands,
)


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


def test_llama_server_gets_a_slot_per_running_request_and_its_caches_off():
    command = llama_command("/bin/llama-server", "/m.gguf", 9000, context=12288)
    assert command[:3] == ["/bin/llama-server", "-m", "/m.gguf"]
    assert command[command.index("--parallel") + 1] == str(LIMITS["max_running_requests"])
    assert command[command.index("-c") + 1] == "12288"
    assert command[command.index("--cache-ram") + 1] == "0"
    assert {"--no-cache-prompt", "--cont-batching", "--metrics"} <= set(command)


HELPER = """
import subprocess, sys
from pathlib import Path
from baton.bench.serving.serve_side_by_side import share_autogroup_nice
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
import baton.bench.serving.serve_side_by_side as sbs
started = []
def start(command, port, log, timeout_s, env=None):
    log.touch()
    started.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
    print(started[-1].pid, flush=True)
    return started[-1]
def run_rate(port, model, prompts, rate, max_concurrency):
    os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` does mid-run
    raise AssertionError("SIGTERM did not interrupt the run")
sbs.start, sbs.run_rate = start, run_rate
sbs.save_model = sbs.save_word_tokenizer = sbs.check_vllm_cpu = lambda *args: None
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


def test_each_baton_servers_matmul_dtype_choices_are_read_from_its_log(tmp_path):
    log = tmp_path / "baton.log"
    log.write_text(
        "2026-12-01 baton.engine.runtime.process INFO loading\n"
        "2026-12-01 baton.engine.layers.cpu_backend INFO CPU matmul dtype (BATON_CPU_MATMUL_DTYPE=auto)"
        " auto: 768x2048: bfloat16 (0.71 ms bfloat16 / 1.56 ms float32)\n"
    )
    assert matmul_dtype_choices(log) == [
        "(BATON_CPU_MATMUL_DTYPE=auto) auto: 768x2048: bfloat16 (0.71 ms bfloat16 / 1.56 ms float32)"
    ]


MATMUL_HELPER = """
import os, subprocess, sys
import baton.bench.serving.serve_side_by_side as sbs
def start(command, port, log, timeout_s, env=None):
    kind = "vllm" if command[0] == "bash" else "baton"
    print(kind, (env or os.environ).get("BATON_CPU_MATMUL_DTYPE", "unset"), flush=True)
    log.write_text("")
    return subprocess.Popen(["sleep", "30"], start_new_session=True)
sbs.start = start
sbs.run_rate = lambda port, model, prompts, rate, max_concurrency: {"output_throughput": 1.0, "mean_ttft_ms": 1.0,
    "p99_ttft_ms": 1.0, "mean_itl_ms": 1.0, "failed": 0, "engine": {}, "requests": []}
sbs.save_model = sbs.save_word_tokenizer = sbs.check_vllm_cpu = lambda *args: None
sys.argv = ["serve_side_by_side", "--servers", "baton,vllm", "--peer-vllm", "/none", "--rates", "1",
    "--matmul-dtype", "model"]
sbs.main()
"""


def test_matmul_dtype_pins_baton_engines_only():
    helper = subprocess.run(
        [sys.executable, "-c", MATMUL_HELPER],
        env={k: v for k, v in os.environ.items() if k != "BATON_CPU_MATMUL_DTYPE"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert helper.returncode == 0, helper.stderr
    started = [line for line in helper.stdout.splitlines() if line.split()[0] in ("baton", "vllm")]
    assert started[0] == "baton model" and "vllm unset" in started
