"""The Bailing hybrid's multi-token-prediction layer (engine/models/bailing_mtp.py), stored as the
Ling / Ring linear releases store it, after the decoder at `model.layers.{num_hidden_layers}.`:
the checkpoint loads with or without an MTP drafter (before, its tensors were refused as
unexpected), the head's forward equals transformers' own Bailing decoder layer and norm run over
the same tensors, and greedy output with MTP speculation equals plain decoding (k = 1, 2, chunked
prefill beside verify rows, CPU-captured steps and eager)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton import LLM, SamplingParams
from baton.engine.checkpoint.loader import load_model
from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from tests.kimi_models import BAILING_CONFIGS
from tests.tiny import spread_parameters

NAME = "bailing_safe_gate"  # MLA every 2nd layer, a dense first layer, MoE after it
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)


def mtp_layer_model(config: dict, seed: int):
    """transformers' Bailing hybrid with one layer, an MLA layer with the MoE: the MTP layer's
    decoder, its `norm` the MTP layer's final_layernorm."""
    import transformers

    one = dict(config, num_hidden_layers=1, layer_types=["full_attention"],
               mlp_layer_types=["sparse"], num_nextn_predict_layers=0)  # fmt: skip
    one.pop("layer_group_size", None)
    one.pop("first_k_dense_replace", None)
    torch.manual_seed(seed)
    model = transformers.BailingHybridForCausalLM(transformers.BailingHybridConfig(**one)).eval()
    spread_parameters(model)
    return model


@pytest.fixture(scope="module")
def bailing_mtp(kimi_models, tmp_path_factory):
    """(model dir with the MTP layer stored after the decoder, transformers' target, the MTP
    layer's transformers model, its enorm / hnorm / eh_proj tensors)."""
    source, hf = kimi_models(NAME)
    dest = tmp_path_factory.mktemp("bailing-mtp") / "model"
    shutil.copytree(source, dest)
    layer_model = mtp_layer_model(BAILING_CONFIGS[NAME], seed=41)
    saved = tmp_path_factory.mktemp("bailing-mtp-layer")
    layer_model.save_pretrained(str(saved))
    n = hf.config.num_hidden_layers
    tensors = load_file(str(dest / "model.safetensors"))
    extra = {}
    for name, tensor in load_file(str(saved / "model.safetensors")).items():
        if name.startswith("model.layers.0."):
            extra[f"model.layers.{n}." + name[len("model.layers.0.") :]] = tensor
        elif name == "model.norm.weight":
            extra[f"model.layers.{n}.final_layernorm.weight"] = tensor
    g = torch.Generator().manual_seed(7)
    hidden = hf.config.hidden_size
    fuse = {
        "enorm": 1 + 0.3 * torch.randn(hidden, generator=g),
        "hnorm": 1 + 0.3 * torch.randn(hidden, generator=g),
        "eh_proj": torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5,
    }
    for key, tensor in fuse.items():
        extra[f"model.layers.{n}.{key}.weight"] = tensor.contiguous()
    save_file({**tensors, **extra}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1  # transformers' default, written by it
    return dest, hf, layer_model, fuse


def test_mtp_layer_count_is_read_and_more_than_one_refused(bailing_mtp):
    model_dir, _, _, _ = bailing_mtp
    raw = json.loads((model_dir / "config.json").read_text())
    assert ModelConfig.from_dict(raw).num_nextn_predict_layers == 1
    assert (
        ModelConfig.from_dict(dict(raw, num_nextn_predict_layers=0)).num_nextn_predict_layers == 0
    )
    with pytest.raises(ConfigError, match="2 MTP layers are not supported"):
        ModelConfig.from_dict(dict(raw, num_nextn_predict_layers=2))


def test_mtp_tensors_load_into_the_head_only_for_an_mtp_drafter(bailing_mtp):
    """Without a drafter the layer's tensors are skipped (the loader refuses unexpected and
    missing tensors); with one, each finds its parameter."""
    model_dir, _, layer_model, fuse = bailing_mtp
    assert load_model(model_dir, torch.float32, "cpu").mtp is None
    head = load_model(model_dir, torch.float32, "cpu", with_mtp=True).mtp
    for key in ("enorm", "hnorm"):
        torch.testing.assert_close(getattr(head, key).weight, fuse[key])
    x = torch.randn(3, fuse["eh_proj"].shape[1])  # a packed linear for the CPU: its products
    torch.testing.assert_close(head.eh_proj(x), x @ fuse["eh_proj"].T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.final_layernorm.weight, layer_model.model.norm.weight)
    torch.testing.assert_close(
        head.layers[0].self_attn.kv_b_proj.weight,
        layer_model.model.layers[0].self_attn.kv_b_proj.weight,
    )


def test_mtp_forward_equals_transformers_decoder_layer(bailing_mtp):
    """A draft forward over 11 positions of a fresh cache (MLA over its own latent pages, rotary
    at each position) against transformers' layer over eh_proj(cat(enorm(e), hnorm(h)))."""
    from baton.engine.executor.draft_batch import DraftBatch
    from tests.spec_helpers import mtp_prefill_batch

    model_dir, hf, layer_model, fuse = bailing_mtp
    model = load_model(model_dir, torch.float32, "cpu", with_mtp=True)
    runner, batch = mtp_prefill_batch(model, tokens=list(range(30, 41)))
    g = torch.Generator().manual_seed(1)
    prev = torch.randn(len(batch.input_ids), hf.config.hidden_size, generator=g)
    runner.target_hidden = prev
    logits = runner.draft(
        DraftBatch(batch=batch, hidden_from="target", hidden_rows=tuple(range(11)))
    )

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps) * w

    embeds = hf.get_input_embeddings().weight[list(batch.input_ids)]
    fused = torch.cat([rms(embeds, fuse["enorm"]), rms(prev, fuse["hnorm"])], -1)
    with torch.no_grad():
        want = layer_model.model(inputs_embeds=(fused @ fuse["eh_proj"].T)[None])
    want = want.last_hidden_state[0]
    torch.testing.assert_close(runner.draft_hidden, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[-1], hf.lm_head(want[-1]), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def plain_outputs(bailing_mtp):
    model_dir, hf, _, _ = bailing_mtp
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 19, 27)]  # fmt: skip
    return prompts, LLM(model_dir, chunked_prefill_size=8).generate(prompts, GREEDY)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capture", [True, False], ids=["captured", "eager"])
def test_mtp_speculation_keeps_greedy_outputs(bailing_mtp, plain_outputs, k, capture):
    model_dir, _, _, _ = bailing_mtp
    prompts, plain = plain_outputs
    llm = LLM(
        model_dir,
        chunked_prefill_size=8,
        cpu_step_capture=capture,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    )
    got = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    for a, b in zip(plain, got):
        assert all(abs(a.logprobs[i][t] - b.logprobs[i][t]) < 1e-4
                   for i, t in enumerate(a.token_ids))  # fmt: skip
    stats = llm.stats()
    assert stats.spec_decode_num_draft_tokens == k * stats.spec_decode_num_drafts > 0
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
    if capture:
        assert llm.engine.graph_runner.num_replays > 0
