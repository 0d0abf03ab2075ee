"""LoRA adapters under tensor parallelism (gloo, two CPU processes): each rank reads its slice
of A and B by its base weight's rule (column-parallel: B's rows; row-parallel: A's columns) and
writes the slot rank 0 writes (LoadAdapterSlot); TP=2 gives transformers + PEFT's greedy tokens,
adapters and the base mixed in one batch, slots swapped while it runs (max_loras=1)."""

from __future__ import annotations

from baton import LLM, LoRARequest, SamplingParams
from tests.lora_models import make_adapter
from tests.reference import hf_greedy
from tests.tiny import save_tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 42, 9, 33, 8, 71], [100, 3, 64, 12, 7, 250, 19, 2]]


def test_tp2_adapters_match_transformers_peft(tmp_path):
    hf = save_tiny_model(tmp_path / "model", seed=17)
    refs = {None: hf}
    for i, name in enumerate(("a", "b")):
        refs[name] = make_adapter(hf, tmp_path / name, TARGETS, seed=70 + i)
    jobs = [(p, n) for p in PROMPTS for n in ("a", None, "b")]
    lora = [None if n is None else LoRARequest(n, 1 + (n == "b"), str(tmp_path / n))
            for _, n in jobs]  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for max_loras in (2, 1):
        with LLM(tmp_path / "model", tensor_parallel_size=2, enable_lora=True,
                 max_loras=max_loras, max_lora_rank=8) as llm:  # fmt: skip
            outs = llm.generate([p for p, _ in jobs], params, lora_request=lora)
        for (prompt, name), out in zip(jobs, outs):
            assert out.token_ids == hf_greedy(refs[name], prompt, 6)[0], (max_loras, name)
