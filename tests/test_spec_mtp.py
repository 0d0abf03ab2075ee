"""NemotronH's multi-token-prediction layer: its config keys and weights as published
checkpoints hold them, its forward against a plain torch reference written from its definition,
the drafts the engine chains from it, and greedy output with MTP speculation equal to plain
decoding for dense and MoE models, k = 1, 2, 4."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from baton import LLM, SamplingParams
from baton.engine.checkpoint.loader import load_model
from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from tests.mtp_models import add_mtp_layer

MTP_MODELS = {  # name -> (tiny model it extends, MTP block types)
    "dense": ("base", ["full_attention"]),
    "moe": ("moe_nano", ["full_attention", "moe"]),
}


@pytest.fixture(scope="module")
def mtp_models(tiny_models, tmp_path_factory):
    """name -> (model dir, transformers model of the target, MTP tensors)."""
    built = {}

    def get(name: str):
        if name not in built:
            source, blocks = MTP_MODELS[name]
            source_dir, hf_model = tiny_models(source)
            dest = tmp_path_factory.mktemp(f"mtp-{name}") / "model"
            built[name] = (dest, hf_model, add_mtp_layer(source_dir, dest, blocks))
        return built[name]

    return get


def edited_config(model_dir, tmp_path, **keys):
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(keys)
    for key, value in keys.items():
        if value is None:
            raw.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_hf(tmp_path)


def test_mtp_block_types_read_as_published(mtp_models, tmp_path):
    model_dir, _, _ = mtp_models("moe")
    config = ModelConfig.from_hf(model_dir)
    assert config.num_nextn_predict_layers == 1
    assert config.family.mtp_layer_types == ("attention", "moe")
    legacy = edited_config(
        model_dir, tmp_path, mtp_layers_block_type=None, mtp_hybrid_override_pattern="*E"
    )
    assert legacy.family.mtp_layer_types == ("attention", "moe")
    default = edited_config(model_dir, tmp_path, mtp_layers_block_type=None)
    assert default.family.mtp_layer_types == ("attention", "moe")  # transformers' default
    with pytest.raises(ConfigError, match="mtp_layers_block_type.*attention and MoE"):
        edited_config(model_dir, tmp_path, mtp_layers_block_type=["mamba", "moe"])
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=2"):
        edited_config(model_dir, tmp_path, num_nextn_predict_layers=2)


def test_mtp_weights_load_only_for_an_mtp_drafter(mtp_models):
    model_dir, _, tensors = mtp_models("moe")
    plain = load_model(model_dir, torch.float32, "cpu")
    assert plain.mtp is None
    with_mtp = load_model(model_dir, torch.float32, "cpu", with_mtp=True)
    head = with_mtp.mtp.layers
    torch.testing.assert_close(head[0].hnorm.weight, tensors["mtp.layers.0.hnorm.weight"])
    torch.testing.assert_close(
        head[1].mixer.experts.up_proj[3], tensors["mtp.layers.1.mixer.experts.3.up_proj.weight"]
    )
    torch.testing.assert_close(
        head[1].final_layernorm.weight, tensors["mtp.layers.1.final_layernorm.weight"]
    )


# -- the torch reference, written from the layer's definition ---------------------------------


def rms(x, weight, eps):
    return weight.double() * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def attention_ref(x, w, prefix, heads, kv_heads, head_dim):
    """Causal GQA attention without positional encoding (NemotronH's NoPE)."""
    T = x.shape[0]
    q = (x @ w[f"{prefix}.q_proj.weight"].double().T).view(T, heads, head_dim)
    k = (x @ w[f"{prefix}.k_proj.weight"].double().T).view(T, kv_heads, head_dim)
    v = (x @ w[f"{prefix}.v_proj.weight"].double().T).view(T, kv_heads, head_dim)
    k = k.repeat_interleave(heads // kv_heads, 1)
    v = v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), -math.inf)
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, heads * head_dim)
    return out @ w[f"{prefix}.o_proj.weight"].double().T


def relu2(x):
    return F.relu(x).pow(2)


