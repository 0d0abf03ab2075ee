"""Tiny random gated DeltaNet hybrids of every architecture (Qwen3-Next, Qwen3.5 dense and MoE as
causal LMs and as vision checkpoints, OLMo-Hybrid), built by transformers (fp32, fixed seeds,
parameters spread like tests/tiny.py) and saved as the published checkpoints lay them out.

Shapes cover: uneven key/value heads (R = Hv / Hk of 1, 2, 3) and head dims, partial rotary
(transformers' 0.25 and 0.5) and OLMo-Hybrid's NoPE, attention first and last, dense and MoE
layers side by side, renormalised and raw top-k routing, tied embeddings, conv widths 3 and 4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny import save_tokenizer, spread_parameters

QWEN_COMMON = dict(
    vocab_size=288,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    eos_token_id=2,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24)  # fmt: skip
VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=16)  # fmt: skip

# name -> (transformers config class, model class, config kwargs); a `text_config` kwarg makes
# a vision checkpoint (its vision tower tiny and random: baton skips it).
GDN_CONFIGS: dict[str, tuple[str, str, dict]] = {
    # Qwen3-Next: MoE in every layer, R = 2, dk 8 != dv 12, partial rotary 0.25 (default).
    "qwen3_next_moe": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            QWEN_COMMON,
            **MOE,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            intermediate_size=48,
        ),
    ),  # fmt: skip
    # Qwen3-Next: attention first and last, MoE every 2nd layer plus a dense mlp_only layer,
    # raw (not renormalised) top-k, R = 1, conv 3, rotary 0.5 with its own theta.
    "qwen3_next_mixed": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            QWEN_COMMON,
            **MOE,
            num_hidden_layers=4,
            layer_types=[
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            norm_topk_prob=False,
            linear_num_key_heads=3,
            linear_num_value_heads=3,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=3,
            intermediate_size=40,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),  # fmt: skip
    # Qwen3.5 dense: R = 3, MQA (4 heads on 1 KV head), tied embeddings.
    "qwen3_5_dense": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            QWEN_COMMON,
            num_hidden_layers=4,
            num_key_value_heads=1,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            intermediate_size=96,
            tie_word_embeddings=True,
        ),
    ),  # fmt: skip
    # Qwen3.5 dense as the published vision checkpoint (text_config, model.language_model.,
    # mrope_section in the rope parameters), attention first and last.
    "qwen3_5_vision": (
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        dict(
            vision_config=VISION,
            text_config=dict(
                QWEN_COMMON,
                num_hidden_layers=4,
                layer_types=[
                    "full_attention",
                    "linear_attention",
                    "linear_attention",
                    "full_attention",
                ],
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                intermediate_size=48,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": [1, 1, 0],
                    "mrope_interleaved": True,
                },
            ),
        ),
    ),  # fmt: skip
    # Qwen3.5 MoE: MoE in every layer (always renormalised), R = 2.
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            QWEN_COMMON,
            **MOE,
            num_hidden_layers=4,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
    ),  # fmt: skip
    "qwen3_5_moe_vision": (
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
        dict(
            vision_config=VISION,
            text_config=dict(
                QWEN_COMMON,
                **MOE,
                num_hidden_layers=3,
                layer_types=["linear_attention", "linear_attention", "full_attention"],
                linear_num_key_heads=1,
                linear_num_value_heads=2,
                linear_key_head_dim=16,
                linear_value_head_dim=8,
            ),
        ),
    ),  # fmt: skip
    # OLMo-Hybrid as released: NoPE (rope_parameters {"rope_theta": null}), R = 1 with
    # dv = 2 dk (transformers' defaults), beta x 2, weights under the release's names; GQA 4/2.
    "olmo_hybrid_nope": (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(
            vocab_size=288,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            rope_theta=None,
            max_position_embeddings=4096,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),  # fmt: skip
    # OLMo-Hybrid with rotary over whole heads, attention first and last, R = 2, conv 3,
    # linear_allow_neg_eigval off (beta in [0, 1]).
    "olmo_hybrid_rope": (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(
            vocab_size=288,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=4,
            layer_types=[
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            num_attention_heads=4,
            num_key_value_heads=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=3,
            linear_allow_neg_eigval=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
            max_position_embeddings=4096,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),  # fmt: skip
}


GDNSpec = tuple[str, str, dict]  # (transformers config class, model class, config kwargs)


def build_gdn_model(name: str | GDNSpec, seed: int):
    """The transformers model of GDN_CONFIGS[name] (or of a spec), fp32, eval mode, parameters
    spread."""
    import transformers

    config_class, model_class, kwargs = GDN_CONFIGS[name] if isinstance(name, str) else name
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    spread_parameters(model)
    return model


def save_gdn_model(path: Path, name: str | GDNSpec, seed: int):
    """build_gdn_model, saved with save_pretrained plus the tiny tokenizer; returns it."""
    model = build_gdn_model(name, seed)
    model.save_pretrained(str(path))
    text = model.config.get_text_config()
    save_tokenizer(path, vocab_size=text.vocab_size)
    if model.config.model_type == "olmo_hybrid":
        _write_olmo_release_layout(path, model, release_names=name == "olmo_hybrid_nope")
    return model


def _write_olmo_release_layout(path: Path, model, release_names: bool) -> None:
    """transformers 5.24 saves OLMo-Hybrid's concatenated conv back as three equal thirds; the
    released checkpoint cuts it at the q | k | v widths. Write that. release_names: the
    release's tensor names (the model's own: `input_layernorm`...), else the names
    save_pretrained writes (`attention_layer_norm`...), which transformers also reads."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = (
        {n: t.contiguous() for n, t in model.state_dict().items()}
        if release_names
        else load_file(str(file))
    )
    c = model.config
    key, value = (
        c.linear_num_key_heads * c.linear_key_head_dim,
        (c.linear_num_value_heads * c.linear_value_head_dim),
    )
    for layer in range(c.num_hidden_layers):
        prefix = f"model.layers.{layer}.linear_attn."
        names = [f"{prefix}{p}_conv1d.weight" for p in "qkv"]
        whole = tensors.pop(prefix + "conv1d.weight", None)
        if whole is None and names[0] in tensors:
            whole = torch.cat([tensors[n] for n in names])
        if whole is not None:
            for n, part in zip(names, whole.split([key, key, value])):
                tensors[n] = part.contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def gdn_models(tmp_path_factory):
    """name -> (model_dir, transformers model), built once per session, seeded by the name's
    place in its config list (the same weights alone and in the whole suite)."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(f"gdn-{name}")
            built[name] = (
                path,
                save_gdn_model(path, name, seed=300 + list(GDN_CONFIGS).index(name)),
            )
        return built[name]

    return get
