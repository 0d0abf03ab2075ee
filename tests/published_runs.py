"""A published config.json, shrunk in sizes only, built by transformers from that file and run
by baton from that same file: greedy tokens and prompt logprobs must be transformers' (fp32).
The test files of the published configs (tests/test_*_published_config.py) share it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from baton import LLM, SamplingParams
from tests.test_gdn_models import assert_matches_transformers
from tests.tiny import save_tokenizer, spread_parameters


def prompt_ids(seed: int, lengths: tuple[int, ...], high: int) -> list[list[int]]:
    """Random prompts of `lengths` ids in [3, high)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, high, (n,), generator=g).tolist() for n in lengths]


def assert_runs_as_transformers(
    model_dir: Path,
    raw: dict,
    model_class: str,
    *,
    model_seed: int,
    prompts: list[list[int]],
    max_tokens: int,
    **llm_args,
) -> None:
    """`raw` written as model_dir's config.json, transformers' `model_class` built from it with
    spread random weights and saved beside it (the file itself, not transformers' re-save),
    then baton's LLM(model_dir, **llm_args) against it on `prompts`."""
    import transformers

    (model_dir / "config.json").write_text(json.dumps(raw))
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(model_seed)
    hf = getattr(transformers, model_class)(config).float().eval()
    spread_parameters(hf)
    hf.save_pretrained(model_dir)
    (model_dir / "config.json").write_text(json.dumps(raw))  # the published file, not a re-save
    save_tokenizer(model_dir, vocab_size=raw["vocab_size"])
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)  # fmt: skip
    outs = LLM(model_dir, **llm_args).generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out)
