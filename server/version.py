"""baton's version as installed (GET /version on workers and the router, as vLLM answers it)."""

from __future__ import annotations

import importlib.metadata


def baton_version() -> str:
    try:
        return importlib.metadata.version("baton")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"
