"""LoRA adapters through the engine's paths: the prefix cache (no hit across adapters), captured
CPU decode steps (= eager, the slot of each row from the fixed buffers), fewer slots than
adapters (requests wait for a slot; the LRU swaps adapters in), n-gram speculation and
structured outputs under an adapter."""

from __future__ import annotations

import pytest

from baton import LLM, LoRARequest, SamplingParams
from baton.engine.core.sampling_params import StructuredOutputs
from tests.lora_models import make_adapter
from tests.mtp_models import add_mtp_layer
from tests.reference import hf_greedy
from tests.tiny import save_tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"]
LONG = [(7 * i + 3) % 300 + 5 for i in range(41)]  # crosses two 16-token cache blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    hf = save_tiny_model(root / "model", seed=3)
    adapters = {
        name: (str(root / name), make_adapter(hf, root / name, TARGETS, seed=40 + i))
        for i, name in enumerate(("a", "b", "c"))
    }
    return root / "model", adapters, hf


def greedy(n=6):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def request(adapters, name, i=1):
    return LoRARequest(name, i, adapters[name][0])


def test_same_prompt_under_two_adapters_gets_no_cross_hit(tiny):
    model_dir, adapters, hf = tiny
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8,
              page_size=16, mamba_track_interval=16)  # fmt: skip
    stats = llm.engine.stats
    first = llm.generate([LONG], greedy(), lora_request=request(adapters, "a"))[0]
    assert stats().prefix_cache_hit_tokens == 0
    other = llm.generate([LONG], greedy(), lora_request=request(adapters, "b", 2))[0]
    assert stats().prefix_cache_hit_tokens == 0, "a block cached under adapter a hit under b"
    base = llm.generate([LONG], greedy())[0]
    assert stats().prefix_cache_hit_tokens == 0, "a block cached under an adapter hit the base"
    again = llm.generate([LONG], greedy(), lora_request=request(adapters, "a"))[0]
    assert stats().prefix_cache_hit_tokens > 0  # the cache works: a's own blocks hit
    for out, ref in ((first, adapters["a"][1]), (other, adapters["b"][1]), (base, hf),
                     (again, adapters["a"][1])):  # fmt: skip
        assert out.token_ids == hf_greedy(ref, LONG, 6)[0]


def test_captured_cpu_decode_steps_apply_each_rows_adapter(tiny):
    """Decode steps recorded once and replayed (cpu_plan.py): every replay reads the rows'
    slots from the fixed metadata buffers, whatever mix of adapters the batch has."""
    model_dir, adapters, hf = tiny
    llm = LLM(model_dir, enable_lora=True, max_loras=3, max_lora_rank=8, cpu_padded_decode=True,
              enable_prefix_caching=False)  # fmt: skip
    prompts = [LONG[:9], LONG[3:14], LONG[5:12], LONG[:7]]
    names = ["a", None, "b", "c"]
    lora = [None if n is None else request(adapters, n, i + 1) for i, n in enumerate(names)]
    outs = llm.generate(prompts, greedy(10), lora_request=lora)
    assert llm.engine.graph_runner.num_replays > 0, "no decode step was replayed"
    for prompt, name, out in zip(prompts, names, outs):
        ref = hf if name is None else adapters[name][1]
        assert out.token_ids == hf_greedy(ref, prompt, 10)[0], name
    # a step with no adapter in it skips the deltas: a plan of its own (key[3], has_lora)
    (base,) = llm.generate([prompts[1]], greedy(10))
    assert base.token_ids == hf_greedy(hf, prompts[1], 10)[0]
    plans = llm.engine.graph_runner.plans
    assert {key[3] for key, plan in plans.items() if plan is not None} == {True, False}


def test_more_adapters_than_slots_wait_for_a_slot(tiny):
    """max_loras=1: three adapters and the base in one call run one adapter at a time, the
    slot reloaded from host memory (max_cpu_loras) as the LRU swaps them."""
    model_dir, adapters, hf = tiny
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    names = ["a", "b", None, "c", "a"]
    lora = [None if n is None else request(adapters, n, i + 1) for i, n in enumerate(names)]
    outs = llm.generate([LONG[:10]] * len(names), greedy(), lora_request=lora)
    for name, out in zip(names, outs):
        ref = hf if name is None else adapters[name][1]
        assert out.token_ids == hf_greedy(ref, LONG[:10], 6)[0], name
    table = llm.engine.model.adapters
    assert len(table.host) == 2 and sum(table.pins) == 0


def test_ngram_speculation_under_an_adapter(tiny):
    model_dir, adapters, hf = tiny
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2})  # fmt: skip
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    outs = llm.generate([prompt, prompt], greedy(12),
                        lora_request=[request(adapters, "a"), None])  # fmt: skip
    assert outs[0].token_ids == hf_greedy(adapters["a"][1], prompt, 12)[0]
    assert outs[1].token_ids == hf_greedy(hf, prompt, 12)[0]


def test_structured_output_under_an_adapter(tiny):
    model_dir, adapters, _ = tiny
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    params = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        structured_outputs=StructuredOutputs(kind="regex", spec="[ab]{3}", after_token_ids=()),
    )
    out = llm.generate(["hello"], params, lora_request=request(adapters, "a"))[0]
    assert out.text in {a + b + c for a in "ab" for b in "ab" for c in "ab"}, out.text


def test_mtp_drafts_with_the_base_head_under_an_adapter(tiny, tmp_path):
    """The MTP head drafts as the base model (it is not adapted); verification runs the
    adapted model, so the output is the adapter's greedy tokens whatever the drafts were."""
    model_dir, adapters, hf = tiny
    add_mtp_layer(model_dir, tmp_path / "mtp", ["full_attention"])
    llm = LLM(tmp_path / "mtp", enable_lora=True, max_loras=2, max_lora_rank=8,
              cpu_padded_decode=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})  # fmt: skip
    prompts = [LONG[:9], LONG[2:13]]
    outs = llm.generate(prompts, greedy(10), lora_request=[request(adapters, "a"), None])
    assert outs[0].token_ids == hf_greedy(adapters["a"][1], prompts[0], 10)[0]
    assert outs[1].token_ids == hf_greedy(hf, prompts[1], 10)[0]
    assert llm.engine.stats().spec_decode_num_drafts > 0
