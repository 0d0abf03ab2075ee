"""bench.serve_side_by_side gives every server the same limits and the PD pair its flags."""

from __future__ import annotations

from bench.serve_side_by_side import LIMITS, server_commands


def test_every_server_gets_the_same_limits_and_no_prefix_cache():
    commands = {
        kind: server_commands(kind, "/m", "bfloat16", 9000, "/tmp/vcpu")
        for kind in ("baton", "baton-pd", "vllm")
    }
    for kind in ("baton", "baton-pd"):
        command = commands[kind]
        assert "--no-prefix-cache" in command
        for name, value in LIMITS.items():
            assert f"--{name.replace('_', '-')}={value}" in command, (kind, name)
    # baton up forwards worker flags after `--`: the limits must follow it to reach the engines
    pd = commands["baton-pd"]
    assert pd.index("--") < pd.index("--no-prefix-cache")
    vllm = commands["vllm"]
    assert "--no-enable-prefix-caching" in vllm
    assert vllm[vllm.index("--max-num-seqs") + 1] == str(LIMITS["max_running_requests"])
    assert vllm[vllm.index("--max-num-batched-tokens") + 1] == str(LIMITS["max_num_batched_tokens"])
