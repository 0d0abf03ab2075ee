"""Speculative decoding from the command line: vLLM's --speculative-config and SGLang's flags on
`baton serve` and `baton up` (the flags checked before anything starts, the checkpoint's MTP
layers by the engine at load), the counters on /metrics as vLLM names them, and live workers and
`baton up` stacks serving with drafts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest

from baton import LLM, SamplingParams
from baton.server.args import ServerArgs
from baton.server.metrics import ServerMetrics
from tests.mtp_models import add_mtp_layer
from tests.server_process import BATON, Stack, free_port, launch

ASSETS = Path(__file__).parents[1] / "assets"


@pytest.fixture(scope="module")
def mtp_model(tiny_models, tmp_path_factory):
    source, _ = tiny_models("base")
    dest = tmp_path_factory.mktemp("spec-serve") / "model"
    add_mtp_layer(source, dest, ["full_attention", "moe"])
    return dest


def test_vllm_and_sglang_flags_give_the_same_engine_config(mtp_model):
    vllm = ServerArgs(
        model=str(mtp_model), speculative_config='{"method": "mtp", "num_speculative_tokens": 3}'
    )
    sglang = ServerArgs(
        model=str(mtp_model),
        speculative_algorithm="NEXTN",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
    )
    assert vllm.engine_args()["speculative_config"] == sglang.engine_args()["speculative_config"]
    assert "speculative_config" not in ServerArgs(model=str(mtp_model)).engine_args()
    ngram = ServerArgs(
        model=str(mtp_model),
        speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
    )
    assert ngram.engine_args()["speculative_config"]["prompt_lookup_max"] == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(speculative_config='{"method": "eagle3"}'), "method 'eagle3' is not supported"),
        (dict(speculative_config='{"method": "ngram"}'), "needs num_speculative_tokens"),
        (
            dict(speculative_config='{"method": "mtp", "num_speculative_tokens": 0}'),
            r"num_speculative_tokens must be in \[1, 16\]",
        ),
        (dict(speculative_config='{"method": "mtp", "draft_tp": 2}'), r"unsupported key\(s\)"),
        (dict(speculative_config="[1]"), "must be a JSON object"),
        (
            dict(speculative_algorithm="NEXTN", speculative_num_steps=2, speculative_eagle_topk=4),
            "topk 1",
        ),
        (
            dict(
                speculative_algorithm="NEXTN",
                speculative_num_steps=2,
                speculative_num_draft_tokens=5,
            ),
            "must be --speculative-num-steps",
        ),
        (dict(speculative_num_steps=2), "needs --speculative-algorithm"),
        (
            dict(
                speculative_config='{"method": "ngram", "prompt_lookup_min": 4, '
                '"prompt_lookup_max": 2, "num_speculative_tokens": 2}'
            ),
            "prompt_lookup_min",
        ),
    ],
)
def test_bad_flags_are_refused_naming_what_is_wrong(mtp_model, flags, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model=str(mtp_model), **flags)


def test_mtp_on_a_checkpoint_without_mtp_layers_stops_the_server_naming_the_key(
    tiny_models, tmp_path
):
    """The server process keeps torch out, so the checkpoint's MTP layers are the engine's to
    check at load: `baton serve` exits, naming the key, instead of serving without drafts."""
    model_dir, _ = tiny_models("base")
    flags = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"]
    port = free_port()
    command = [str(BATON), "serve", "--model", str(model_dir), "--port", str(port), *flags]
    server = launch(command, port, tmp_path / "serve.log", None)
    assert server.process.wait(180) != 0
    assert "num_nextn_predict_layers = 0" in server.log(), server.log()[-3000:]


README_PROMPT = (
    "Question: A pen costs $12. Anna buys 4 pens and pays with $60. How much change does she get?"
    "\nAnswer:"
)


@pytest.mark.parametrize(
    "speculative",
    [
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
        '{"method": "mtp", "num_speculative_tokens": 2}',
    ],
    ids=["ngram", "mtp"],
)
def test_baton_up_serves_with_speculation_and_answers_as_without(speculative, tmp_path):
    """`baton up --speculative-config` on the shipped model (it has an MTP layer): the stack
    starts (its server processes hold no torch), answers the README's request as a plain
    stack does, and its decode worker counts drafts."""
    stack = Stack(ASSETS, tmp_path / "up.log", "--speculative-config", speculative)
    try:
        decode_port = int(re.search(r"-> decode :(\d+)", stack.log()).group(1))
        body = {"model": str(ASSETS), "prompt": README_PROMPT, "max_tokens": 48,
                "temperature": 0, "stop": ["Question"]}  # fmt: skip
        url = f"http://127.0.0.1:{stack.port}/v1/completions"
        answer = httpx.post(url, json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["text"]
        metrics = httpx.get(f"http://127.0.0.1:{decode_port}/metrics", timeout=30).text
    finally:
        stack.stop()
    assert stack.process.returncode == 0, stack.log()[-3000:]
    plain = LLM(str(ASSETS), dtype="float32").generate(
        [README_PROMPT], SamplingParams(max_tokens=48, temperature=0, stop=["Question"])
    )[0]
    assert text == plain.text
    drafts = re.search(r"^baton:spec_decode_num_drafts_total\S* (\S+)$", metrics, re.M)
    assert drafts is not None and float(drafts.group(1)) > 0, metrics


def test_up_gives_both_workers_the_speculative_config(mtp_model, monkeypatch):
    from baton.server import up
    from baton.server.cli import build_parser

    commands = {}

    class Spawned(Exception):
        pass

    def fake_popen(command, env=None, start_new_session=False):
        assert start_new_session  # a Ctrl-C reaches `up` only, which stops the parts in order
        role = (
            "router"
            if command[3] == "router"
            else command[command.index("--disaggregation-mode") + 1]
        )
        commands[role] = command
        if role == "router":
            raise Spawned
        return object()

    monkeypatch.setattr(up.subprocess, "Popen", fake_popen)
    ns = build_parser().parse_args(
        [
            "up",
            "--model",
            str(mtp_model),
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-num-steps",
            "2",
        ]
    )
    with pytest.raises(Spawned):
        up.run_up(ns)
    for role in ("prefill", "decode"):
        flag = commands[role].index("--speculative-config")
        assert json.loads(commands[role][flag + 1]) == {
            "method": "mtp",
            "num_speculative_tokens": 2,
        }
    bad = build_parser().parse_args(
        ["up", "--model", str(mtp_model), "--speculative-num-steps", "2"]
    )
    assert up.run_up(bad) == 2


def test_metrics_name_the_counters_as_vllm_and_derive_the_acceptance_length():
    stats = {
        "spec_decode_num_drafts": 10,
        "spec_decode_num_draft_tokens": 30,
        "spec_decode_num_accepted_tokens": 12,
        "spec_decode_num_accepted_tokens_per_pos": [7, 4, 1],
    }
    text = generate_latest(ServerMetrics(lambda: stats).registry).decode()
    assert "baton:spec_decode_num_drafts_total 10.0" in text
    assert "baton:spec_decode_num_draft_tokens_total 30.0" in text
    assert "baton:spec_decode_num_accepted_tokens_total 12.0" in text
    assert 'baton:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4.0' in text
    assert "baton:spec_decode_mean_acceptance_length 2.2" in text


def test_the_engine_process_path_carries_the_config_and_the_counters(mtp_model):
    """What `baton serve` hands its engine process (JSON) starts a speculating engine, and the
    counters it reports after a step (msgpack) render on /metrics."""
    from dataclasses import asdict

    from baton.engine.core.engine import Engine
    from baton.engine.runtime import ipc

    args = ServerArgs(
        model=str(mtp_model), speculative_config='{"method": "mtp", "num_speculative_tokens": 2}'
    )
    engine_args = json.loads(json.dumps(args.engine_args()))  # the engine process's command line
    engine = Engine(mtp_model, **engine_args)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request("r", prompt, params)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for d in engine.step() for t in d.new_token_ids]
    assert tokens == LLM(mtp_model).generate([prompt], params)[0].token_ids
    frame = ipc.encode(ipc.StepOutput(deltas=[], stats=asdict(engine.stats())))
    stats = ipc.decode(frame).stats
    text = generate_latest(ServerMetrics(lambda: stats).registry).decode()
    drafts = engine.stats().spec_decode_num_drafts
    assert drafts > 0 and f"baton:spec_decode_num_drafts_total {float(drafts)}" in text
    assert 'baton:spec_decode_num_accepted_tokens_per_pos_total{position="1"}' in text
