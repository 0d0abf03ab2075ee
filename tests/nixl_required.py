"""The nixl tests' marker: skipped only where NIXL is not installed, and never when
BATON_REQUIRE_NIXL is set (`make test` sets it: `make install` installs baton[nixl])."""

from __future__ import annotations

import os

import pytest

from baton.disagg.nixl_transfer import nixl_available

REQUIRED = os.environ.get("BATON_REQUIRE_NIXL", "") not in ("", "0")
if REQUIRED and not nixl_available():
    raise RuntimeError("BATON_REQUIRE_NIXL is set but NIXL is not importable (make install)")
needs_nixl = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (pip install 'baton[nixl]')"
)
