"""deploy/ run on this machine (tests/deploy_local.py: two prefill and two decode pods of the
shipped model and the router, each with its manifest's command and environment, the router
finding the pods through a stub Kubernetes API): it answers through its router; cache-aware
routing on a multi-turn workload against one pair's prefix hits (the manifest's router has no
--tokenizer: it learns the tokenizer from the pods); workers added, removed and killed while
traffic runs. The pods are shared by the module's tests, in order; the last one
kills one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.bench.serving.multi_turn import MultiTurnWorkload, answers, run_multi_turn
from baton.server.openai.protocol import ChatCompletionRequest
from baton.server.router.prompt import routing_tokens
from baton.server.tokenizer import Tokenizer
from baton.server.tokenizer_bundle import TokenizerBundle
from tests.deploy_local import ASSETS, LocalDeployment
from tests.server_process import children_of, launch_router, wait_ready

KEY = "sesame"  # the admin routes need the router's key; the workers check none
AUTH = {"Authorization": f"Bearer {KEY}"}


def workload(seed: int) -> MultiTurnWorkload:
    return MultiTurnWorkload(
        conversations=6, turns=3, system_len=64, first_len=160, turn_len=48, output_len=12,
        seed=seed, vocab_size=json.loads((ASSETS / "config.json").read_text())["vocab_size"],
    )  # fmt: skip


def samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(url: str, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in samples(url).items()
        if sample == name and all((k, v) in sample_labels for k, v in labels.items())
    )


def hit_tokens(workers) -> float:
    return sum(total(w.base_url, "baton:prefix_cache_hits_total") for w in workers)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("many-workers")


@pytest.fixture(scope="module")
def deployment(logs):
    local = LocalDeployment(logs)
    try:
        yield local.start()
    finally:
        local.stop()


@pytest.fixture(scope="module")
def fleet(deployment):
    return {role: [pod.server for pod in pods] for role, pods in deployment.pods.items()}


@pytest.fixture(scope="module")
def routers(deployment, fleet, logs):
    """The deployment's router (cache_aware, the pods found by label), and a round-robin router
    given one pair; the other pair is added to it later, through its admin routes."""
    pair = launch_router(
        logs, [fleet["prefill"][0].base_url], [fleet["decode"][0].base_url], api_key=KEY
    )
    wait_ready(pair)
    yield {"cache_aware": deployment.router, "round_robin": pair}
    pair.stop()


def run(router, seed: int):
    return asyncio.run(run_multi_turn(router.base_url, workload(seed), concurrency=4, api_key=KEY))


def add(router, *workers) -> None:
    for worker in workers:  # roles from their /disagg/info
        answer = httpx.post(
            f"{router.base_url}/workers", json={"url": worker.base_url}, headers=AUTH, timeout=30
        )
        assert answer.status_code == 200 and answer.json()["healthy"], answer.text


def test_the_deployment_answers_a_completion_through_its_router(routers, fleet):
    body = {"prompt": "Question: Tom has 13 apples and buys 24 more.", "max_tokens": 12}
    through = httpx.post(f"{routers['cache_aware'].base_url}/v1/completions", json=body, timeout=60)
    assert through.status_code == 200, through.text
    pair = httpx.post(
        f"{routers['round_robin'].base_url}/v1/completions", json=body, headers=AUTH, timeout=60
    )
    assert through.json()["choices"][0]["text"] == pair.json()["choices"][0]["text"]
    listed = {w.base_url for pods in fleet.values() for w in pods}
    assert len(listed) == 4 and all(url.startswith("http://127.0.0.") for url in listed)


def test_cache_aware_gets_nine_tenths_of_one_pairs_prefix_hits(fleet, routers, record_property):
    """Each run has conversations of its own (a seed each: nothing cached by another run is
    reused) of the same lengths (the same cache geometry), so hit tokens compare. One pair
    first (the round-robin router before its second pair is added), then both policies over
    the four workers."""
    workers = fleet["prefill"] + fleet["decode"]
    hits = {}
    for seed, name in enumerate(("one pair", "cache_aware", "round_robin"), start=11):
        if name == "round_robin":
            add(routers["round_robin"], fleet["prefill"][1], fleet["decode"][1])
        before = hit_tokens(workers)
        results = run(routers["round_robin" if name == "one pair" else name], seed)
        hits[name] = hit_tokens(workers) - before
        assert len(results) == 18
    record_property("prefix_hit_tokens", hits)
    print(f"prefix-cache hit tokens (prefill + decode workers): {hits}")
    assert hits["one pair"] > 0
    assert hits["cache_aware"] >= 0.9 * hits["one pair"], hits
    metrics = routers["cache_aware"].base_url
    assert total(metrics, "baton:router_cache_aware_hits_total", role="prefill") > 0
    assert total(metrics, "baton:router_cache_aware_hits_total", role="decode") > 0


def test_outputs_are_the_same_whatever_the_policy(routers):
    reference = answers(run(routers["cache_aware"], 12))
    assert all(len(ids) == 12 for ids in reference.values())
    assert answers(run(routers["round_robin"], 12)) == reference


def test_the_router_tokenizes_a_chat_as_the_workers_do(fleet):
    """With the tokenizer a worker hands out (what the deployment's router, given no
    --tokenizer, matches prompts with), and with the model directory's."""
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Question: Tom has 3 apples and buys 4 more.\nAnswer:"},
        {"role": "assistant", "content": " 7"},
        {"role": "user", "content": "And then 5 more?"},
    ]
    request = ChatCompletionRequest.model_validate({"messages": messages})
    worker = fleet["decode"][0]
    with worker.http() as http:
        expected = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        announced = http.get("/disagg/info").json()["model"]
        bundle = TokenizerBundle.from_json(http.get("/disagg/tokenizer").json())
    assert bundle.digest == announced["tokenizer_digest"]
    others = [w for pods in fleet.values() for w in pods if w is not worker]
    assert all(httpx.get(f"{w.base_url}/disagg/info").json()["model"] == announced for w in others)
    assert routing_tokens(bundle.load(), request) == expected
    assert routing_tokens(Tokenizer(str(ASSETS)), request) == expected


