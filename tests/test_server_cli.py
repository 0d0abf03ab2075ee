"""`baton` command line: help for every flag, ServerArgs defaults, refusal of a bad --model."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from baton.engine.checkpoint.loader import resolve_dtype
from baton.server.args import ServerArgs
from baton.server.cli import build_parser, main
from tests.server_process import start_server
from tests.tiny import load_json, save_tiny_model, save_tokenizer

BATON = Path(sys.executable).with_name("baton")
ASSETS = Path(__file__).parents[1] / "assets"
SERVE_FLAGS = [
    "--model", "--host", "--port", "--served-model-name", "--dtype", "--device", "--max-model-len",
    "--max-num-batched-tokens", "--chunked-prefill-size", "--max-running-requests",
    "--max-queued-requests", "--max-total-tokens", "--max-mamba-slots", "--api-key",
    "--max-request-bytes", "--tokenizer",
]  # fmt: skip


def test_baton_help_lists_serve():
    result = subprocess.run([str(BATON), "--help"], capture_output=True, text=True, check=True)
    assert "serve" in result.stdout and "OpenAI-compatible" in result.stdout


def test_serve_help_explains_every_flag():
    result = subprocess.run(
        [str(BATON), "serve", "--help"], capture_output=True, text=True, check=True
    )
    for flag in SERVE_FLAGS:
        line = next(
            (line for line in result.stdout.splitlines() if line.strip().startswith(flag)), None
        )
        assert line is not None, f"{flag} missing from `baton serve --help`"
    assert "(default: 127.0.0.1)" in result.stdout and "(default: 8000)" in result.stdout
    assert f"(default: {8 * 1024 * 1024})" in result.stdout  # --max-request-bytes


def test_parsed_flags_become_server_args_with_engine_args(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    namespace = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(tmp_path),
            "--max-model-len",
            "512",
            "--max-queued-requests",
            "3",
            "--api-key",
            "k",
        ]
    )
    assert namespace.max_model_len == 512 and namespace.api_key == "k"
    args = ServerArgs(model=str(tmp_path), max_model_len=512, max_queued_requests=3)
    # unset sizes are left to the engine; the schedule is always passed (the server's flag)
    assert args.engine_args() == {"max_model_len": 512, "schedule_policy": "mixed"}
    assert args.model_name == str(tmp_path)
    assert ServerArgs(model=str(tmp_path), served_model_name="tiny").model_name == "tiny"


def test_serve_refuses_a_directory_without_a_model(tmp_path):
    result = subprocess.run(
        [str(BATON), "serve", "--model", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "config.json" in result.stderr and str(tmp_path) in result.stderr


def test_negative_sizes_are_refused_by_the_parser():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--max-model-len", "-5"])


def test_serve_exits_1_and_says_why_when_the_engine_cannot_load(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "nemotron_h"}')
    shutil.copy(ASSETS / "tokenizer.json", tmp_path)
    shutil.copy(ASSETS / "tokenizer_config.json", tmp_path)
    result = subprocess.run(
        [str(BATON), "serve", "--model", str(tmp_path), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert f"failed to load model {tmp_path}" in result.stderr


def _serve_fails(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BATON), "serve", *args, "--port", "1"], capture_output=True, text=True, timeout=120
    )


def test_serve_names_a_model_directory_without_a_tokenizer(tmp_path):
    """Not transformers' advice to install sentencepiece after the engine has loaded."""
    save_tiny_model(tmp_path, tokenizer=False)
    result = _serve_fails("--model", str(tmp_path))
    assert result.returncode == 1
    assert f"--model {tmp_path}: no tokenizer there" in result.stderr
    assert "--tokenizer DIR" in result.stderr and "Traceback" not in result.stderr


def test_serve_names_a_tokenizer_that_cannot_load(tmp_path):
    model, broken = tmp_path / "model", tmp_path / "broken"
    save_tiny_model(model, tokenizer=False)
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    result = _serve_fails("--model", str(model), "--tokenizer", str(broken))
    assert result.returncode == 1
    assert f"--tokenizer {broken}: cannot load its tokenizer" in result.stderr
    assert "Traceback" not in result.stderr
    missing = _serve_fails("--model", str(model), "--tokenizer", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "not a directory" in missing.stderr


def test_serve_takes_the_tokenizer_from_another_directory(tmp_path):
    """--tokenizer (vLLM's flag): a model directory with weights only is served, its text made
    by the given tokenizer."""
    model, elsewhere = tmp_path / "model", tmp_path / "tokenizer"
    save_tiny_model(model, tokenizer=False)
    save_tokenizer(elsewhere, load_json(model / "config.json")["vocab_size"])
    server = start_server(model, tmp_path, "--tokenizer", str(elsewhere), "--max-model-len", "256")
    try:
        tokens = server.http().post("/tokenize", json={"prompt": "The pens cost"}).json()
        expected = AutoTokenizer.from_pretrained(str(elsewhere)).encode("The pens cost")
        assert tokens["tokens"] == expected
        completion = server.client().completions.create(
            model=str(model), prompt="The pens cost", max_tokens=4, temperature=0
        )
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage.prompt_tokens == len(expected)
    finally:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.mark.parametrize(
    ("given", "checkpoint", "expected"),
    [
        ("auto", "bfloat16", torch.bfloat16),
        ("auto", "float32", torch.float32),
        ("half", "bfloat16", torch.float16),
        ("float", "bfloat16", torch.float32),
        ("bfloat16", "float32", torch.bfloat16),
    ],
)
def test_dtype_takes_vllms_spellings_and_auto_reads_the_checkpoint(given, checkpoint, expected):
    namespace = build_parser().parse_args(["serve", "--model", "m", "--dtype", given])
    config = SimpleNamespace(torch_dtype=checkpoint)
    assert resolve_dtype(namespace.dtype, config) == expected
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16, float, half"):
        resolve_dtype("fp8", config)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--dtype", "fp8"])


def test_serve_takes_vllm_and_sglang_spellings(tmp_path, monkeypatch):
    """`baton serve DIR` (vLLM's positional model), --model-path, --max-num-seqs, --tp-size,
    --no-enable-prefix-caching / --disable-radix-cache: the same ServerArgs as baton's own flags."""
    (tmp_path / "config.json").write_text("{}")
    started = []
    monkeypatch.setattr("baton.server.launch.run", started.append)
    ours = ["--model", str(tmp_path), "--max-running-requests", "4", "--tp", "1"]
    assert main(["serve", *ours, "--no-prefix-cache"]) == 0
    theirs = [
        ["serve", str(tmp_path), "--max-num-seqs", "4", "--tp-size", "1", "--no-enable-prefix-caching"],
        ["serve", "--model-path", str(tmp_path), "--max-num-seqs", "4", "--tp", "1", "--disable-radix-cache"],
        ["serve", str(tmp_path), "--model", str(tmp_path), "--max-num-seqs", "4", "--tp", "1", "--no-prefix-cache"],
    ]  # fmt: skip
    for argv in theirs:
        assert main(argv) == 0, argv
    assert len(started) == 4 and all(args == started[0] for args in started), started
    assert started[0].max_running_requests == 4 and started[0].no_prefix_cache


def test_serve_refuses_no_model_and_two_models(tmp_path, capsys):
    assert main(["serve"]) == 2
    assert "no model given: baton serve DIR (or --model DIR)" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--model", str(tmp_path / "other")]) == 2
    assert "two models given" in capsys.readouterr().err
