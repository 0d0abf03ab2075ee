"""PEFT adapters on tiny hybrids, made at test time: `get_peft_model` + LoraConfig with random
non-zero B (PEFT starts B at zero: `init_lora_weights=False`, then every A/B redrawn small
enough that the adapted model is a different model, not noise), saved with `save_pretrained`."""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def make_adapter(hf_model, path: Path, targets, seed: int, r: int = 4, **config):
    """Save a LoRA adapter of `hf_model` (left untouched) at `path`; return the PEFT model
    (fp32, eval) that is its reference."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(
        copy.deepcopy(hf_model),
        LoraConfig(
            r=r,
            lora_alpha=config.pop("lora_alpha", 2 * r),
            target_modules=targets,
            init_lora_weights=False,
            **config,
        ),
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn_like(param) * (0.6 / param.shape[-1] ** 0.5))
    peft_model.eval()
    peft_model.save_pretrained(str(path))
    return peft_model


def assert_mixed_batch_matches(llm, adapters: dict, hf, prompts: list, new: int) -> None:
    """Every prompt under every adapter ({name: (dir, PEFT model)}) and the base, in one
    generate call (one batch): each gets its reference's greedy tokens."""
    from baton import LoRARequest, SamplingParams
    from tests.reference import hf_greedy

    jobs = [(p, name) for p in prompts for name in (*adapters, None)]
    requests = [
        None if name is None else LoRARequest(name, i + 1, str(adapters[name][0]))
        for i, (_, name) in enumerate(jobs)
    ]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    outs = llm.generate([p for p, _ in jobs], params, lora_request=requests)
    for (prompt, name), out in zip(jobs, outs):
        reference = hf if name is None else adapters[name][1]
        assert out.token_ids == hf_greedy(reference, prompt, new)[0], f"adapter {name}, {prompt}"
