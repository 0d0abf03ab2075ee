"""The engine's structure, read from its source: the rules that keep state declared in one place
(DESIGN.md section 13, issue 35) hold, and each of these checks fails on a file that breaks
them (the last test feeds each one such a file)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where a layer's own state may be named: the layers, the families, the kernels.
STATE_OWNERS = ("engine/layers/", "engine/models/", "kernels/")
# A request's progress: only the scheduler (engine/core/scheduler*.py) changes these.
PROGRESS = {
    "num_computed",
    "output_ids",
    "status",
    "kv_pages",
    "mamba_slot",
    "cached_blocks",
    "finish_reason",
    "stop_reason",
    "logprobs",
    "prompt_logprobs",
    "num_cached_tokens",
    "num_preemptions",
}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "__setitem__"}
SCHEDULER = (
    "engine/core/scheduler.py",
    "engine/core/scheduler_blocks.py",
    "engine/core/scheduler_tokens.py",  # how sampled tokens join a request, for the scheduler
    "engine/core/scheduler_memory.py",  # what a request holds of the pools, for the scheduler
)


def sources(*packages: str) -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): p.read_text()
        for package in packages
        for p in sorted((ROOT / package).rglob("*.py"))
    }


def code_words(text: str) -> set[str]:
    """The words of identifiers and of string literals that are not docstrings (comments and
    docstrings may explain the layers; code may not name their tensors)."""
    tree = ast.parse(text)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                words.update(re.split(r"[^a-z0-9]+", node.value.lower()))
            continue
        name = next(
            (
                getattr(node, f)
                for f in ("id", "attr", "arg", "name", "asname", "module")
                if isinstance(getattr(node, f, None), str)
            ),
            None,
        )
        if name is not None:
            words.update(re.split(r"[^a-z0-9]+", name.lower().replace("_", ".")))
    return words


def names_layer_state(text: str) -> bool:
    return bool(code_words(text) & {"conv", "ssm"})


def writes_progress(text: str) -> list[str]:
    """`x.field = ...`, `x.field += ...`, `x.field[i] = ...` and `x.field.append(...)` (and the
    other mutators) for every progress field."""
    found = []
    for node in ast.walk(ast.parse(text)):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATORS:
                targets = [node.func.value]
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and target.attr in PROGRESS:
                found.append(f"line {node.lineno}: .{target.attr}")
    return found


def test_below_the_layers_no_module_names_a_layers_state():
    offenders = [
        path
        for path, text in sources("engine", "disagg", "server").items()
        if not path.startswith(STATE_OWNERS) and names_layer_state(text)
    ]
    assert offenders == []


def handles_requests(text: str) -> bool:
    """Modules that hold the engine's Request objects (the server and the offline API's result
    objects have fields of the same names: they are not requests)."""
    return "from baton.engine.core.request import" in text


def test_only_the_scheduler_writes_a_requests_progress():
    held = {p: t for p, t in sources("engine", "disagg").items() if handles_requests(t)}
    assert "engine/core/engine.py" in held and "engine/handover/connector.py" in held
    offenders = {
        path: writes
        for path, text in held.items()
        if path not in SCHEDULER and (writes := writes_progress(text))
    }
    assert offenders == {}


def test_no_stub_stands_for_another_classs_method():
    offenders = [
        path
        for path, text in sources("engine", "disagg", "server").items()
        if "raise NotImplementedError" in text
    ]
    assert offenders == []


def test_the_engine_names_no_disaggregation_module():
    offenders = [path for path, text in sources("engine").items() if "disagg" in code_words(text)]
    assert offenders == []


def test_each_check_catches_what_it_forbids():
    assert names_layer_state('pool = cache.pools["mamba2.conv"]\n')
    assert names_layer_state("def f(ssm_state):\n    return ssm_state\n")
    assert not names_layer_state('def f():\n    """The conv window and SSM state."""\n')
    assert writes_progress("req.num_computed += 3\n")
    assert writes_progress("req.output_ids.append(token)\n")
    assert writes_progress("req.kv_pages[0] = 5\n")
    assert not writes_progress("n = req.num_computed\n")
    assert "disagg" in code_words('import_module("baton.disagg.tp_transfer")\n')
