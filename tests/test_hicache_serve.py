"""The tier flags through `baton serve`: returning conversations hit the file tier over HTTP, the
same answers as a server without prefix caching, and /metrics counts the hits per tier; a bad tier
flag stops the CLI with a message that names it."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton import LLM
from baton.server.cli import main
from tests.hicache_helpers import conversations, greedy
from tests.server_process import start_server, tiny_model

POOL_FLAGS = (
    "--page-size", "4", "--mamba-track-interval", "64",
    "--max-total-tokens", "600", "--max-mamba-slots", "12",
)  # fmt: skip


def samples(server) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {
        (sample.name, sample.labels.get("tier", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def answers(server, prompts: list[list[int]]) -> list[str]:
    client = server.client()
    model = client.models.list().data[0].id
    return [
        client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]


def test_returning_conversations_hit_the_file_tier_through_baton_serve(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    logs = tmp_path_factory.mktemp("logs")
    store = tmp_path_factory.mktemp("tier")
    convs = conversations(300)
    tiered = start_server(
        model, logs, *POOL_FLAGS, "--enable-hierarchical-cache",
        "--hicache-storage-backend", "file", "--hicache-storage-dir", str(store),
        "--hicache-storage-size", "0.05",
    )  # fmt: skip
    try:
        first = answers(tiered, convs)
        returning = [c + list(range(10, 30)) for c in convs]
        got = answers(tiered, returning)
        metrics = samples(tiered)
    finally:
        assert tiered.stop() == 0, tiered.log()[-3000:]
    with LLM(model, enable_prefix_caching=False) as plain:
        assert [o.text for o in plain.generate(convs + returning, greedy())] == first + got
    assert metrics[("baton:hicache_hits_total", "file")] >= 8 * 3
    assert metrics[("baton:hicache_writes_total", "file")] > 0
    assert metrics[("baton:hicache_written_bytes_total", "file")] > 0
    assert metrics[("baton:hicache_corrupt_total", "file")] == 0
    assert list(store.glob("*.blk"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hicache-size", "0"], "--hicache-size must be > 0"),
        (["--hicache-size", "1"], "--hicache-size needs --enable-hierarchical-cache"),
        (["--enable-hierarchical-cache"], "needs a tier"),
        (
            ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"],
            "needs --hicache-storage-dir",
        ),
        (["--kv-offloading-size", "1", "--hicache-size", "2"], "disagree"),
        (["--kv-offloading-size", "1", "--no-prefix-cache"], "needs prefix caching"),
    ],
)
def test_bad_tier_flags_stop_the_cli_naming_the_flag(base_model, capsys, flags, message):
    model_dir, _ = base_model
    assert main(["serve", str(model_dir), *flags]) == 2  # refused before anything starts
    assert message in capsys.readouterr().err


def test_baton_up_refuses_a_bad_tier_flag_before_starting_workers(base_model, capsys):
    model_dir, _ = base_model
    assert main(["up", "--model", str(model_dir), "--hicache-storage-size", "-1"]) == 2
    assert "--hicache-storage-size must be > 0" in capsys.readouterr().err


def test_baton_up_hands_the_tier_flags_to_both_workers_as_serve_reads_them(base_model):
    from baton.server.args import ServerArgs
    from baton.server.cli import build_parser
    from baton.server.tier_args import TIER_FIELDS, worker_flags

    model_dir, _ = base_model
    up = build_parser().parse_args(
        ["up", "--model", str(model_dir), "--kv-offloading-size", "0.5",
         "--hicache-storage-backend", "file", "--hicache-storage-dir", "/tmp/t",
         "--enable-hierarchical-cache"]
    )  # fmt: skip
    flags = worker_flags({name: getattr(up, name) for name in TIER_FIELDS})
    serve = build_parser().parse_args(["serve", str(model_dir), *flags])
    args = ServerArgs(
        **{n: getattr(serve, n) for n in ServerArgs.field_names() if hasattr(serve, n)}
        | {"model": str(model_dir)}
    )
    assert {
        k: v for k, v in args.engine_args().items() if "hicache" in k or "hierarchical" in k
    } == {
        "enable_hierarchical_cache": True,
        "hicache_size": 0.5,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": "/tmp/t",
        "hicache_storage_size": None,
    }
