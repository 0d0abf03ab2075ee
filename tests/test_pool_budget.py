"""The pools are sized from the model's state spec and the context budget (engine/cache/memory.py
budget_pools), CPU pools take memory as they are written, loading gives back what it freed, and a
loaded model holds each weight once."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from baton.engine.cache.memory import budget_pools
from baton.engine.cache.pools import StateCache
from baton.engine.checkpoint.loader import held_bytes, load_model
from baton.engine.config import ModelConfig
from baton.engine.core.engine import Engine
from baton.engine.models.registry import model_state_spec
from baton.kernels.linear import SMALL_WEIGHT, PackedLinear
from baton.server.args import ServerArgs

MiB = 1 << 20


def _budget(**overrides):
    sizes = dict(
        token_bytes=1000,
        slot_bytes=100_000,
        memory_bytes=1 << 40,
        max_running_requests=8,
        max_model_len=512,
        prefix_cache=False,
        max_total_tokens=None,
        max_mamba_slots=None,
        slots_per_request=1,
        page_tables=1,
    )
    return budget_pools(**(sizes | overrides))


def test_every_running_request_at_full_length_gets_pages_and_a_slot():
    budget = _budget()
    assert (budget.tokens, budget.slots) == (8 * 512, 8)


def test_a_prefix_cache_gets_as_many_pages_again():
    assert _budget(prefix_cache=True).tokens == 2 * 8 * 512


def test_memory_bounds_tokens_after_the_slots():
    budget = _budget(memory_bytes=8 * 100_000 + 1000 * 1000)
    assert (budget.tokens, budget.slots) == (1000, 8)


def test_slots_take_at_most_half_of_the_memory():
    budget = _budget(memory_bytes=400_000, token_bytes=100)
    assert budget.slots == 2 and budget.tokens == 2000


def test_explicit_sizes_win():
    budget = _budget(memory_bytes=1000, max_total_tokens=777, max_mamba_slots=5)
    assert (budget.tokens, budget.slots) == (777, 5)


def test_a_model_without_paged_state_counts_its_context_budget():
    assert _budget(token_bytes=0, memory_bytes=1).tokens == 8 * 512


def test_the_110m_model_at_llama_cpps_budget_reserves_what_its_spec_says(tiny_models):
    """32 requests over 16k tokens, the comparison of issue 35: pools of the spec's bytes."""
    from baton.bench.workloads import CONFIGS

    shape = CONFIGS["110m"]
    spec = model_state_spec(_nemotron_config(shape), torch.float32)
    budget = budget_pools(
        token_bytes=spec.bytes_per_token(),
        slot_bytes=spec.bytes_per_slot(),
        memory_bytes=4 << 30,
        max_running_requests=32,
        max_model_len=512,
        prefix_cache=False,
        max_total_tokens=None,
        max_mamba_slots=None,
        slots_per_request=1,
        page_tables=1,
    )
    assert (budget.tokens, budget.slots) == (16384, 32)
    # 2 attention layers x K and V x 2 KV heads x 128 x fp32; 7 Mamba layers of conv + SSM
    assert spec.bytes_per_token() == 2 * 2 * 2 * 128 * 4
    assert spec.bytes_per_slot() == 7 * (3 * (24 * 64 + 2 * 8 * 128) + 24 * 64 * 128) * 4


def _nemotron_config(shape: dict) -> ModelConfig:
    """The config.json transformers writes for these shapes (baton.bench.workloads.save_model's)."""
    import transformers

    raw = transformers.NemotronHConfig(max_position_embeddings=8192, **shape).to_dict()
    return ModelConfig.from_dict(raw | {"architectures": ["NemotronHForCausalLM"]})


def test_engine_pools_follow_the_context_budget(base_model):
    model_dir, _ = base_model
    args = dict(page_size=4, max_running_requests=3, max_model_len=64)
    engine = Engine(model_dir, enable_prefix_caching=False, **args)
    assert (engine.pages.capacity * 4, engine.slots.capacity) == (3 * 64, 3)
    assert Engine(model_dir, **args).pages.capacity * 4 == 2 * 3 * 64


