"""Tiny NemotronH models built with transformers and saved like a real HF directory.

Weights are random (fixed seed, fp32); the tokenizer is a byte-level BPE trained offline on a
small corpus with digits split, plus a chat template, so the server and the detokenizer see a
real `tokenizer.json` / `tokenizer_config.json` pair.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: Tom has 3 apples and buys 4 more. How many apples does he have?",
    "Answer: 3 + 4 = 7. #### 7",
    "Hybrid Mamba2 and attention models serve long prompts with constant state.",
    "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🚀🎉 and more.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a relay race and a baton passed from hand to hand.",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 as NemotronH's config expects


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """Train a byte-level BPE with at most `vocab_size` tokens and save it in HF layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def tiny_config_kwargs(**overrides) -> dict:
    kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        hybrid_override_pattern="M*-M-M*",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return kwargs


def build_hf_model(seed: int = 0, **overrides):
    """A random NemotronH from transformers, in fp32, eval mode, aligned with baton's dt rule."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(**tiny_config_kwargs(**overrides))
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config).eval()
    spread_parameters(model)
    align_dt_limit(model)
    return model


def spread_parameters(model) -> None:
    """Random init leaves A_log/D/dt_bias near identity and weights tiny; spread them so the
    model's logits are not all ties and the state really matters (any hybrid family)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.rand_like(param) * 8 + 0.5))
            elif name.endswith("dt_bias"):
                dt = torch.exp(
                    torch.rand_like(param) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)
                )
                param.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith(".D"):
                param.copy_(torch.randn_like(param))
            elif param.dim() >= 2:
                param.normal_(0.0, 0.5 / math.sqrt(param.shape[-1]))
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # The MoE router's load-balancing bias (zeros at init): make it steer choices.
                buffer.copy_(0.05 * torch.randn_like(buffer))


def align_dt_limit(model) -> None:
    """transformers' torch prefill path clamps dt at `time_step_min`, its recurrent decode path
    does not clamp at all; the kernel semantics (and baton) clamp with `time_step_limit`.
    Make the reference use `time_step_limit` everywhere so both sides compute the same thing."""
    limit = getattr(model.config, "time_step_limit", None)
    if limit is None:  # Zamba2: its mixer sets (time_step_min, inf) itself; tests use min 0
        return
    limit = tuple(limit)
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = limit


def save_tiny_model(path: str | Path, seed: int = 0, tokenizer: bool = True, **overrides):
    """Build, save (safetensors, `backbone.` names) and return the transformers model."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_hf_model(seed=seed, **overrides)
    model.save_pretrained(str(path))
    if tokenizer:
        save_tokenizer(path, vocab_size=model.config.vocab_size)
    return model


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
