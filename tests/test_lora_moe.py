"""LoRA adapters on routed MoE experts (PEFT's target_parameters on transformers 5's stacked
experts): greedy tokens identical to transformers + PEFT in fp32 on Qwen3-Next (PEFT's own
gate/up/down conversion, rank_pattern 2r on gate_up_proj), Jamba and NemotronH (explicit
target_parameters), adapters and the base mixed in one batch, eager and captured; what baton
still cannot apply is refused by name."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from baton import LLM, SamplingParams
from baton.engine.lora.adapter import AdapterError
from baton.engine.lora.experts import ExpertLoRA
from baton.engine.lora.model import LoRALimits, slot_table_bytes
from tests.conftest import MOE_CONFIGS
from tests.gdn_families import gdn_models  # noqa: F401 (fixture)
from tests.lora_models import assert_mixed_batch_matches, make_adapter
from tests.reference import hf_greedy
from tests.ssm_families import ssm_models  # noqa: F401 (fixture)
from tests.tiny import save_tiny_model

NEW = 8
PROMPTS = [[5, 17, 42, 9, 33, 8, 71], [100, 3, 64, 12, 7, 250, 19, 2, 45, 60, 11]]
# transformers 5 + PEFT turn Qwen3-Next's gate/up/down targets into target_parameters
# gate_up_proj (rank_pattern 2r) and down_proj on the routed experts
QWEN_EXPERTS = ["gate_proj", "up_proj", "down_proj"]


def greedy(n=NEW):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(gdn_models, tmp_path_factory):  # noqa: F811
    """(model dir, {name: (dir, PEFT model)}, base): one adapter on the experts only, one on
    the experts and attention."""
    model_dir, hf = gdn_models("qwen3_next_mixed")
    root = tmp_path_factory.mktemp("lora-moe-qwen")
    adapters = {
        "experts": (root / "experts", make_adapter(hf, root / "experts", QWEN_EXPERTS, seed=5)),
        "both": (root / "both", make_adapter(hf, root / "both", ["q_proj", "v_proj", *QWEN_EXPERTS], seed=6)),
    }  # fmt: skip
    return model_dir, adapters, hf


def check(llm, adapters, hf, prompts=PROMPTS):
    """Every prompt under every adapter and the base in one generate call (one batch); each
    adapter changes each prompt's tokens."""
    for _, peft_model in adapters.values():
        for prompt in prompts:
            assert hf_greedy(peft_model, prompt, NEW)[0] != hf_greedy(hf, prompt, NEW)[0]
    assert_mixed_batch_matches(llm, adapters, hf, prompts, NEW)


def test_peft_writes_target_parameters_with_a_doubled_gate_up_rank(qwen):
    _, adapters, _ = qwen
    config = json.loads((adapters["experts"][0] / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["down_proj", "gate_up_proj"]
    assert config["rank_pattern"] == {r".*\.gate_up_proj": 8}


def test_expert_only_adapter_changes_the_output(qwen):
    """So the tests below fail if baton dropped the expert deltas."""
    _, adapters, hf = qwen
    for prompt in PROMPTS:
        assert hf_greedy(adapters["experts"][1], prompt, NEW)[0] != hf_greedy(hf, prompt, NEW)[0]


def test_qwen3_next_expert_adapters_mixed_with_the_base_match_peft(qwen):
    model_dir, adapters, hf = qwen
    check(LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8), adapters, hf)


def test_captured_decode_steps_apply_each_rows_expert_adapter(qwen):
    model_dir, adapters, hf = qwen
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, cpu_padded_decode=True,
              enable_prefix_caching=False)  # fmt: skip
    check(llm, adapters, hf)
    runner = llm.engine.graph_runner
    assert runner.num_replays > 0, "no decode step was replayed"
    assert any(key[3] and plan is not None for key, plan in runner.plans.items()), (
        "no step with adapters was captured"
    )


def test_jamba_expert_adapters_match_peft(ssm_models, tmp_path):  # noqa: F811
    model_dir, hf = ssm_models("jamba_moe")
    adapters = {
        f"j{i}": (tmp_path / f"j{i}", make_adapter(
            hf, tmp_path / f"j{i}", ["q_proj", "in_proj"], seed=50 + i,
            target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]))
        for i in range(2)
    }  # fmt: skip
    check(LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8), adapters, hf)