def moe_ref(x, w, prefix, moe):
    """Sigmoid router, top-k on score + correction bias, weights renormalised and scaled,
    relu² experts, plus the shared expert."""
    scores = torch.sigmoid(x @ w[f"{prefix}.gate.weight"].double().T)
    choice = (scores + w[f"{prefix}.gate.e_score_correction_bias"].double()).topk(moe.top_k).indices
    weights = scores.gather(1, choice)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * moe.routed_scaling_factor
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, e in enumerate(choice[t].tolist()):
            up = w[f"{prefix}.experts.{e}.up_proj.weight"].double()
            down = w[f"{prefix}.experts.{e}.down_proj.weight"].double()
            out[t] += weights[t, slot] * (relu2(x[t] @ up.T) @ down.T)
    shared = relu2(x @ w[f"{prefix}.shared_experts.up_proj.weight"].double().T)
    return out + shared @ w[f"{prefix}.shared_experts.down_proj.weight"].double().T


def mtp_reference(config, w, embeds, hidden):
    """embeds: the next tokens' embeddings, hidden: the target's final hidden states, (T, H)
    each; returns the MTP layer's output hidden states (T, H) in float64."""
    hybrid, eps = config.family, config.family.norm_eps
    attention = hybrid.attention
    fused = torch.cat(
        [
            rms(embeds.double(), w["mtp.layers.0.enorm.weight"], eps),
            rms(hidden.double(), w["mtp.layers.0.hnorm.weight"], eps),
        ],
        dim=-1,
    )
    x = fused @ w["mtp.layers.0.eh_proj.weight"].double().T
    for j, kind in enumerate(hybrid.mtp_layer_types):
        prefix = f"mtp.layers.{j}"
        normed = rms(x, w[f"{prefix}.norm.weight"], eps)
        if kind == "attention":
            x = x + attention_ref(
                normed,
                w,
                f"{prefix}.mixer",
                attention.num_heads,
                attention.num_kv_heads,
                attention.head_dim,
            )
        else:
            x = x + moe_ref(normed, w, f"{prefix}.mixer", hybrid.moe)
    last = len(hybrid.mtp_layer_types) - 1
    return rms(x, w[f"mtp.layers.{last}.final_layernorm.weight"], eps)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_mtp_forward_equals_the_torch_reference(mtp_models, name):
    """A draft forward over 11 positions of a fresh cache (its attention over its own K/V)."""
    from baton.engine.executor.draft_batch import DraftBatch
    from tests.spec_helpers import mtp_prefill_batch

    model_dir, _, tensors = mtp_models(name)
    config = ModelConfig.from_hf(model_dir)
    model = load_model(model_dir, torch.float32, "cpu", with_mtp=True)
    runner, batch = mtp_prefill_batch(model, tokens=list(range(30, 41)))
    g = torch.Generator().manual_seed(1)
    runner.target_hidden = torch.randn(len(batch.input_ids), config.hidden_size, generator=g)
    logits = runner.draft(
        DraftBatch(batch=batch, hidden_from="target", hidden_rows=tuple(range(11)))
    )
    stored = load_file(str(model_dir / "model.safetensors"))
    embeds = stored["backbone.embeddings.weight"][list(batch.input_ids)]
    want = mtp_reference(config, tensors, embeds, runner.target_hidden)
    torch.testing.assert_close(runner.draft_hidden.double(), want, atol=1e-4, rtol=1e-4)
    lm_head = stored["lm_head.weight"].double()
    torch.testing.assert_close(logits[-1].double(), want[-1] @ lm_head.T, atol=1e-4, rtol=1e-4)


