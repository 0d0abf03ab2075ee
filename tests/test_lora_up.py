"""`baton up --enable-lora --lora-modules NAME=PATH`: both workers of the pair serve the adapter,
the router passes the request on, and the adapter's name as `model` gives transformers + PEFT's
tokens (the prefill worker's first token and the decode worker's others)."""

from __future__ import annotations

import httpx

from tests.lora_models import make_adapter
from tests.reference import hf_greedy
from tests.server_process import Stack
from tests.tiny import save_tiny_model

PROMPT = [5, 17, 42, 9, 33, 8, 71]


def test_up_serves_an_adapter_by_name_through_the_pair(tmp_path):
    hf = save_tiny_model(tmp_path / "model", seed=19)
    peft_model = make_adapter(
        hf, tmp_path / "tuned", ["q_proj", "v_proj", "in_proj", "up_proj"], seed=80
    )
    late_model = make_adapter(hf, tmp_path / "late", ["k_proj", "o_proj"], seed=81)
    stack = Stack(tmp_path / "model", tmp_path / "up.log", "--enable-lora",
                  "--lora-modules", f"tuned={tmp_path / 'tuned'}", "--max-lora-rank", "8")  # fmt: skip
    try:
        base = f"http://127.0.0.1:{stack.port}"
        ids = {m["id"] for m in httpx.get(f"{base}/v1/models", timeout=30).json()["data"]}
        assert "tuned" in ids
        body = {"model": "tuned", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == hf_greedy(peft_model, PROMPT, 6)[0]
        unknown = httpx.post(f"{base}/v1/completions", json=body | {"model": "nope"}, timeout=60)
        assert unknown.status_code == 404, unknown.text
        # loaded at run time through the router: on both workers
        load = {"lora_name": "late", "lora_path": str(tmp_path / "late")}
        loaded = httpx.post(f"{base}/v1/load_lora_adapter", json=load, timeout=60)
        assert loaded.status_code == 200, loaded.text
        late = httpx.post(f"{base}/v1/completions", json=body | {"model": "late"}, timeout=60)
        assert late.json()["choices"][0]["token_ids"] == hf_greedy(late_model, PROMPT, 6)[0]
        refused = httpx.post(f"{base}/v1/load_lora_adapter", json=load, timeout=60)
        assert refused.status_code == 400 and "already taken" in refused.text, refused.text
    finally:
        stack.stop()
