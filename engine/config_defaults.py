"""The transformers config class defaults a family's ConfigReader falls back on, kept per machine.

Reading them means importing the class, and importing anything of transformers 5.x first scans
the source of every model it ships (its lazy import structure): 1-5 s of each engine start on a
2-core machine, for values that change only with the transformers version. So they are kept in
`$BATON_CACHE_DIR/config-defaults.json`, keyed by the class path and the version of the package
that defines it; a class outside an installed package (a test's) is read every time, and so is
one whose defaults do not survive JSON (an object default): what the cache gives back is always
equal to what the class says.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import tempfile
from typing import Any

from baton.kernels.machine_cache import cache_dir

log = logging.getLogger(__name__)

FILE_NAME = "config-defaults.json"
_TUPLE = "__tuple__"  # JSON has no tuples; transformers' defaults have some (time_step_limit)

Defaults = tuple[dict[str, Any], dict[str, Any]]  # keyword defaults, rope parameters


def class_defaults(config_class: type) -> dict[str, Any]:
    """Keyword defaults of a transformers config class's `__init__`: what a key missing from
    config.json means to the reference implementation."""
    return {
        name: param.default
        for name, param in inspect.signature(config_class.__init__).parameters.items()
        if param.default is not inspect.Parameter.empty
    }


def rope_defaults(config_class: type) -> dict[str, Any]:
    """The rope parameters of a default instance (Bamba's, for one, carry partial rotary 0.5)."""
    return dict(getattr(config_class(), "rope_parameters", None) or {})


@functools.cache
def config_defaults(class_path: str) -> Defaults:
    """(keyword defaults, rope defaults) of the config class at `class_path` ("pkg.mod.Class")."""
    key = _key(class_path)
    if key is not None:
        kept = _read().get(key)
        if isinstance(kept, dict) and set(kept) == {"defaults", "rope"}:
            return _decode(kept["defaults"]), _decode(kept["rope"])
    config_class = _import(class_path)
    defaults = (class_defaults(config_class), rope_defaults(config_class))
    if key is not None:
        _keep(key, defaults)
    return defaults


def _import(class_path: str) -> type:
    module_path, name = class_path.rsplit(".", 1)
    return getattr(importlib.import_module(module_path), name)


def _key(class_path: str) -> str | None:
    """ "path@version" of the installed package the class comes from; None: not from one."""
    try:
        return f"{class_path}@{importlib.metadata.version(class_path.split('.')[0])}"
    except importlib.metadata.PackageNotFoundError:
        return None


def _keep(key: str, defaults: Defaults) -> None:
    entry = {"defaults": _encode(defaults[0]), "rope": _encode(defaults[1])}
    try:
        text = json.dumps(entry)
    except (TypeError, ValueError):
        return  # an object default: read from the class every time
    back = json.loads(text)
    if (_decode(back["defaults"]), _decode(back["rope"])) != defaults:
        return
    path = cache_dir() / FILE_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(_read() | {key: back}, f, indent=0, sort_keys=True)
        os.replace(f.name, path)  # atomic: a reader sees the old file or the new
    except OSError as error:  # a read-only cache: read the class again next start
        log.warning("cannot keep config defaults in %s: %s", path, error)


def _read() -> dict[str, Any]:
    path = cache_dir() / FILE_NAME
    try:
        kept = json.loads(path.read_text())
        return kept if isinstance(kept, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("ignoring unreadable config defaults %s: %s", path, error)
        return {}


def _encode(value: Any) -> Any:
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_decode(v) for v in value[_TUPLE])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value
