"""transformers as the reference: greedy generations with per-step logprobs, and the tie rule."""

from __future__ import annotations

import torch

TIE_GAP = 1e-5  # top-2 logprob gap under which a greedy divergence is a tie, not a bug


@torch.no_grad()
def _cache_kwargs(hf_model) -> dict:
    """transformers' hybrid cache cannot tell its length without an attention layer
    (`get_seq_length` raises), so a Mamba-only model runs without one: every step recomputes
    the whole sequence, the naive oracle. Since transformers 5.25 the cache asks its first layer
    only, and a NemotronH whose first layer is an MLP or MoE keeps a `DummyLayer` there that
    cannot answer ("'DummyLayer' object has no attribute 'get_seq_length'"): such a model runs
    without a cache too (recomputed and cached logits differ by ~3e-7 in fp32, NOTES.md)."""
    config = hf_model.config.get_text_config()
    pattern = getattr(config, "hybrid_override_pattern", None)
    if pattern is not None:  # NemotronH
        has_attention = "*" in pattern and pattern[0] not in "-E"
    else:  # the other families name their layers (Jamba, LFM2, the pure SSMs: layer_types)
        kinds = getattr(config, "layers_block_type", None) or config.layer_types
        has_attention = bool({"full_attention", "attention"} & set(kinds))
    return {} if has_attention else {"use_cache": False}


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the (steps, vocab) logprobs the reference computed at each step."""
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **_cache_kwargs(hf_model),
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)
    return tokens, logprobs


@torch.no_grad()
def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """(len(prompt), vocab) logprobs; row i predicts token i + 1."""
    return (
        hf_model(torch.tensor([prompt]), **_cache_kwargs(hf_model))
        .logits[0]
        .float()
        .log_softmax(-1)
    )


def assert_greedy_matches(
    ours: list[int], ref: list[int], ref_logprobs: torch.Tensor, what: str = ""
) -> int:
    """Tokens must agree until a divergence that happens exactly at a reference near-tie
    (top-2 logprobs within TIE_GAP): that is float noise, not a bug, and comparison stops there.
    Returns the number of positions compared."""
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens vs reference {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = ref_logprobs[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE_GAP, (
                f"{what}: token {i} differs ({a} vs reference {b}) with a top-2 gap of {gap:.2e}"
            )
            return i
    return len(ref)
