"""LoRA adapters through `baton serve` (vLLM's flags and routes): /v1/models lists them with the
base as `parent`, a request's `model` = an adapter's name selects it (tokens = transformers +
PEFT), adapters load and unload at run time behind --api-key, unknown or refused ones are
answered with the OpenAI error shape naming what is wrong."""

from __future__ import annotations

import json

import pytest

from tests.lora_models import make_adapter
from tests.reference import hf_greedy
from tests.server_process import start_server
from tests.tiny import save_tiny_model

TARGETS = ["q_proj", "v_proj", "in_proj", "down_proj"]
PROMPT = [5, 17, 42, 9, 33, 8, 71]
KEY = "sk-lora"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-http")
    hf = save_tiny_model(root / "model", seed=5)
    adapters = {
        name: (root / name, make_adapter(hf, root / name, TARGETS, seed=50 + i))
        for i, name in enumerate(("sql", "poem"))
    }
    bad = root / "bad"
    make_adapter(hf, bad, ["q_proj"], seed=1, modules_to_save=["lm_head"])
    server = start_server(
        root / "model", root, "--enable-lora", "--lora-modules", f"sql={adapters['sql'][0]}",
        "--max-loras", "2", "--max-lora-rank", "8", api_key=KEY,
    )  # fmt: skip
    yield server, adapters, hf, bad
    server.stop()


def completion(http, model, prompt=PROMPT):
    return http.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },  # fmt: skip
    )


def tokens(response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_models_lists_adapters_with_their_parent(served):
    server, adapters, _, _ = served
    data = server.http().get("/v1/models").json()["data"]
    base, sql = data[0], {m["id"]: m for m in data}["sql"]
    assert sql["parent"] == base["id"] and sql["root"] == str(adapters["sql"][0])


def test_model_name_selects_the_adapter(served):
    server, adapters, hf, _ = served
    http = server.http()
    base_name = http.get("/v1/models").json()["data"][0]["id"]
    assert tokens(completion(http, "sql")) == hf_greedy(adapters["sql"][1], PROMPT, 6)[0]
    assert tokens(completion(http, base_name)) == hf_greedy(hf, PROMPT, 6)[0]
    # chat (and the official client) take the adapter's name as well
    chat = server.client().chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "sql" and chat.choices[0].message.content is not None


def test_unknown_model_is_404_in_openai_shape(served):
    server, *_ = served
    response = completion(server.http(), "no-such-adapter")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_adapter_loaded_and_unloaded_at_run_time(served):
    server, adapters, _, _ = served
    http = server.http()
    body = {"lora_name": "poem", "lora_path": str(adapters["poem"][0])}
    assert (
        http.post("/v1/load_lora_adapter", json=body, headers={"Authorization": ""}).status_code
        == 401
    )
    loaded = http.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    assert "poem" in {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert tokens(completion(http, "poem")) == hf_greedy(adapters["poem"][1], PROMPT, 6)[0]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "poem"}).status_code == 200
    assert completion(http, "poem").status_code == 404
    again = http.post("/v1/unload_lora_adapter", json={"lora_name": "poem"})
    assert again.status_code == 404 and again.json()["error"]["message"]


def test_refused_adapter_is_400_naming_why(served, tmp_path):
    server, _, _, bad = served
    http = server.http()
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert response.status_code == 400
    assert "modules_to_save" in response.json()["error"]["message"]
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    missing = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}
    )
    assert missing.status_code == 400 and "adapter_model.safetensors" in missing.text
    assert "bad" not in {m["id"] for m in http.get("/v1/models").json()["data"]}
    # damaged files: refused, and the engine lives on
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    damaged = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}
    )
    assert damaged.status_code == 400 and "cannot read" in damaged.text, damaged.text
    (tmp_path / "adapter_config.json").write_text("[1, 2]")
    listed = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert listed.status_code == 400 and "JSON object" in listed.text, listed.text
    assert tokens(completion(http, "sql"))  # still serving
