"""What a fresh install gives (issue 50): one import name, `baton`, beside Hugging Face's `kernels`
(a transformers dependency), the locked versions, and a non-editable install that serves.

Before this layout the repository root held `kernels/__init__.py`: any process started there
(pytest, `python -m ...`, the engine's child processes) imported baton's kernels as `kernels`,
and transformers' `from kernels import CUDAProperties` failed in every `from_pretrained`."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import httpx
import pytest

from tests.server_process import free_port, launch, wait_ready

ROOT = Path(__file__).parents[1]
TOP_NAMES = ("server", "engine", "kernels", "disagg", "bench")
README_PROMPT = (
    "Question: A pen costs $12. Anna buys 4 pens and pays with $60. How much change does she get?"
    "\nAnswer:"
)


def _clean_env() -> dict[str, str]:
    """The environment a user has: nothing of transformers' or baton's set, no PYTHONPATH."""
    drop = ("USE_HUB_KERNELS", "PYTHONPATH", "TRITON_INTERPRET")
    return {k: v for k, v in os.environ.items() if k not in drop}


IMPORT_CHECK = """
import importlib.util, sys, tempfile
from pathlib import Path

root = Path({root!r})
import kernels
here = Path(kernels.__file__).resolve()
assert "site-packages" in here.parts and not here.is_relative_to(root / "kernels"), here
from kernels import CUDAProperties  # what transformers 5.25 imports from its `kernels`
for name in {top_names!r}:
    spec = importlib.util.find_spec(name)
    # Not one of baton's folders as a package of its own: either absent, another distribution's,
    # or (where no distribution has the name) a bare namespace with no code of baton's run.
    assert spec is None or spec.origin is None or not Path(spec.origin).resolve().is_relative_to(root / name), (name, spec)

import baton.kernels.backend, baton.server.cli, baton.engine.config, baton.disagg.schema
assert Path(baton.kernels.backend.__file__).resolve().is_relative_to(root)
from baton import LLM, SamplingParams

import torch
from transformers import AutoModelForCausalLM, NemotronHConfig, NemotronHForCausalLM
config = NemotronHConfig(
    vocab_size=64, hidden_size=32, hybrid_override_pattern="M*-", num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, intermediate_size=48, mamba_num_heads=4,
    mamba_head_dim=8, ssm_state_size=8, n_groups=1, chunk_size=8,
)
torch.manual_seed(0)
with tempfile.TemporaryDirectory() as folder:
    NemotronHForCausalLM(config).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)  # transformers' defaults: hub kernels on
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
assert logits.shape == (1, 4, 64) and torch.isfinite(logits).all()
print("ok", kernels.__file__)
"""


@pytest.mark.parametrize("where", ["repository root", "elsewhere"])
def test_kernels_is_hugging_faces_and_baton_imports_under_its_own_name(where, tmp_path):
    """From the root (sys.path[0] is the root for `python -c`, `python -m` and pytest) and from
    another folder: `import kernels` is HF's, baton's folders are not packages of their own,
    baton's modules import under `baton`, and transformers' `from_pretrained` runs at its defaults."""
    cwd = ROOT if where == "repository root" else tmp_path
    code = IMPORT_CHECK.format(root=str(ROOT), top_names=TOP_NAMES)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env={**_clean_env(), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "site-packages" in result.stdout, result.stdout


def test_the_top_level_folders_are_not_packages_and_no_module_imports_them_by_their_own_names():
    for name in TOP_NAMES:
        assert not (ROOT / name / "__init__.py").exists(), (
            f"{name}/__init__.py shadows another {name}"
        )
        assert (ROOT / "baton" / name).resolve() == (ROOT / name).resolve()
    offenders = []
    for name in (*TOP_NAMES, "tests", "tools"):
        for path in (ROOT / name).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    heads = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    heads = [node.module.split(".")[0]]
                else:
                    continue
                offenders += [
                    f"{path.relative_to(ROOT)}:{node.lineno}" for h in heads if h in TOP_NAMES
                ]
    assert offenders == []


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_make_install_installs_the_locked_versions():
    """The install recipe goes through the lock, and this venv holds exactly its versions."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("$(STAMP): pyproject.toml $(LOCK)\n", 1)[1].split("\n\n", 1)[0]
    assert "LOCK := requirements.lock" in makefile
    pip_lines = [line for line in recipe.splitlines() if "pip install" in line]
    assert pip_lines and all("-c $(LOCK)" in line for line in pip_lines), pip_lines
    pins = _lock()
    for dependency in ("torch", "transformers", "kernels", "triton", "fastapi", "xgrammar", "pip"):
        assert dependency in pins, dependency
    wrong = {}
    for name, version in pins.items():
        installed = metadata.version(name)
        if installed.split("+")[0] != version:  # torch's local label (+cpu) is not pinned
            wrong[name] = (version, installed)
    assert wrong == {}, f"installed versions differ from requirements.lock: {wrong}"


def test_the_lock_writer_pins_what_the_venv_holds(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from write_lock import lock_lines
    finally:
        sys.path.remove(str(ROOT / "tools"))
    frozen = "pip==26.3\nsetuptools==84.2.1\ntorch==2.13.0+cpu\ntransformers==5.25.0\n"
    assert lock_lines(frozen) == ["pip==26.3", "torch==2.13.0", "transformers==5.25.0"]
    with pytest.raises(SystemExit, match="not a released version"):
        lock_lines("baton @ file:///somewhere\n")


@pytest.mark.slow
def test_a_non_editable_install_serves_the_readme_request(tmp_path):
    """`pip install .` into a fresh venv (its dependencies lent from this one by a .pth line, so
    nothing is downloaded but the build backend): `baton serve --model assets`, started outside
    the repository, answers the README's request from the installed copy."""
    source = tmp_path / "source"  # a copy: pip builds in the tree it is given (build/, egg-info)
    skip = shutil.ignore_patterns("__pycache__", "results", "*.egg-info", "build")
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "requirements.lock"):
        shutil.copy(ROOT / name, source / name)
    for name in ("baton", *TOP_NAMES):
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=skip)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = wheels.glob("baton-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    lent = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
    (site / "lent_dependencies.pth").write_text(lent + "\n")
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    where = subprocess.run(
        [str(python), "-c", "import baton.kernels.cpu.ops as m, baton; print(m.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert Path(where).is_relative_to(site), where
    assert (Path(where).parent / "ops.c").is_file()  # the C sources ship as package data

    port = free_port()
    command = [str(venv / "bin" / "baton"), "serve", "--model", str(ROOT / "assets")]
    server = launch(
        [*command, "--port", str(port)], port, tmp_path / "serve.log", None, env=_clean_env(),
        cwd=tmp_path,
    )  # fmt: skip
    try:
        wait_ready(server)
        (served,) = [m["id"] for m in httpx.get(f"{server.base_url}/v1/models").json()["data"]]
        body = {"model": served, "prompt": README_PROMPT, "max_tokens": 48, "temperature": 0,
                "stop": ["Question"]}  # fmt: skip
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["text"]
        assert "#### 12" in text, json.dumps(response.json())
    finally:
        assert server.stop() == 0, server.log()[-3000:]
