"""What `baton serve` pays before it answers, and what it no longer pays (issue 35): the server
process runs without torch, the engine pays the first forward's one-time costs (C kernel builds)
before it reports ready and leaves no trace of it, and a model is built without random fills."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import zmq

import baton.engine.runtime.process
import baton.kernels.cpu.ops
from baton.engine.checkpoint.loader import load_model
from baton.engine.core.engine import Engine
from baton.engine.runtime.ipc import EngineProcessSpec, EngineReady, decode
from baton.kernels.cpu import extension
from tests.fake_engine import FakeEngine

ASSETS = Path(__file__).parents[1] / "assets"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[1],
    )


def test_engine_modules_the_server_uses_import_no_torch():
    result = _run(
        """
        import sys
        import baton, baton.engine.core.sampling_params, baton.engine.core.detokenizer, baton.engine.runtime.ipc
        import baton.engine.config, baton.engine.structured_output, baton.engine.models.registry
        assert "torch" not in sys.modules, "torch imported"
        baton.LLM  # the offline API is still one attribute away
        assert "torch" in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr


def test_the_server_process_builds_and_tokenizes_without_torch():
    """`baton` marks torch absent (engine/runtime/torch_import.py): every module a worker or the
    router imports, and the tokenizer, must work that way (an import of torch would fail)."""
    result = _run(
        f"""
        import sys
        from baton.engine.runtime.torch_import import defer_torch
        defer_torch()
        from baton.server.cli import build_parser
        build_parser()
        import baton.server.launch, baton.server.app, baton.server.router.app, baton.server.up
        from baton.server.launch import check_model_config, prepare_http_side
        from baton.server.args import ServerArgs
        check_model_config({str(ASSETS)!r})
        tokenizer = prepare_http_side(ServerArgs(model={str(ASSETS)!r}))
        assert tokenizer.encode("Question: 12 + 3") and sys.modules["torch"] is None
        """
    )
    assert result.returncode == 0, result.stderr


def test_a_structured_output_spec_brings_xgrammar_into_a_torch_free_server():
    result = _run(
        """
        import sys
        from baton.engine.runtime.torch_import import defer_torch
        defer_torch()
        from baton.engine.core.sampling_params import StructuredOutputs
        from baton.engine.structured_output import check_structured_outputs
        check_structured_outputs(StructuredOutputs(kind="regex", spec="[0-9]+", after_token_ids=()))
        assert sys.modules["torch"] is not None and "xgrammar" in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_building_a_model_draws_no_random_numbers(base_model, dtype, tmp_path, monkeypatch):
    """Layers' random init (nn.Linear's kaiming_uniform_) is skipped: load_into overwrites it;
    the matmul timings at load (kernels/linear.py: a bf16 model times its dtypes, small weights
    their decode rows) draw their operands from their own generator."""
    model_dir, _ = base_model
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))  # no kept timings: every shape times
    before = torch.random.get_rng_state()
    load_model(model_dir, dtype, "cpu")
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.fixture
def kernel_builds(monkeypatch):
    """The kernel modules that asked for the C kernels from now on (given none: the torch paths
    run)."""
    asked: list[str] = []
    modules = _kernel_modules()
    for module in modules:
        name = module.__name__.rsplit(".", 1)[1]
        monkeypatch.setattr(module, "cpu_library", lambda name=name: asked.append(name))
        module.library.cache_clear()
    yield asked
    for module in modules:
        module.library.cache_clear()  # the real libraries again for the tests after this one


def _kernel_modules():
    import baton.kernels.cpu.gated_delta
    import baton.kernels.cpu.gemm
    import baton.kernels.cpu.mamba1
    import baton.kernels.cpu.moe
    import baton.kernels.cpu.prefill
    import baton.kernels.cpu.quant
    import baton.kernels.cpu.verify

    cpu = baton.kernels.cpu
    return [
        cpu.ops,
        cpu.prefill,
        cpu.gemm,
        cpu.moe,
        cpu.quant,
        cpu.verify,
        cpu.gated_delta,
        cpu.mamba1,
    ]


def test_warm_up_builds_the_kernels_a_first_request_would(base_model, kernel_builds):
    model_dir, _ = base_model
    engine = Engine(model_dir, page_size=4)
    loaded = set(kernel_builds)
    engine.warm_up()
    # The engine asks for the decode kernels when it decides whether its CPU step can be
    # captured (a step whose attention reads a mask is not); the warm-up asks for the rest.
    assert "ops" in loaded and "prefill" in set(kernel_builds) - loaded


def test_warm_up_leaves_no_trace_in_pools_counters_or_the_prefix_cache(base_model):
    model_dir, _ = base_model
    engine = Engine(model_dir, page_size=4, max_total_tokens=256)
    before = engine.stats()
    engine.warm_up()
    assert engine.stats() == before
    assert engine.pages.used == 0 and engine.slots.used == 0
    assert len(engine.prefix_cache.blocks) == 0 and not engine.requests


def test_the_engine_process_warms_up_before_it_reports_ready(tiny_models, monkeypatch):
    model_dir, _ = tiny_models("base")
    order: list[str] = []

    class Recording(FakeEngine):
        def warm_up(self) -> None:
            order.append("warm-up")

        def close(self) -> None:
            pass

    monkeypatch.setattr(baton.engine.runtime.process, "Engine", Recording)
    spec = EngineProcessSpec(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        engine_args={},
        input_addr="inproc://unused-in",
        output_addr="inproc://unused-out",
        max_message_bytes=1 << 20,
        parent_pid=-1,  # not our parent: the loop exits at once
        pair=None,
    )
    context = zmq.Context()
    inbox, outbox, server = (context.socket(t) for t in (zmq.PULL, zmq.PUSH, zmq.PULL))
    server.bind("inproc://warm-up-order")
    outbox.connect("inproc://warm-up-order")
    try:
        assert baton.engine.runtime.process._load_and_run(spec, inbox, outbox) == 0
        assert order == ["warm-up"] and isinstance(decode(server.recv()), EngineReady)
    finally:
        for socket in (inbox, outbox, server):
            socket.close(linger=0)
        context.term()


@pytest.mark.skipif(
    baton.kernels.cpu.ops.library() is None, reason="no C compiler, or BATON_CPU_OPS=0"
)
def test_make_install_builds_every_kernel_and_reports_a_failed_one(tmp_path, monkeypatch):
    """One extension holds every kernel: a source that does not compile fails the build with
    the compiler's words naming it (the engine then runs the torch paths); good sources build
    once and are found again in the cache."""
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    good, bad = tmp_path / "good.c", tmp_path / "bad.c"
    good.write_text("int baton_answer(void) { return 42; }\n")
    bad.write_text("int baton_broken(void) { this is not C }\n")
    with pytest.raises(RuntimeError, match="bad.c"):
        extension.build([good, bad], namespace="baton_install_test")
    first = extension.build([good], namespace="baton_install_test")
    assert extension.build([good], namespace="baton_install_test") == first
    assert len(list((tmp_path / "cache").glob("*/*.so"))) == 1