def test_qwen3_5_moe_expert_adapters_match_peft(gdn_models, tmp_path):  # noqa: F811
    model_dir, hf = gdn_models("qwen3_5_moe")
    path = tmp_path / "q35"
    peft_model = make_adapter(hf, path, [], seed=62,
                              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    check(llm, {"q35": (path, peft_model)}, hf, PROMPTS[:1])


def test_nemotron_h_relu2_expert_and_shared_expert_adapters_match_peft(tmp_path):
    hf = save_tiny_model(tmp_path / "model", seed=9, **MOE_CONFIGS["moe_nano"])
    path = tmp_path / "nemo"
    peft_model = make_adapter(hf, path, ["up_proj", "down_proj"], seed=60,
                              target_parameters=["up_proj", "down_proj"])  # fmt: skip
    llm = LLM(tmp_path / "model", enable_lora=True, max_loras=1, max_lora_rank=8)
    check(llm, {"nemo": (path, peft_model)}, hf, PROMPTS[:1])


def test_slot_table_estimate_counts_the_expert_tables(qwen):
    model_dir, adapters, _ = qwen
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    targets = llm.engine.model.adapters.targets
    experts = [t for t in targets.values() if isinstance(t, ExpertLoRA)]
    assert experts, "no expert stack was given a slot table"
    held = sum(t.a_rows.nbytes + t.b_rows.nbytes for t in targets.values())
    limits = LoRALimits(max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    assert slot_table_bytes(model_dir, limits, torch.float32, 1) == held


def test_expert_rank_over_max_lora_rank_is_refused_by_name(qwen, tmp_path):
    model_dir, _, hf = qwen
    make_adapter(hf, tmp_path / "wide", QWEN_EXPERTS, seed=7, r=8)  # gate_up_proj: rank 16
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    with pytest.raises(AdapterError, match=r"gate_up_proj has rank 16 .*max-lora-rank 8"):
        llm.engine.add_lora("wide", str(tmp_path / "wide"))


def save_per_expert_adapter(path, experts: str, E: int, D: int, inter: int, seed: int):
    """An adapter as PEFT wrote them for transformers 4: `<experts>.{e}.gate_proj.lora_A` ...
    (what vLLM reads for Qwen2-MoE / Mixtral adapters), r 4, alpha 8."""
    torch.manual_seed(seed)
    tensors = {}
    for e in range(E):
        for proj, (fan_in, fan_out) in (("gate_proj", (D, inter)), ("up_proj", (D, inter)),
                                        ("down_proj", (inter, D))):  # fmt: skip
            key = f"base_model.model.{experts}.{e}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, fan_in) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, 4) * 0.3
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM",
              "target_modules": ["gate_proj", "up_proj", "down_proj"]}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))


def test_qwen3_next_per_expert_adapter_of_transformers_4_matches_peft(qwen, tmp_path):
    """PEFT converts it for Qwen3-Next (gate/up fused: A stacked, B block-diagonal, rank 2 r)."""
    from peft import PeftModel

    model_dir, _, hf = qwen
    save_per_expert_adapter(tmp_path / "v4", "model.layers.1.mlp.experts", 8, 64, 16, seed=12)
    reference = PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "v4")).eval()
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    check(llm, {"v4": (tmp_path / "v4", reference)}, hf, PROMPTS[:1])


def test_rank_pattern_on_a_projection_is_refused_by_name(qwen, tmp_path):
    model_dir, _, hf = qwen
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    make_adapter(hf, tmp_path / "pattern", ["q_proj"], seed=8, rank_pattern={"q_proj": 2})
    with pytest.raises(AdapterError, match=r"rank_pattern 'q_proj' applies to .*q_proj"):
        llm.engine.add_lora("pattern", str(tmp_path / "pattern"))


