"""LoRA adapters across a disaggregated pair (in one process, no HTTP): the adapter's name
travels with the request's params to both halves; the prefill half computes the prompt under it,
the decode half (serving the same adapters by name) decodes under it: tokens = transformers +
PEFT, mixed with the base model in one batch, and both pools and slot tables end empty."""

from __future__ import annotations

import dataclasses
import time

import zmq

from baton import SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.engine.core.engine import Engine
from tests.lora_models import make_adapter
from tests.reference import hf_greedy
from tests.test_disagg_unit import assert_pools_empty, config
from tests.tiny import save_tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 42, 9, 33, 8, 71, 3], [100, 3, 64, 12, 7, 250, 19], [9, 9, 40, 41, 42]]
NAMES = ["a", None, "b"]


def test_pair_with_adapters_matches_transformers_peft(tmp_path):
    hf = save_tiny_model(tmp_path / "model", seed=13)
    refs = {None: hf}
    modules = {}
    for i, name in enumerate(("a", "b")):
        refs[name] = make_adapter(hf, tmp_path / name, TARGETS, seed=60 + i)
        modules[name] = str(tmp_path / name)
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules=modules, page_size=4)
    ctx = zmq.Context()
    prefill = PrefillWorker(Engine(tmp_path / "model", **lora), config("prefill"), ctx)
    decoder = DecodeWorker(Engine(tmp_path / "model", **lora), config("decode"), ctx)
    base = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    try:
        for i, (prompt, name) in enumerate(zip(PROMPTS, NAMES)):
            params = dataclasses.replace(base, lora_name=name)
            decoder.add_request(f"r{i}", prompt, params, room=f"room{i}",
                                prefill_addr=prefill.address)  # fmt: skip
            prefill.add_request(f"r{i}", prompt, params, room=f"room{i}")
        start = time.time()
        while decoder.has_unfinished_requests() or prefill.has_unfinished_requests():
            assert time.time() - start < 30, "the pair did not finish"
            prefill.step()
            for delta in decoder.step():
                got.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        for i, (prompt, name) in enumerate(zip(PROMPTS, NAMES)):
            assert got[f"r{i}"] == hf_greedy(refs[name], prompt, 6)[0], name
        assert_pools_empty(prefill, decoder)
    finally:
        prefill.close()
        decoder.close()
        ctx.term()
