"""Zamba2's shared attention blocks: the block's weights are stored once (later uses are the
same module and the checkpoint holds no copy for them); each use has its own adapters and its
own KV pages; the block reads the hidden state concatenated with the original embeddings."""

from __future__ import annotations

import torch
from safetensors import safe_open

from baton import LLM, SamplingParams
from baton.engine.models.zamba2 import HybridLayer


def hybrid_layers(llm) -> list[HybridLayer]:
    return [m for m in llm.engine.model.model.layers if isinstance(m, HybridLayer)]


def test_shared_block_is_stored_once_and_reused(family_models):
    model_dir, hf = family_models("zamba2_shared")  # hybrid layers 1, 3, 4; blocks 0, 1, 0
    llm = LLM(model_dir, page_size=4)
    layers = hybrid_layers(llm)
    assert [layer.use for layer in layers] == [0, 1, 2]
    assert layers[0].shared_transformer is layers[2].shared_transformer
    assert layers[0].shared_transformer is not layers[1].shared_transformer
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any(n.startswith("model.layers.4.shared_transformer.") for n in names)
    assert any(n.startswith("model.layers.1.shared_transformer.") for n in names)
    # Each use owns its adapters: block 0 holds uses 0 and 2 (different weights), not use 1.
    adapters = layers[0].shared_transformer.self_attn.linear_q_adapter_list
    assert isinstance(adapters[1], torch.nn.Identity)
    probe = torch.randn(3, 2 * llm.engine.model.config.hidden_size)
    assert not torch.allclose(adapters[0](probe), adapters[2](probe))


def test_each_use_writes_its_own_kv_pages(family_models):
    model_dir, _ = family_models("zamba2_shared")
    llm = LLM(model_dir, page_size=4, enable_prefix_caching=False)
    cache = llm.engine.cache
    assert len(cache.pools["attention.k"]) == 3  # one KV pool per use of a shared block
    for k in cache.pools["attention.k"]:
        k.zero_()
    llm.generate([list(range(3, 20))], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    written = [
        k.abs().sum(dim=(1, 2)).nonzero().flatten().tolist() for k in cache.pools["attention.k"]
    ]
    assert written[0] and written[0] == written[1] == written[2]  # the same token slots...
    assert not torch.equal(
        cache.pools["attention.k"][0], cache.pools["attention.k"][2]
    )  # ...with each use's own keys (same block)


def test_block_input_is_hidden_concatenated_with_embeddings(family_models, monkeypatch):
    model_dir, _ = family_models("zamba2_shared")
    llm = LLM(model_dir, page_size=4)
    block = hybrid_layers(llm)[0].shared_transformer
    seen = []
    norm = block.input_layernorm
    original_forward = norm.forward
    monkeypatch.setattr(norm, "forward", lambda x: (seen.append(x.clone()), original_forward(x))[1])
    prompt = [5, 9, 11, 3]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    x = seen[0]
    H = llm.engine.model.config.hidden_size
    assert x.shape == (len(prompt), 2 * H)
    embeddings = llm.engine.model.model.embed_tokens.weight[prompt]
    torch.testing.assert_close(x[:, H:], embeddings)  # second half: the original embeddings
    assert not torch.allclose(x[:, :H], embeddings)  # first half: the layer-1 hidden state
