"""Tiny random models of the sliding-window families (LFM3, RecurrentGemma), built by transformers 5.25 (fp32,
fixed seeds, parameters spread like tests/tiny.py) with tests/families.py's builder, saved with
save_pretrained plus the tiny tokenizer, and shared per session.

Every window is shorter than the longer test prompts (23 and 70 tokens in tests/test_gdn_models.py),
so the windows really cut what a query sees.

    lfm3_mixed     transformers' LFM3 layout in small (conv, sliding, full, conv): the release's
                   per-type rope (default on sliding layers, proportional with factor 0.5 on full
                   ones), sandwich norms, the attention gate, GQA 4/2, window 16, conv 3
    lfm3_sliding   every attention layer sliding (no full attention: the pages behind the window
                   are released during decode), no sandwich norms, no gate, MQA, window 10 (not
                   a multiple of the page size), its own rope theta, untied lm_head
    rgemma_local   RecurrentGemma's release pattern (recurrent, recurrent, attention) over 4
                   layers: RG-LRU of width 64 (4 gate blocks of 16, wider than hidden 48), local
                   MQA attention with window 10 (its only paged kind: pages are released),
                   Gemma's bf16-rounded embedding scale (sqrt 48), tied lm_head, soft cap 30
    rgemma_gqa     attention first (attention, recurrent), GQA 4/2 with q/k/v biases, window 16,
                   conv width 3, its own rope theta and partial rotary, soft cap 5 (it bites),
                   untied lm_head
    rgemma_hawk    recurrent blocks only (Griffin's "Hawk"): no paged state at all, so the CPU
                   decode step is captured (tests/test_cpu_plan.py; a step over windowed
                   attention only stays eager: the executor's choice)
"""

from __future__ import annotations

import pytest

from tests.families import save_model

WINDOW_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "lfm3_mixed": (
        "Lfm3Config",
        "Lfm3ForCausalLM",
        dict(
            vocab_size=288,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            layer_types=["conv", "sliding_attention", "full_attention", "conv"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=16,
            conv_L_cache=3,
            max_position_embeddings=4096,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "lfm3_sliding": (
        "Lfm3Config",
        "Lfm3ForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "conv", "sliding_attention"],
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=12,
            sliding_window=10,
            conv_L_cache=3,
            use_sandwich_norm=False,
            use_attention_gate=False,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "rgemma_local": (
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        dict(
            vocab_size=288,
            hidden_size=48,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            lru_width=64,
            attention_window_size=10,
            conv1d_width=4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "rgemma_gqa": (
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            block_types=["attention", "recurrent"],
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            attention_window_size=16,
            conv1d_width=3,
            logits_soft_cap=5.0,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.25,
            },
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}
# Beside them, without a window (no paged state): the recurrent block alone.
RECURRENT_ONLY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "rgemma_hawk": (
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        dict(
            vocab_size=280,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            block_types=["recurrent"],
            num_attention_heads=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}


@pytest.fixture(scope="session")
def window_models(tmp_path_factory):
    """name -> (model_dir, transformers model), built once per session, seeded by the name's
    place in its config list (the same weights alone and in the whole suite)."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(f"window-{name}")
            configs = WINDOW_CONFIGS | RECURRENT_ONLY_CONFIGS
            seed = 700 + list(configs).index(name)
            built[name] = (path, save_model(path, *configs[name], seed=seed))
        return built[name]

    return get


def preempting(model_dir, vocab: int, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    """The prompts and engine arguments (tests/test_gdn_models.py's ENGINE) under which one of
    the three test prompts' requests is preempted for memory. A model whose every paged kind
    is windowed gives its pages back between prefill chunks too, so the three prompts fit the
    21 pages one chunk at a time: three more 70-token prompts, prefilled four at a time, make
    a request preempted there."""
    import torch

    from baton.engine.config import ModelConfig
    from baton.engine.models.registry import model_state_spec
    from tests.test_gdn_models import ENGINE

    spec = model_state_spec(ModelConfig.from_hf(model_dir), torch.float32)
    if spec.page_tables > 1 or spec.page_window is None:
        return prompts, ENGINE
    g = torch.Generator().manual_seed(12)
    more = [torch.randint(3, vocab, (70,), generator=g).tolist() for _ in range(3)]
    return prompts + more, ENGINE | dict(max_num_batched_tokens=64)
