"""The error a model directory that cannot be served raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A model directory whose config.json cannot be served; the message names the key."""
