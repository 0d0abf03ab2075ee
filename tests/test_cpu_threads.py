"""Engine processes get their CPU thread count in their environment, before torch loads;
`baton serve --cpu-threads` sets it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from baton.engine.runtime.cpu_threads import available_cores, cores_per_engine, engine_environment
from tests.server_process import BATON, tiny_model


def test_no_setting_leaves_the_environment_alone():
    assert engine_environment({"A": "1"}, None) == {"A": "1"}


def test_threads_travel_in_the_environment():
    env = engine_environment({"PATH": "/bin"}, 1)
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}


def test_a_users_own_thread_count_wins():
    assert engine_environment({"OMP_NUM_THREADS": "3"}, 1)["OMP_NUM_THREADS"] == "3"


def test_each_engine_gets_an_equal_share_of_at_least_one_core():
    cores = available_cores()
    assert cores_per_engine(1) == cores
    assert cores_per_engine(2) == max(1, cores // 2)
    assert cores_per_engine(10 * cores) == 1


def test_zero_threads_is_refused():
    with pytest.raises(ValueError, match="--cpu-threads must be >= 1, got 0"):
        engine_environment({}, 0)


def test_baton_serve_refuses_zero_threads_by_name(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    done = subprocess.run(
        [str(BATON), "serve", "--model", str(model), "--cpu-threads", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--cpu-threads must be >= 1, got 0" in done.stderr


def test_torch_in_the_engine_environment_runs_that_many_threads():
    """What the engine process sees: torch sizes its pool from the environment we pass."""
    done = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=engine_environment({"PATH": "/usr/bin:/bin"}, 1),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.strip() == "1"
