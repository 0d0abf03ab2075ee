"""The adapter slot table (engine/lora/slots.py) without a model: LRU over unpinned slots, pins
held by running requests, host copies bounded by max_cpu_loras and re-read from disk."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import baton.engine.lora.slots as slots_module
from baton.engine.lora.adapter import AdapterError
from baton.engine.lora.layer import LoRALinear, slot_rows
from baton.engine.lora.slots import AdapterTable


def write(path, seed, r=2):
    torch.manual_seed(seed)
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": r}))
    save_file(
        {
            "base_model.model.proj.lora_A.weight": torch.randn(r, 4),
            "base_model.model.proj.lora_B.weight": torch.randn(3, r),
        },  # fmt: skip
        str(path / "adapter_model.safetensors"),
    )


@pytest.fixture
def table(tmp_path):
    target = LoRALinear(nn.Linear(4, 3, bias=False), max_loras=2, max_rank=4, name="proj")
    table = AdapterTable({"proj": target}, lambda n: n, max_loras=2, max_rank=4, max_cpu_loras=2)
    for i, name in enumerate("abc"):
        write(tmp_path / name, i)
        table.add(name, tmp_path / name)
    return table


def test_least_recently_used_unpinned_slot_is_reused(table):
    a, b = table.acquire("a"), table.acquire("b")
    assert {a, b} == {0, 1}
    assert table.acquire("c") is None  # both slots pinned
    table.release(a)
    assert table.acquire("c") == a and table.slot_names[a] == "c"
    table.release(b)
    assert table.acquire("b") == b  # still there: no reload needed
    assert len(table.host) == 2  # max_cpu_loras


def test_each_row_gets_its_own_slots_delta(table):
    target = table.targets["proj"]
    x = torch.randn(3, 4)
    slots = {name: table.acquire(name) for name in "ab"}
    with slot_rows(torch.tensor([slots["a"], -1, slots["b"]]), table.slot_of_column, True):
        y = target(x)
    base = target.base(x)
    for row, name in ((0, "a"), (2, "b")):
        a, b = table._weights(name).weights["proj"]
        assert torch.allclose(y[row], base[row] + (x[row] @ a.T) @ b.T, atol=1e-5)
    assert torch.equal(y[1], base[1])


def test_unloading_a_pinned_adapter_is_refused(table):
    table.acquire("a")
    with pytest.raises(AdapterError, match="in use"):
        table.remove("a")
    with pytest.raises(AdapterError, match="already loaded"):
        table.add("b", "anywhere")


def test_pool_budget_counts_what_the_slot_table_takes(tmp_path):
    """The GPU pool budget subtracts the slot table; its estimate from the checkpoint's headers
    is what the adapted model really holds."""
    from baton import LLM
    from baton.engine.lora.model import LoRALimits, slot_table_bytes
    from tests.tiny import save_tiny_model

    save_tiny_model(tmp_path / "model", seed=1)
    limits = LoRALimits(max_loras=3, max_lora_rank=8, max_cpu_loras=3)
    llm = LLM(tmp_path / "model", enable_lora=True, max_loras=3, max_lora_rank=8)
    targets = llm.engine.model.adapters.targets.values()
    held = sum(t.a_rows.nbytes + t.b_rows.nbytes for t in targets)
    assert slot_table_bytes(tmp_path / "model", limits, torch.float32, 1) == held > 0


def test_the_registry_is_bounded_and_names_are_short(table, tmp_path, monkeypatch):
    """Loading in a loop stops at the bound with an error naming it (the engine keeps every
    registered name until it is unloaded); unloading makes room again."""
    monkeypatch.setattr(slots_module, "MAX_REGISTERED_ADAPTERS", 4)
    write(tmp_path / "d", 9)
    table.add("d", tmp_path / "d")
    with pytest.raises(AdapterError, match="4 adapters are loaded"):
        table.add("e", tmp_path / "d")
    table.remove("d")
    table.add("e", tmp_path / "d")
    with pytest.raises(AdapterError, match="at most 256 characters"):
        table.add("x" * 257, tmp_path / "d")