def reference_drafts(config, tensors, hf_model, prompt, k):
    """The MTP chain after a prompt, from transformers' target: the first token is the target's
    greedy one; the layer runs over every prompt position, then chains on its own output."""
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), output_hidden_states=True)
    first = int(out.logits[0, -1].argmax())
    hidden = out.hidden_states[-1][0]  # after the final norm: what the MTP layer reads
    embed = hf_model.get_input_embeddings().weight.double()
    lm_head = hf_model.lm_head.weight.double()
    tokens_after, states, drafts = prompt[1:] + [first], hidden.double(), []
    for _ in range(k):
        mtp_out = mtp_reference(config, tensors, embed[tokens_after], states)
        drafts.append(int((mtp_out[-1] @ lm_head.T).argmax()))
        tokens_after = tokens_after + [drafts[-1]]
        states = torch.cat([states, mtp_out[-1:]])
    return first, drafts


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_engine_drafts_at_every_step_are_the_reference_chain(mtp_models, name):
    """The MTP K/V built over the prompt during its (chunked) prefill and over every position
    a verify step kept, each pass-1 row and the chain give, after every step, the drafts the
    reference computes over the whole sequence so far."""
    model_dir, hf_model, tensors = mtp_models(name)
    config = ModelConfig.from_hf(model_dir)
    llm = LLM(
        model_dir,
        chunked_prefill_size=8,
        speculative_config={"method": "mtp", "num_speculative_tokens": 3},
    )
    prompt = [5, 9, 14, 3, 3, 28, 17, 40, 41, 8, 2, 61, 90, 7, 7, 12, 33, 19, 4]
    llm.engine.add_request("r", prompt, SamplingParams(max_tokens=7, temperature=0))
    req = llm.engine.scheduler.requests["r"]
    steps = []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        if req.output_ids and len(req.output_ids) < 6:  # (no drafts for the last token)
            steps.append((list(req.output_ids), tuple(req.drafts)))
    assert len(steps) > 2
    for output, drafts in steps:
        first, want = reference_drafts(config, tensors, hf_model, prompt + output[:-1], 3)
        assert first == output[-1]
        assert drafts == tuple(want), f"after {len(output)} tokens"


GREEDY_PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5], list(range(20, 45)), [40, 41, 40, 41, 42]]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def plain_outputs(mtp_models):
    """A model's outputs for GREEDY_PROMPTS without speculation, computed once per model."""
    computed = {}

    def get(name: str):
        if name not in computed:
            computed[name] = LLM(mtp_models(name)[0]).generate(GREEDY_PROMPTS, GREEDY)
        return computed[name]

    return get


@pytest.mark.parametrize("name", ["dense", "moe"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_mtp_speculation_keeps_greedy_outputs(mtp_models, plain_outputs, name, k):
    model_dir, _, _ = mtp_models(name)
    want = plain_outputs(name)
    llm = LLM(
        model_dir,
        chunked_prefill_size=8,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    )
    got = llm.generate(GREEDY_PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(want, got):
        assert all(
            abs(a.logprobs[i][t] - b.logprobs[i][t]) < 1e-4 for i, t in enumerate(a.token_ids)
        )
    stats = llm.stats()
    assert (
        stats.spec_decode_num_drafts > 0
        and stats.spec_decode_num_draft_tokens == k * stats.spec_decode_num_drafts
    )
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def test_mtp_needs_the_checkpoints_mtp_layers(tiny_models):
    model_dir, _ = tiny_models("base")
    with pytest.raises(ValueError, match="num_nextn_predict_layers = 0"):
        LLM(model_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_verify_steps_through_the_padded_runner_keep_greedy_outputs(mtp_models, plain_outputs):
    """With the padded runner on (the CUDA-graph path, run eagerly on the CPU), every verify step
    of three requests runs padded to the capture size 4; the padding rows' junk lands on the
    dummy slot and page, which no live request reads: outputs are the plain ones."""
    model_dir, _, _ = mtp_models("moe")
    llm = LLM(
        model_dir,
        cpu_padded_decode=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    junk = [pool for name, pool in llm.engine.cache.pools.items() if name.startswith("mamba2.")]
    assert junk
    for pool in junk:
        pool[:, 0] = 7.0  # the dummy slot holds junk
    runner = llm.engine.graph_runner
    seen = []
    original = runner.forward
    runner.forward = lambda sched: (seen.append((sched.mode, sched.num_seqs)), original(sched))[1]
    got = llm.generate(GREEDY_PROMPTS, GREEDY)
    want = plain_outputs("moe")
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(want, got):
        assert all(
            abs(a.logprobs[i][t] - b.logprobs[i][t]) < 1e-4 for i, t in enumerate(a.token_ids)
        )
    assert ("verify", 3) in seen  # three verify rows padded to 4
    assert llm.stats().kv_pages_used == 0 and llm.stats().mamba_slots_used == 0
