"""One model behind a router, and its tokenizer learned from the workers (issue 51): cache_aware
needs no --tokenizer; a worker of another model is refused, naming both; the tokenizer files a
worker sends are checked before they are loaded. In process against fake workers, and the wire
form of a worker's tokenizer (server/tokenizer_bundle.py) on its own."""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import pytest

from baton.server.router.info import WorkerInfo
from baton.server.tokenizer import Tokenizer
from baton.server.tokenizer_bundle import MAX_BUNDLE_BYTES, TokenizerBundle, model_identity
from tests.router_fakes import ASSETS, BUNDLE, MODEL, FakeWorker, Fleet
from tests.test_router_hostile import AUTH, KEY, listed, openai_error, until
from tests.test_router_retries import FAST, serve

CACHE_AWARE = dataclasses.replace(FAST, prefill_policy="cache_aware", decode_policy="cache_aware")
PROMPT = "Question: Tom has 13 apples and buys 24 more. How many apples does he have?"


def other_model(name: str = "other") -> tuple[dict, TokenizerBundle]:
    """Another model: the shipped tokenizer with a chat template of its own."""
    bundle = TokenizerBundle(files=dict(BUNDLE.files), chat_template="{{ messages }}")
    return model_identity(name, str(ASSETS), bundle), bundle


def test_cache_aware_without_a_tokenizer_learns_it_from_a_worker_before_it_is_ready():
    gate = asyncio.Event()
    fleet = Fleet(
        p1=FakeWorker("prefill", bundle_gate=gate),
        p2=FakeWorker("prefill", bundle_gate=gate),
        d1=FakeWorker("decode", bundle_gate=gate),
    )

    async def scenario(app, client):
        tokenizer = app.state.workers.tokenizer
        await asyncio.sleep(0.3)
        assert tokenizer.current is None
        assert (await client.get("/health")).status_code == 503  # not matched in tokens yet
        assert not any(w["healthy"] for w in (await listed(client)).values())
        gate.set()

        async def ready() -> bool:
            return (await client.get("/health")).status_code == 200

        await until(ready)
        expected = Tokenizer(str(ASSETS)).encode(PROMPT)
        assert tokenizer.current.encode(PROMPT) == expected
        for _ in range(3):  # one conversation: cache_aware keeps it on one prefill worker
            body = {"prompt": PROMPT, "max_tokens": 3}
            answer = await client.post("/v1/completions", json=body, headers=AUTH)
            assert answer.status_code == 200, answer.text
        assert sorted([fleet.served("p1"), fleet.served("p2")]) == [0, 3]

    asyncio.run(serve(fleet, scenario, routing=CACHE_AWARE, api_key=KEY))


def test_a_worker_of_another_model_is_refused_by_post_naming_both():
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode"))
    model, bundle = other_model()

    async def scenario(app, client):
        fleet.add("d2", FakeWorker("decode", model=model, bundle=bundle))
        for body in ({"url": Fleet.url("d2")}, {"url": Fleet.url("d2"), "role": "decode"}):
            error = openai_error(await client.post("/workers", json=body, headers=AUTH), 409)
            message = error["message"]
            assert error["param"] == "url"
            assert f"worker {Fleet.url('d2')} serves model 'other'" in message
            assert "'tiny'" in message and model["tokenizer_digest"][:12] in message
            assert MODEL["tokenizer_digest"][:12] in message
            assert Fleet.url("d2") not in await listed(client)  # nothing added

    asyncio.run(serve(fleet, scenario, routing=CACHE_AWARE, api_key=KEY))


def test_a_worker_of_another_model_on_the_command_line_stays_out_and_says_why():
    model, bundle = other_model("tiny")  # the same name, another chat template
    fleet = Fleet(
        p1=FakeWorker("prefill"),
        d1=FakeWorker("decode"),
        d2=FakeWorker("decode", model=model, bundle=bundle),
    )

    async def scenario(app, client):
        workers = await listed(client)
        refused = workers[Fleet.url("d2")]
        assert refused["healthy"] is False and refused["model"] is None
        assert "serves model 'tiny'" in refused["refused"], refused
        assert workers[Fleet.url("d1")]["refused"] is None
        for _ in range(4):
            answer = await client.post("/v1/completions", json={"prompt": "hi"}, headers=AUTH)
            assert answer.status_code == 200
        assert fleet.served("d2") == 0 and fleet.served("d1") == 4

    asyncio.run(serve(fleet, scenario, routing=CACHE_AWARE, api_key=KEY))


def test_when_every_worker_of_a_model_left_the_next_model_is_the_routers():
    model, bundle = other_model()
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode"))

    async def scenario(app, client):
        for name in ("p1", "d1"):
            await client.delete("/workers", params={"url": Fleet.url(name)}, headers=AUTH)
        for name, role in (("p2", "prefill"), ("d2", "decode")):
            url = fleet.add(name, FakeWorker(role, model=model, bundle=bundle))
            answer = await client.post("/workers", json={"url": url}, headers=AUTH)
            assert answer.status_code == 200, answer.text

        async def ready() -> bool:
            return (await client.get("/health")).status_code == 200

        await until(ready)
        assert app.state.workers.tokenizer.current.hf.chat_template == "{{ messages }}"

    asyncio.run(serve(fleet, scenario, routing=CACHE_AWARE, api_key=KEY))