def test_kv_cache_memory_bytes_bounds_the_pools(base_model):
    model_dir, _ = base_model
    spec = model_state_spec(ModelConfig.from_hf(model_dir), torch.float32)
    slot, token = spec.bytes_per_slot(), spec.bytes_per_token()
    memory = 6 * slot + 400 * token
    engine = Engine(model_dir, page_size=4, kv_cache_memory_bytes=memory)
    slots, tokens = engine.slots.capacity, engine.pages.capacity * 4
    assert slots == memory // 2 // slot < 128  # half the memory, not one slot per request
    assert tokens == (memory - slots * slot) // token // 4 * 4  # the rest, in whole pages
    server = ServerArgs(model=str(model_dir), kv_cache_memory_bytes=memory)
    assert server.engine_args()["kv_cache_memory_bytes"] == memory


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_pools_take_memory_only_where_written(base_model):
    spec = model_state_spec(ModelConfig.from_hf(base_model[0]), torch.float32)
    before = _rss_mib()
    pages = 256 * MiB // (spec.bytes_per_token() * 16)
    cache = StateCache(spec, num_pages=pages, page_size=16, num_slots=8, device="cpu")
    assert cache.nbytes() >= 256 * MiB
    assert _rss_mib() - before < 32
    assert all(not pool.any() for pool in cache.pools.values())  # zero, as torch.zeros
    cache.reset_slot(3)
    name = cache.slotted[0]
    cache.pools[name][:, 5].fill_(1.0)
    assert cache.pools[name][:, 5].eq(1).all() and not cache.pools[name][:, 4].any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, glibc")
def test_memory_freed_while_loading_goes_back_to_the_system():
    """With freed blocks kept in the heap for the step loop, what loading freed (the plain
    weights packing replaced) stayed resident until release_freed_memory."""
    code = """
        import torch
        from baton.engine.runtime.cpu_allocator import keep_freed_memory_in_heap, release_freed_memory
        def rss():
            with open("/proc/self/status") as status:
                return next(int(l.split()[1]) for l in status if l.startswith("VmRSS")) // 1024
        keep_freed_memory_in_heap()
        blocks = [torch.ones(256 * 1024) for _ in range(128)]  # 128 MiB in 1 MiB blocks
        del blocks
        kept = rss()
        assert release_freed_memory()
        print(kept - rss())
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) > 64


def _checkpoint_bytes(model_dir, dtype: torch.dtype) -> int:
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(path, "pt") as checkpoint:
            for name in checkpoint.keys():
                total += math.prod(checkpoint.get_slice(name).get_shape()) * dtype.itemsize
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loaded_model_holds_each_weight_once(base_model, dtype, monkeypatch):
    """After packing for the CPU the model holds its checkpoint's bytes, counted over every
    storage it keeps (oneDNN's opaque packed weights included): no plain copy beside a packed
    one, except the decode-rows copies of small weights (at most SMALL_WEIGHT elements each, kept
    where the chooser timed F.linear faster: kernels/linear.py). The rest is the GEMM's 16-row
    block padding and small float32 forms for C kernels."""
    monkeypatch.setenv("BATON_CPU_MATMUL_DTYPE", "model")  # "float32" would widen, not copy
    model = load_model(base_model[0], dtype, "cpu")
    checkpoint = _checkpoint_bytes(base_model[0], dtype)
    copies = [m for m in model.modules() if isinstance(m, PackedLinear) and m.plain is not None]
    assert all(m.in_features * m.out_features <= SMALL_WEIGHT for m in copies)
    plain = sum(m.plain.numel() * m.plain.element_size() for m in copies)
    assert checkpoint <= held_bytes(model) - plain < 1.05 * checkpoint
