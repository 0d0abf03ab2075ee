"""The model and loader against transformers (fp32, tiny random NemotronH checkpoints)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton import LLM, SamplingParams
from baton.engine.cache.pools import StateCache
from baton.engine.checkpoint.loader import load_model
from baton.engine.checkpoint.weights import WeightError
from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from baton.engine.executor.forward_metadata import ScheduledBatch
from baton.engine.executor.model_runner import ModelRunner
from tests.reference import assert_greedy_matches, hf_greedy, hf_prompt_logprobs

CONFIG_NAMES = ["base", "odd", "single_group_tied", "mamba_only", "attention_only"]


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_prompt_logprobs_match_transformers(tiny_models, name):
    model_dir, hf = tiny_models(name)
    cs = hf.config.chunk_size
    lengths = [1, cs - 1, cs, cs + 1, 3 * cs + 5]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    llm = LLM(model_dir, page_size=4, chunked_prefill_size=cs + 3, max_num_batched_tokens=2 * cs)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3, logprobs=3)
    )
    for prompt, out in zip(prompts, outs):
        ref = hf_prompt_logprobs(hf, prompt)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            assert prompt[pos] in entry
            for token, lp in entry.items():
                assert abs(lp - float(ref[pos - 1, token])) < 1e-4, (name, len(prompt), pos, token)
            top = ref[pos - 1].topk(3).indices.tolist()
            assert set(top) <= set(entry)
        # The first generated token's logprob comes from the last prompt position.
        (token,) = out.token_ids
        assert abs(out.logprobs[0][token] - float(ref[-1, token])) < 1e-4


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_greedy_tokens_match_transformers(tiny_models, name):
    model_dir, hf = tiny_models(name)
    g = torch.Generator().manual_seed(11)
    lengths = [1, 2, 7, 16, 17, 33, 50, 81]
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    llm = LLM(model_dir, page_size=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    compared = 0
    for prompt, out in zip(prompts, outs):
        ref, ref_lp = hf_greedy(hf, prompt, 32)
        compared += assert_greedy_matches(out.token_ids, ref, ref_lp, f"{name} len {len(prompt)}")
    assert compared >= 0.9 * 32 * len(prompts)  # ties are rare; most tokens really compared


def _batch(tokens, start, slot, pages, logits=True) -> ScheduledBatch:
    return ScheduledBatch(
        mode="extend",
        request_ids=("r",),
        num_decode_seqs=0,
        num_verify_seqs=0,
        input_ids=tuple(tokens),
        seq_lens=(len(tokens),),
        start_positions=(start,),
        kv_pages=(tuple(pages),),
        mamba_slots=(slot,),
        verify_slots=(),
        logits_seqs=(0,) if logits else (),
        prompt_logprob_seqs=(),
        has_mamba_track_mask=False,
        track_points=(),
        lora_slots=(-1,) * len(("r",)),
    )


@pytest.mark.parametrize("splits", [[45], [13, 9, 23], [1, 1, 43], [16, 16, 13], [5, 39, 1]])
def test_split_prefill_equals_one_pass(base_model, splits):
    """A prompt fed in pieces (mid-chunk cuts included) leaves the same conv/SSM state and K/V
    and gives the same last logits as one pass."""
    model_dir, hf = base_model
    config = ModelConfig.from_hf(model_dir)
    model = load_model(model_dir, torch.float32, "cpu")
    tokens = torch.randint(
        3, config.vocab_size, (45,), generator=torch.Generator().manual_seed(3)
    ).tolist()

    def run(pieces):
        cache = StateCache.for_model(
            config, num_pages=16, page_size=4, num_slots=2, dtype=torch.float32, device="cpu"
        )
        runner = ModelRunner(model, cache, "cpu")
        pages, start = list(range(1, 13)), 0
        for n in pieces:
            _, logits = runner.forward(_batch(tokens[start : start + n], start, 1, pages))
            start += n
        return cache, logits[-1]

    ref_cache, ref_logits = run([45])
    cache, logits = run(splits)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        cache.pools["mamba2.ssm"][:, 1], ref_cache.pools["mamba2.ssm"][:, 1], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        cache.pools["mamba2.conv"][:, 1], ref_cache.pools["mamba2.conv"][:, 1], atol=1e-6, rtol=1e-6
    )
    for k, ref_k in zip(cache.pools["attention.k"], ref_cache.pools["attention.k"]):
        torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)
    assert cache.pools["mamba2.ssm"][:, 1].abs().sum() > 0  # the state really was written


def _logits_for(model_dir, tokens):
    llm = LLM(model_dir, page_size=4)
    (out,) = llm.generate([tokens], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return [next(iter(e.values())) for e in out.prompt_logprobs[1:]]


def test_sharded_checkpoint_loads(base_model, tmp_path):
    model_dir, hf = base_model
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    tokens = list(range(3, 40))
    assert _logits_for(tmp_path, tokens) == _logits_for(model_dir, tokens)


def test_legacy_checkpoint_loads(base_model, tmp_path):
    """Legacy spelling: hybrid_override_pattern, mamba_* aliases, and `model.`-prefixed names."""
    model_dir, hf = base_model
    config = json.loads((model_dir / "config.json").read_text())
    pattern = "".join(
        {"linear_attention": "M", "full_attention": "*", "mlp": "-"}[t]
        for t in config.pop("layers_block_type")
    )
    config["hybrid_override_pattern"] = pattern
    for new, old in [
        ("n_groups", "mamba_n_groups"),
        ("conv_kernel", "mamba_d_conv"),
        ("chunk_size", "mamba_chunk_size"),
    ]:
        config[old] = config.pop(new)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(model_dir / "model.safetensors")
    save_file(
        {k.replace("backbone.", "model.", 1): v for k, v in tensors.items()},
        tmp_path / "model.safetensors",
    )
    parsed = ModelConfig.from_hf(tmp_path)
    assert parsed == ModelConfig.from_hf(model_dir)
    tokens = list(range(3, 40))
    assert _logits_for(tmp_path, tokens) == _logits_for(model_dir, tokens)


def test_missing_tensor_is_named(base_model, tmp_path):
    model_dir, _ = base_model
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["backbone.layers.0.mixer.A_log"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match=r"model\.layers\.0\.mixer\.A_log"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unexpected_tensor_is_named(base_model, tmp_path):
    model_dir, _ = base_model
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["backbone.layers.0.mixer.surprise"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match="surprise"):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_config_key_and_bad_architecture_are_named(base_model, tmp_path):
    model_dir, _ = base_model
    config = json.loads((model_dir / "config.json").read_text())
    broken = dict(config)
    del broken["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_dict(broken)
    no_layout = {k: v for k, v in config.items() if k != "layers_block_type"}
    with pytest.raises(ConfigError, match="hybrid_override_pattern"):
        ModelConfig.from_dict(no_layout)
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        ModelConfig.from_dict(dict(config, architectures=["LlamaForCausalLM"], model_type="llama"))
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_hf(tmp_path)


def test_tied_checkpoint_without_lm_head_uses_embeddings(base_model, tmp_path):
    model_dir, _ = base_model
    config = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    model = load_model(tmp_path, torch.float32, "cpu")
    assert model.tied_parameters == ("lm_head.weight",)
    # On the CPU lm_head is prepacked (kernels/linear.py): check what it computes.
    embeddings = tensors["backbone.embeddings.weight"]
    hidden = torch.randn(3, embeddings.shape[1])
    torch.testing.assert_close(model.lm_head(hidden), hidden @ embeddings.T)
    torch.testing.assert_close(model.model.embeddings.weight, embeddings)