def test_per_expert_adapters_peft_does_not_convert_are_refused(ssm_models, tmp_path):  # noqa: F811
    """transformers 5 + PEFT do not convert Jamba's per-expert adapters: neither does baton."""
    jamba_dir, _ = ssm_models("jamba_moe")
    save_per_expert_adapter(tmp_path / "v4", "model.layers.1.feed_forward.experts", 4, 32, 48, 1)
    llm = LLM(jamba_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    with pytest.raises(AdapterError, match=r"experts\.0\.down_proj, one routed expert's own"):
        llm.engine.add_lora("v4", str(tmp_path / "v4"))


def _expert_reference(x, w_up, w_down, ids, weights, deltas, activation):
    """Token by token: each choice's expert with its slot's B_e A_e added, as PEFT's merged
    weights compute it."""
    r, E = deltas.rank, deltas.num_experts
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, s = int(ids[t, j]), int(deltas.lora_slots[t])
            up, down = w_up[e].double(), w_down[e].double()
            if s >= 0:
                rows = slice((s * E + e) * r, (s * E + e + 1) * r)
                up = up + deltas.up_b[rows].double().t() @ deltas.up_a[rows].double()
                down = down + deltas.down_b[rows].double().t() @ deltas.down_a[rows].double()
            h = up @ x[t].double()
            if activation == "relu2":
                h = torch.relu(h).square()
            else:
                gate, lin = h.chunk(2)
                h = torch.nn.functional.silu(gate) * lin
            out[t] += float(weights[t, j]) * (down @ h)
    return out


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_c_torch_and_triton_expert_paths_add_each_rows_own_expert_delta(activation, monkeypatch):
    """The Triton kernels run in the interpreter (TRITON_INTERPRET=1, tests/conftest.py)."""
    from baton.kernels.cpu.moe import pack_panels
    from baton.kernels.layouts import Routing
    from baton.kernels.lora import ExpertDeltas
    from baton.kernels.moe import fused_moe, fused_moe_torch

    torch.manual_seed(0)
    T, D, inter, E, k, S, r = 6, 20, 70, 4, 2, 2, 3  # inter > 64: two panels of h
    up_rows = 2 * inter if activation == "swiglu" else inter
    w_up, w_down = torch.randn(E, up_rows, D) / 4, torch.randn(E, D, inter) / 8
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    routing = Routing(torch.rand(T, k), ids)
    x = torch.randn(T, D)
    tables = [torch.randn(S * E * r, n) / 3 for n in (D, up_rows, inter, D)]
    deltas = ExpertDeltas(*tables, rank=r, num_experts=E,
                          lora_slots=torch.tensor([0, -1, 1, 0, 1, -1]))  # fmt: skip
    want = _expert_reference(x, w_up, w_down, ids, routing.weights, deltas, activation)
    panels = pack_panels(w_up, w_down, activation == "swiglu")
    for packed in (None, panels):
        got = fused_moe_torch(x, w_up, w_down, routing, activation, packed, deltas)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("BATON_KERNELS", "triton")
    got = fused_moe(x, w_up, w_down, routing, activation, None, deltas)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    monkeypatch.delenv("BATON_KERNELS")
    # bfloat16 weights, tables and rows (the C path's bf16 loops): near the float64 reference
    half = ExpertDeltas(*(t.bfloat16() for t in tables), rank=r, num_experts=E,
                        lora_slots=deltas.lora_slots)  # fmt: skip
    w_up, w_down, x = w_up.bfloat16(), w_down.bfloat16(), x.bfloat16()
    want = _expert_reference(x, w_up, w_down, ids, routing.weights, half, activation)
    for packed in (None, pack_panels(w_up, w_down, activation == "swiglu")):
        got = fused_moe_torch(x, w_up, w_down, routing, activation, packed, half)
        torch.testing.assert_close(got.double(), want, rtol=0.05, atol=0.05)


def test_tp2_slices_expert_adapters_like_the_experts(tmp_path):
    """TP=2 (gloo, two CPU processes): each rank keeps every expert with half its intermediate,
    so B of up_proj loses the same rows and A of down_proj the same columns."""
    hf = save_tiny_model(tmp_path / "model", seed=9, **MOE_CONFIGS["moe_nano"])
    path = tmp_path / "nemo"
    peft_model = make_adapter(hf, path, [], seed=61,
                              target_parameters=["up_proj", "down_proj"])  # fmt: skip
    with LLM(tmp_path / "model", tensor_parallel_size=2, enable_lora=True, max_loras=1,
             max_lora_rank=8) as llm:  # fmt: skip
        check(llm, {"nemo": (path, peft_model)}, hf, PROMPTS[:1])


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_fp8_experts_take_float32_expert_deltas(activation):
    """Quantized experts (weight-only FP8): the C call's quantized loops and the torch path add
    the same deltas as on the dequantized weights."""
    from baton.kernels.cpu.moe import QuantPanelExperts
    from baton.kernels.layouts import Routing
    from baton.kernels.lora import ExpertDeltas
    from baton.kernels.moe import fused_moe_torch, pack_experts
    from baton.kernels.quant import dequantize, quantize_fp8

    torch.manual_seed(1)
    T, D, inter, E, k, S, r = 5, 24, 40, 3, 2, 2, 2
    up_rows = 2 * inter if activation == "swiglu" else inter
    q_up, q_down = (
        quantize_fp8(torch.randn(E, up_rows, D) / 4),
        quantize_fp8(torch.randn(E, D, inter) / 8),
    )
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    routing = Routing(torch.rand(T, k), ids)
    x = torch.randn(T, D)
    tables = [torch.randn(S * E * r, n) / 3 for n in (D, up_rows, inter, D)]
    deltas = ExpertDeltas(*tables, rank=r, num_experts=E, lora_slots=torch.tensor([1, 0, -1, 1, 0]))
    w_up, w_down = dequantize(q_up), dequantize(q_down)
    want = _expert_reference(x, w_up, w_down, ids, routing.weights, deltas, activation)
    packed = pack_experts(q_up, q_down, activation)
    paths = (None, packed) if isinstance(packed, QuantPanelExperts) else (None,)
    for panels in paths:
        got = fused_moe_torch(x, q_up, q_down, routing, activation, panels, deltas)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