def test_tokenizer_files_that_are_not_the_announced_ones_are_not_learned():
    model, _ = other_model()
    fleet = Fleet(p1=FakeWorker("prefill", model=model), d1=FakeWorker("decode", model=model))

    async def scenario(app, client):
        await asyncio.sleep(1.5)  # the start, a round of probes, each trying to learn
        assert app.state.workers.tokenizer.current is None
        assert (await client.get("/health")).status_code == 503

    asyncio.run(serve(fleet, scenario, routing=CACHE_AWARE, api_key=KEY))


def test_with_tokenizer_the_router_fetches_none_and_still_compares_workers():
    routing = dataclasses.replace(CACHE_AWARE, tokenizer=str(ASSETS))
    gate = asyncio.Event()  # never set: a fetch would never end
    model, bundle = other_model()
    fleet = Fleet(
        p1=FakeWorker("prefill", bundle_gate=gate),
        d1=FakeWorker("decode", bundle_gate=gate),
        d2=FakeWorker("decode", model=model, bundle=bundle),
    )

    async def scenario(app, client):
        assert (await client.get("/health")).status_code == 200
        assert (await listed(client))[Fleet.url("d2")]["refused"] is not None

    asyncio.run(serve(fleet, scenario, routing=routing, api_key=KEY))


# -- the wire form -----------------------------------------------------------------------------


def test_a_bundle_survives_the_wire_and_tokenizes_as_its_directory():
    sent = TokenizerBundle.from_directory(str(ASSETS), None)
    received = TokenizerBundle.from_json(sent.to_json())
    assert received == sent and received.digest == sent.digest
    assert set(received.files) == {"tokenizer.json", "tokenizer_config.json", "config.json"}
    expected = Tokenizer(str(ASSETS))
    loaded = received.load()
    assert loaded.encode(PROMPT) == expected.encode(PROMPT)
    assert loaded.hf.chat_template == expected.hf.chat_template


def test_a_chat_template_override_travels_and_changes_the_digest():
    plain = TokenizerBundle.from_directory(str(ASSETS), None)
    templated = TokenizerBundle.from_directory(str(ASSETS), "{{ messages[0].content }}")
    assert templated.digest != plain.digest
    assert TokenizerBundle.from_json(templated.to_json()).load().hf.chat_template == (
        "{{ messages[0].content }}"
    )


def _wire(**files: str) -> dict:
    return {"files": files, "chat_template": None}


GOOD = base64.b64encode(BUNDLE.files["tokenizer.json"]).decode()


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ([], "an object with files"),
        ({"files": {"../tokenizer.json": GOOD}}, "'../tokenizer.json' is not a tokenizer file"),
        ({"files": {"model.safetensors": GOOD}}, "is not a tokenizer file"),
        (_wire(**{"tokenizer.json": "not base64!"}), "not base64"),
        (_wire(**{"tokenizer.json": 5}), "base64 text"),
        (_wire(**{"config.json": GOOD}), "no tokenizer file"),
        ({"files": {"tokenizer.json": GOOD}, "chat_template": 3}, "chat_template"),
        (
            _wire(**{"tokenizer.json": base64.b64encode(b"x" * (MAX_BUNDLE_BYTES + 1)).decode()}),
            "more than",
        ),
    ],
)
def test_a_bundle_that_is_not_a_tokenizers_files_is_refused_naming_why(payload, named):
    with pytest.raises(ValueError, match=named):
        TokenizerBundle.from_json(payload)


def test_files_that_do_not_make_a_tokenizer_are_refused_when_loaded():
    broken = TokenizerBundle(files={"tokenizer.json": b"{not json"}, chat_template=None)
    with pytest.raises(ValueError, match="do not load as a tokenizer"):
        broken.load()


INFO = {"role": "decode", "page_size": 16, "track_interval": 64, "model": MODEL}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"page_size": True}, "page_size"),
        ({"page_size": 16.5}, "page_size"),
        ({"track_interval": 1 << 40}, "track_interval"),
        ({"role": ["decode"]}, "role"),
        ({"transfer_addr": "tcp://a b"}, "transfer_addr"),
        ({"transfer_addr": "x" * 300}, "transfer_addr"),
        ({"transfer_addr_token": "ab"}, "transfer_addr_token"),
        ({"transfer_addr_token": ["0" * 64]}, "transfer_addr_token"),
        ({"model": None}, "model must be an object"),
        ({"model": dict(MODEL, name="")}, "model.name"),
        ({"model": dict(MODEL, config_digest="abc")}, "model.config_digest"),
        ({"model": dict(MODEL, tokenizer_digest=5)}, "model.tokenizer_digest"),
    ],
)
def test_disagg_info_is_checked_field_by_field(change, named):
    assert WorkerInfo.from_json(INFO).model.name == "tiny"
    with pytest.raises(ValueError, match=named):
        WorkerInfo.from_json(INFO | change)