class Traffic:
    """Requests sent one after another from a thread until stopped; every answer kept."""

    def __init__(self, url: str) -> None:
        self.url, self.statuses, self.stopped = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        body = {"prompt": list(range(5, 60)), "max_tokens": 4, "temperature": 0}
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=60) as client:
            while not self.stopped.is_set():
                self.statuses.append(client.post("/v1/completions", json=body).status_code)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join(60)


def test_a_worker_added_while_traffic_runs_gets_requests_within_seconds(fleet, routers):
    router, url = routers["round_robin"], routers["round_robin"].base_url
    for worker in (fleet["prefill"][1], fleet["decode"][1]):  # back to one pair
        httpx.delete(f"{url}/workers", params={"url": worker.base_url}, headers=AUTH)
    while len(httpx.get(f"{url}/workers", headers=AUTH).json()["workers"]) > 2:
        time.sleep(0.05)
    with Traffic(url) as traffic:
        time.sleep(0.5)
        added_at = time.monotonic()
        add(router, fleet["prefill"][1], fleet["decode"][1])
        while not all(
            total(url, "baton:router_worker_requests_total", worker=w.base_url) > 0
            for w in (fleet["prefill"][1], fleet["decode"][1])
        ):
            assert time.monotonic() - added_at < 5, "the new workers got no request in 5 s"
            time.sleep(0.05)
        time.sleep(0.3)
    assert traffic.statuses and set(traffic.statuses) == {200}


def test_a_removed_worker_finishes_its_streams_and_nothing_new_reaches_it(fleet, routers):
    url, leaving = routers["round_robin"].base_url, fleet["decode"][1]
    body = {"prompt": list(range(5, 40)), "max_tokens": 300, "ignore_eos": True, "stream": True}
    client = httpx.Client(base_url=url, headers=AUTH, timeout=120)
    streams = [client.stream("POST", "/v1/completions", json=body) for _ in range(2)]
    responses = [stream.__enter__() for stream in streams]  # round robin: one on each decode
    lines = [response.iter_lines() for response in responses]
    firsts = [next(line for line in it if line.startswith("data:")) for it in lines]
    assert all('"text"' in first for first in firsts)
    assert total(url, "baton:router_worker_requests_running", worker=leaving.base_url) == 1
    arrived = total(leaving.base_url, "baton:prompt_tokens_total")  # counted at arrival
    removed = httpx.delete(f"{url}/workers", params={"url": leaving.base_url}, headers=AUTH)
    assert removed.status_code == 200 and removed.json()["draining"], removed.text
    for _ in range(4):
        answer = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert answer.status_code == 200
    for first, it, stream in zip(firsts, lines, streams):
        chunks = [first] + [line for line in it if line.startswith("data:")]
        assert chunks[-1] == "data: [DONE]" and not any('"error"' in c for c in chunks)
        assert json.loads(chunks[-2][5:])["choices"][0]["finish_reason"] == "length"
        stream.__exit__(None, None, None)
    client.close()
    assert total(leaving.base_url, "baton:prompt_tokens_total") == arrived  # nothing new
    listed = httpx.get(f"{url}/workers", headers=AUTH).json()["workers"]
    assert leaving.base_url not in {w["url"] for w in listed}


def test_killing_a_prefill_worker_retries_what_it_held_and_no_client_sees_it(fleet, routers):
    """Long prompts keep both prefill workers busy; one is killed (SIGKILL, with its engine)
    while it holds requests. Those had not started streaming: they are tried again on the other
    one, and every client gets the whole answer once, as the surviving workers give it."""
    router, p2 = routers["round_robin"], fleet["prefill"][1]
    retried = total(router.base_url, "baton:router_retries_total", worker=p2.base_url)
    prompts = [[5 + (i * 7 + j) % 300 for j in range(1200)] for i in range(10)]

    async def stream_all() -> list[str]:
        async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=120) as client:

            async def one(prompt: list[int]) -> str:
                body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}
                text = []
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data:") and line != "data: [DONE]":
                            chunk = json.loads(line[5:])
                            assert "error" not in chunk, chunk
                            text.append(chunk["choices"][0]["text"])
                return "".join(text)

            return await asyncio.gather(*(one(p) for p in prompts))

    def kill_p2_once_it_holds_requests() -> None:
        running = "baton:router_worker_requests_running"
        deadline = time.monotonic() + 60
        while total(router.base_url, running, worker=p2.base_url) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for pid in [*children_of(p2.process.pid), p2.process.pid]:
            os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_p2_once_it_holds_requests)
    killer.start()
    texts = asyncio.run(stream_all())
    killer.join()
    assert p2.process.wait(10) == -signal.SIGKILL
    assert total(router.base_url, "baton:router_retries_total", worker=p2.base_url) > retried
    with httpx.Client(base_url=router.base_url, headers=AUTH, timeout=120) as client:
        for prompt, text in zip(prompts, texts):
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
            alone = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            assert text == alone
