"""Secrets from a flag, a file or the environment (server/secret_flags.py), and the help that
says which routes stay open under --api-key."""

from __future__ import annotations

import pytest

from baton.server.cli import build_parser
from baton.server.secret_flags import API_KEY_ENV, SecretError, secret


def test_a_file_gives_its_first_line_stripped(tmp_path):
    (tmp_path / "key").write_text("  s3cret \nsecond line\n")
    assert secret(None, str(tmp_path / "key"), "--api-key", {}, API_KEY_ENV) == "s3cret"


def test_a_flag_wins_over_the_environment_and_the_environment_is_the_fallback():
    environ = {API_KEY_ENV: "from-env"}
    assert secret("from-flag", None, "--api-key", environ, API_KEY_ENV) == "from-flag"
    assert secret(None, None, "--api-key", environ, API_KEY_ENV) == "from-env"
    assert secret(None, None, "--api-key", {}, API_KEY_ENV) is None


@pytest.mark.parametrize(
    ("value", "file", "named"),
    [
        ("k", "key", "--api-key and --api-key-file both given: pass one"),
        (None, "missing", "--api-key-file {dir}/missing: No such file or directory"),
        (None, "empty", "--api-key-file {dir}/empty: the file is empty"),
        ("", None, "--api-key is empty"),
    ],
)
def test_unusable_secret_flags_are_refused_by_name(tmp_path, value, file, named):
    (tmp_path / "key").write_text("k\n")
    (tmp_path / "empty").write_text("\n")
    path = None if file is None else str(tmp_path / file)
    with pytest.raises(SecretError) as refused:
        secret(value, path, "--api-key", {}, API_KEY_ENV)
    assert str(refused.value) == named.format(dir=tmp_path)


@pytest.mark.parametrize("command", ["serve", "router", "up"])
def test_help_names_the_routes_left_open_and_the_ways_to_keep_the_key_off_argv(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "/health, /ping and /metrics stay open" in text
    assert "--api-key-file" in text and "$BATON_API_KEY" in text
