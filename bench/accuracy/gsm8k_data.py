"""Synthetic GSM8K-format word problems: seeded, with a held-out split no training run can draw.

    python -m baton.bench.accuracy.gsm8k_data --split heldout --count 205 --seed 1 --output bench/accuracy/data/gsm8k_synthetic_heldout.jsonl
    python -m baton.bench.accuracy.gsm8k_data --split train --count 10000 --seed 0 --output train.jsonl

Each row is `{"question": ..., "answer": ...}` like GSM8K's test.jsonl: a short word problem of
one or two operations (+, -, *, exact /) and a worked answer whose last line is `#### N`.

The split is a property of the problem, not of the seed: a problem's key (its kind and its
operands, never the names or objects in its wording) is hashed into `NUM_BUCKETS` buckets;
bucket 0 is the held-out space, bucket 1 the validation space (for early stopping while
training), the rest the training space. `generate(seed, split)` yields only its split's keys,
whatever the seed, so the held-out file's arithmetic is unseen in training even reworded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Split = Literal["train", "valid", "heldout"]

NUM_BUCKETS = 16
HELDOUT_PATH = Path(__file__).parent / "data" / "gsm8k_synthetic_heldout.jsonl"
HELDOUT_SEED = 1
NUM_FEW_SHOT_ROWS = 5  # the held-out file's first rows: the eval's few-shot examples

# Operand ranges: sums up to 198 and differences of numbers up to 199 (carries and borrows,
# two- and three-digit results), one-digit by two-digit products, exact divisions; two-step
# problems chain them (answers stay below 400).
MAX_ADD = 99
MAX_SUB = 199
MUL_SMALL = (2, 9)
MUL_LARGE = (11, 29)
DIV_DIVISOR = (2, 9)
DIV_QUOTIENT = (2, 30)

NAMES = [
    ("Tom", "he"),
    ("Anna", "she"),
    ("Ben", "he"),
    ("Lucy", "she"),
    ("Sam", "he"),
    ("Mia", "she"),
    ("Leo", "he"),
    ("Emma", "she"),
    ("Jack", "he"),
    ("Zoe", "she"),
    ("Omar", "he"),
    ("Nina", "she"),
]
ITEMS = ["apples", "marbles", "stickers", "cookies", "books", "pencils", "cards", "shells"]
PRICED = [
    ("pen", "pens"),
    ("book", "books"),
    ("toy", "toys"),
    ("ticket", "tickets"),
    ("cake", "cakes"),
]
CONTAINERS = ["boxes", "bags", "packs", "jars"]


@dataclass(frozen=True)
class Problem:
    kind: str
    operands: tuple[int, ...]
    question: str
    answer: str  # worked solution ending with "#### N"

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return (self.kind, self.operands)

    def row(self) -> dict[str, str]:
        return {"question": self.question, "answer": self.answer}


def split_of(key: tuple[str, tuple[int, ...]]) -> Split:
    digest = hashlib.sha256(repr(key).encode()).digest()
    bucket = int.from_bytes(digest[:4], "big") % NUM_BUCKETS
    return "heldout" if bucket == 0 else "valid" if bucket == 1 else "train"


def _person(rng: random.Random) -> tuple[str, str, str]:
    """(name, pronoun, a friend's name)."""
    (name, pronoun), (friend, _) = rng.sample(NAMES, 2)
    return name, pronoun, friend


def _add(rng: random.Random) -> Problem:
    a, b = rng.randint(10, MAX_ADD), rng.randint(10, MAX_ADD)
    name, he, _ = _person(rng)
    items = rng.choice(ITEMS)
    c = a + b
    return Problem(
        "add",
        (a, b),
        f"{name} has {a} {items}. {he.capitalize()} gets {b} more. "
        f"How many {items} does {he} have now?",
        f"{name} has {a} + {b} = {c} {items} now.\n#### {c}",
    )


def _sub(rng: random.Random) -> Problem:
    a = rng.randint(20, MAX_SUB)
    b = rng.randint(1, a - 1)
    name, he, friend = _person(rng)
    items = rng.choice(ITEMS)
    c = a - b
    return Problem(
        "sub",
        (a, b),
        f"{name} has {a} {items} and gives {b} to {friend}. How many {items} does {name} have left?",
        f"{name} has {a} - {b} = {c} {items} left.\n#### {c}",
    )


def _mul(rng: random.Random) -> Problem:
    a, b = rng.randint(*MUL_SMALL), rng.randint(*MUL_LARGE)
    name, he, _ = _person(rng)
    items, container = rng.choice(ITEMS), rng.choice(CONTAINERS)
    c = a * b
    return Problem(
        "mul",
        (a, b),
        f"{name} buys {a} {container} with {b} {items} in each. How many {items} does {he} buy?",
        f"{he.capitalize()} buys {a} * {b} = {c} {items}.\n#### {c}",
    )


def _div(rng: random.Random) -> Problem:
    b, c = rng.randint(*DIV_DIVISOR), rng.randint(*DIV_QUOTIENT)
    a = b * c
    name, he, _ = _person(rng)
    items = rng.choice(ITEMS)
    return Problem(
        "div",
        (a, b),
        f"{name} shares {a} {items} equally among {b} friends. How many {items} does each friend get?",
        f"Each friend gets {a} / {b} = {c} {items}.\n#### {c}",
    )


def _add_sub(rng: random.Random) -> Problem:
    a, b = rng.randint(10, MAX_ADD), rng.randint(10, MAX_ADD)
    d = a + b
    c = rng.randint(1, d - 1)
    e = d - c
    name, he, friend = _person(rng)
    items = rng.choice(ITEMS)
    return Problem(
        "add_sub",
        (a, b, c),
        f"{name} has {a} {items}. {he.capitalize()} buys {b} more and then gives {c} to {friend}. "
        f"How many {items} does {he} have now?",
        f"After buying, {name} has {a} + {b} = {d} {items}. "
        f"After giving, {he} has {d} - {c} = {e} {items}.\n#### {e}",
    )


def _mul_add(rng: random.Random) -> Problem:
    a, b = rng.randint(*MUL_SMALL), rng.randint(*MUL_LARGE)
    c = rng.randint(1, MAX_ADD)
    d = a * b
    e = d + c
    name, he, _ = _person(rng)
    items, container = rng.choice(ITEMS), rng.choice(CONTAINERS)
    return Problem(
        "mul_add",
        (a, b, c),
        f"{name} has {c} {items}. {he.capitalize()} buys {a} {container} of {b} {items} each. "
        f"How many {items} does {he} have in total?",
        f"The {container} hold {a} * {b} = {d} {items}. "
        f"In total {he} has {d} + {c} = {e} {items}.\n#### {e}",
    )


def _change(rng: random.Random) -> Problem:
    a, b = rng.randint(*MUL_SMALL), rng.randint(*MUL_LARGE)
    d = a * b
    c = rng.randint(d + 1, d + MAX_ADD)
    e = c - d
    name, he, _ = _person(rng)
    item, items = rng.choice(PRICED)
    return Problem(
        "change",
        (a, b, c),
        f"A {item} costs ${b}. {name} buys {a} {items} and pays with ${c}. "
        f"How much change does {he} get?",
        f"The {items} cost {a} * {b} = ${d}. The change is {c} - {d} = ${e}.\n#### {e}",
    )


def _div_sub(rng: random.Random) -> Problem:
    b, d = rng.randint(*DIV_DIVISOR), rng.randint(*DIV_QUOTIENT)
    a = b * d
    c = rng.randint(1, d - 1)
    e = d - c
    name, he, _ = _person(rng)
    items = rng.choice(ITEMS)
    return Problem(
        "div_sub",
        (a, b, c),
        f"{name} puts {a} {items} equally into {b} jars. {he.capitalize()} takes {c} {items} "
        f"out of one jar. How many {items} are left in that jar?",
        f"Each jar has {a} / {b} = {d} {items}. That jar has {d} - {c} = {e} {items} left.\n#### {e}",
    )


KINDS: dict[str, Callable[[random.Random], Problem]] = {
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "div": _div,
    "add_sub": _add_sub,
    "mul_add": _mul_add,
    "change": _change,
    "div_sub": _div_sub,
}


def generate(seed: int, split: Split = "train", unique: bool = False) -> Iterator[Problem]:
    """An endless stream of problems of one split (kinds uniform), reproducible from `seed`."""
    rng = random.Random(f"gsm8k-synthetic-{split}-{seed}")
    makers = list(KINDS.values())
    seen: set[tuple[str, tuple[int, ...]]] = set()
    while True:
        problem = rng.choice(makers)(rng)
        if split_of(problem.key) != split or (unique and problem.key in seen):
            continue
        seen.add(problem.key)
        yield problem


def take(seed: int, count: int, split: Split = "train", unique: bool = False) -> list[Problem]:
    stream = generate(seed, split, unique)
    return [next(stream) for _ in range(count)]


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def write_jsonl(rows: list[dict], path: str | Path | None) -> None:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if path is None:
        sys.stdout.write(text)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m baton.bench.accuracy.gsm8k_data",
        description="Write seeded synthetic GSM8K-format problems as JSONL rows "
        '{"question", "answer"} (answers end with "#### N").',
    )
    parser.add_argument(
        "--split",
        choices=["train", "valid", "heldout"],
        default="train",
        help="problem space to draw from; no two share a problem (default: train)",
    )
    parser.add_argument("--count", type=int, default=1000, help="rows to write (default: 1000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--output", help="JSONL file to write (default: stdout)")
    args = parser.parse_args(argv)
    write_jsonl(
        [p.row() for p in take(args.seed, args.count, args.split, unique=True)], args.output
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
