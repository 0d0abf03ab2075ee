"""The transformers config defaults kept per machine (engine/config_defaults.py) and the engine's
tokenizer loaded at its first use (engine/core/tokenizer.py): an engine start on a warm cache
imports no transformers (issue 35's time to ready), and what the cache gives back is what the
config class says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from baton.engine import config_defaults
from baton.engine.config import ModelConfig
from baton.engine.config_defaults import class_defaults, rope_defaults
from baton.engine.core.tokenizer import LazyTokenizer
from baton.engine.models.registry import FAMILIES, family_named

ROOT = Path(__file__).parents[1]
ASSETS = ROOT / "assets"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty per-machine cache, read afresh (no answer remembered in this process)."""
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    config_defaults.config_defaults.cache_clear()
    yield tmp_path / config_defaults.FILE_NAME
    config_defaults.config_defaults.cache_clear()


def _class(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_kept_defaults_are_the_config_classs_own(architecture, cache):
    path = family_named(architecture).module.HF_CONFIG_CLASS_PATH
    expected = (class_defaults(_class(path)), rope_defaults(_class(path)))
    assert config_defaults.config_defaults(path) == expected  # read from the class, kept
    assert cache.is_file()
    config_defaults.config_defaults.cache_clear()
    kept = config_defaults.config_defaults(path)  # read from the file
    assert kept == expected
    # tuples stay tuples (time_step_limit): a ConfigReader compares them as the class would
    assert all(type(kept[0][k]) is type(v) for k, v in expected[0].items())


def test_a_class_outside_an_installed_package_is_read_every_time(cache):
    defaults, _ = config_defaults.config_defaults("tests.toy_family.ToyHFConfig")
    assert defaults == class_defaults(_class("tests.toy_family.ToyHFConfig"))
    assert not cache.exists()


def test_an_unreadable_or_foreign_file_is_read_from_the_class_and_rewritten(cache):
    path = family_named("NemotronHForCausalLM").module.HF_CONFIG_CLASS_PATH
    expected = (class_defaults(_class(path)), rope_defaults(_class(path)))
    config_defaults.config_defaults(path)
    key = next(iter(json.loads(cache.read_text())))
    for content in ("{not json", json.dumps({key: {"defaults": {}}}), "[1, 2]"):
        cache.write_text(content)
        config_defaults.config_defaults.cache_clear()
        assert config_defaults.config_defaults(path) == expected
        assert key in json.loads(cache.read_text())


def test_an_engine_start_on_a_warm_cache_imports_no_transformers(tmp_path):
    """The config's defaults come from the cache and the tokenizer waits for its first use:
    transformers (seconds of imports) stays out of the engine process until it is needed."""
    code = textwrap.dedent(
        f"""
        import sys
        from baton.engine.core.engine import Engine
        engine = Engine({str(ASSETS)!r}, max_total_tokens=64, max_running_requests=2)
        assert "transformers" not in sys.modules, "transformers imported"
        assert engine.lazy_tokenizer.get() is not None and "transformers" in sys.modules
        """
    )
    env = dict(os.environ, BATON_CACHE_DIR=str(tmp_path), BATON_CPU_GEMM="onednn")
    run = [sys.executable, "-c", "from baton.engine.config import ModelConfig; "
           f"ModelConfig.from_hf({str(ASSETS)!r})"]  # fmt: skip
    assert subprocess.run(run, env=env, cwd=ROOT, timeout=300).returncode == 0  # warms it
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_model_config_read_from_the_cache_equals_one_read_from_the_class(cache):
    from_class = ModelConfig.from_hf(ASSETS)
    config_defaults.config_defaults.cache_clear()
    assert cache.is_file() and ModelConfig.from_hf(ASSETS) == from_class


def test_a_folder_without_tokenizer_files_has_no_tokenizer(tmp_path):
    tokenizer = LazyTokenizer(tmp_path)
    assert not tokenizer.available and tokenizer.get() is None


def test_the_tokenizer_is_loaded_once_at_its_first_use():
    from transformers import AutoTokenizer

    tokenizer = LazyTokenizer(ASSETS)
    first = tokenizer.get()
    assert tokenizer.get() is first
    assert first.encode("a pen") == AutoTokenizer.from_pretrained(ASSETS).encode("a pen")
