"""One branch (a Flat) written as the grammar engine reads it: const / enum values, or one
schema per type it allows (several types: an anyOf of them).

Scalars are written here; arrays and objects in containers.py. Each writer raises Empty when no
value of its type meets the branch (that type is left out), Unenforceable when the branch asks
for what the engine cannot enforce and no narrowing keeps it sound.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from baton.engine.structured_output.schema.conjunction import ALL_TYPES, Flat, canonical
from baton.engine.structured_output.schema.containers import write_array, write_object
from baton.engine.structured_output.schema.document import Empty, Unenforceable
from baton.engine.structured_output.schema.patterns import PatternError, json_string_regex

if TYPE_CHECKING:
    from baton.engine.structured_output.schema.lower import Lowering

# The formats the grammar engine writes (each a regex of its own). Any other format is an
# annotation, as JSON Schema reads `format` unless told otherwise (2020-12, section 7.2).
STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# formats of one length range, which a minLength / maxLength beside them may not cut
FORMAT_LENGTHS = {"date": (10, 10), "uuid": (36, 36), "ipv4": (7, 15)}
# The engine's integer grammar takes exact bounds as 64-bit integers; beyond +-2**53 a bound is
# narrowed (an upper bound down, a lower bound up: the values left still meet it).
SAFE_INTEGER = 2**53
# multipleOf is enforced for whole numbers up to 1024, with no bounds or both bounds less than
# 10,000 apart (else the engine drops it): a wider range is narrowed to a window this wide.
MAX_MULTIPLE = 1024
MULTIPLE_WINDOW = 5000
MAX_LISTED_MULTIPLES = 64  # a larger multipleOf: this many of its multiples, as an enum
FRACTION_WINDOW = 20000  # whole numbers a fractional multipleOf is narrowed to (verified)


class ValueWriter:
    def __init__(self, lowering: Lowering) -> None:
        self.lowering = lowering

    def write(self, flat: Flat) -> Any:
        if flat.values is not None:
            path = flat.sources[0].path if flat.sources else ""
            kept = [
                value
                for value in flat.values
                if _finite(value)
                and _meets_branch(value, flat)
                and all(
                    self.lowering.is_valid(value, n, unknown=False, beside_values=True)
                    for n in flat.sources
                )
            ]
            if not kept:
                raise Empty(path, "no const / enum value meets the keywords beside it")
            return {"const": kept[0]} if len(kept) == 1 else {"enum": kept}
        if flat.unchecked:
            raise Unenforceable(
                flat.unchecked[0],
                "'not' is not enforced here (a grammar writes what a schema "
                "allows; only a `not` of types, required properties or const values is)",
            )
        types = flat.emitted_types()
        if types == ALL_TYPES and not flat.keywords:
            return {}
        writers = [
            ("null", lambda: {"type": "null"}),
            ("boolean", lambda: {"type": "boolean"}),
            ("integer", lambda: self.number(flat, types)),
            ("string", lambda: self.string(flat)),
            ("array", lambda: write_array(self.lowering, flat)),
            ("object", lambda: write_object(self.lowering, flat)),
        ]
        written, empties = [], []
        for family, writer in writers:
            if family in types or (family == "integer" and "fraction" in types):
                try:
                    written.append(writer())
                except Empty as empty:
                    empties.append(empty)
        if not written:
            raise empties[0]
        if len(written) > 1 and all(set(schema) == {"type"} for schema in written):  # bare types
            return {"type": [schema["type"] for schema in written]}
        return written[0] if len(written) == 1 else {"anyOf": written}

    # -- numbers -----------------------------------------------------------------------------

    def number(self, flat: Flat, types: frozenset[str]) -> Any:
        path = flat.sources[0].path if flat.sources else ""
        lower, upper = _finite_bound(flat.lower, +1), _finite_bound(flat.upper, -1)
        if lower is False or upper is False:
            raise Empty(path, "no number meets an infinite bound")
        if "integer" not in types:  # (a `not` of integers: numbers with a fractional part)
            raise Unenforceable(path, "numbers that are not integers are not enforced")
        if "fraction" in types and not flat.multiples:
            return _number(lower, upper, path)
        # multipleOf p/q (as written) admits the whole numbers that are multiples of p: the
        # grammar writes those (a number's fractional multiples are narrowed to them)
        multiple = 1
        for _, value in flat.multiples:
            multiple = math.lcm(multiple, Fraction(str(value)).numerator)
        fractional = [value for _, value in flat.multiples if not float(value).is_integer()]
        low = None if lower is None else _integer_above(*lower)
        high = None if upper is None else _integer_below(*upper)
        if (low is not None and low > SAFE_INTEGER) or (high is not None and high < -SAFE_INTEGER):
            raise Unenforceable(path, "integer bounds beyond +-2**53 are not enforced")
        low = None if low is None else max(low, -SAFE_INTEGER)
        high = None if high is None else min(high, SAFE_INTEGER)
        if low is not None and high is not None and low > high:
            raise Empty(path, "no integer lies between its minimum and maximum")
        if multiple > MAX_MULTIPLE:
            return _listed_multiples(multiple, low, high, path)
        if fractional:  # a window the float arithmetic of the check is verified over
            low, high = _window(low, high, MULTIPLE_WINDOW if multiple > 1 else FRACTION_WINDOW)
        elif multiple > 1 and (
            (low is None) != (high is None) or (low is not None and high - low >= MULTIPLE_WINDOW)
        ):
            low, high = _window(low, high, MULTIPLE_WINDOW)
        if low is not None and high is not None and -(-low // multiple) * multiple > high:
            raise Empty(path, f"no multiple of {multiple} lies between its bounds")
        for value in fractional:
            if not all(
                _float_multiple(n, value)
                for n in range(-(-low // multiple) * multiple, high + 1, multiple)
            ):
                raise Unenforceable(
                    path,
                    f"multipleOf {value} is not enforced (its whole multiples fail the "
                    "floating-point check)",
                )
        return _integer(low, high, multiple if multiple > 1 else None)

    # -- strings -----------------------------------------------------------------------------

    def string(self, flat: Flat) -> Any:
        path = flat.sources[0].path if flat.sources else ""
        low, high = flat.min_length, flat.max_length
        if high is not None and low > high:
            raise Empty(path, "its minLength is above its maxLength")
        if len(flat.patterns) > 1:
            (first, _), (second, _) = flat.patterns[:2]
            raise Unenforceable(
                second, f"a second pattern (beside {first}) is not enforced: give one pattern"
            )
        if flat.patterns:
            where, pattern = flat.patterns[0]
            try:
                regex = json_string_regex(pattern, low, math.inf if high is None else high)
            except PatternError as error:
                raise Unenforceable(where, f"pattern {pattern!r} {error}") from None
            return {"type": "string", "pattern": regex}
        formats = [f for f in flat.formats if f in STRING_FORMATS]
        if len(formats) == 1:
            fixed_low, fixed_high = FORMAT_LENGTHS.get(formats[0], (0, math.inf))
            most = math.inf if high is None else high
            if (low, high) == (0, None) or (low <= fixed_low and fixed_high <= most):
                return {"type": "string", "format": formats[0]}
        schema = {"type": "string"}
        if low:
            schema["minLength"] = low
        if high is not None:
            schema["maxLength"] = high
        return schema


def _number(lower, upper, path: str) -> dict:
    schema: dict[str, Any] = {"type": "number"}
    if lower is not None:
        schema["exclusiveMinimum" if lower[1] else "minimum"] = lower[0]
    if upper is not None:
        schema["exclusiveMaximum" if upper[1] else "maximum"] = upper[0]
    if lower and upper and (lower[0], lower[1] or upper[1]) >= (upper[0], True):
        if lower[0] > upper[0] or lower[1] or upper[1]:
            raise Empty(path, "no number lies between its minimum and maximum")
    return schema


def _window(low: int | None, high: int | None, width: int) -> tuple[int, int]:
    """[low, high] narrowed to at most `width` integers (from the bound given, else around 0)."""
    if low is None and high is None:
        return -(width // 2), width // 2 - 1
    if low is None:
        return high - width + 1, high
    return low, low + width - 1 if high is None else min(high, low + width - 1)


def _float_multiple(number: int, multiple: float) -> bool:
    """jsonschema's multipleOf check for a float `multiple` (float division, then exact)."""
    quotient = number / multiple
    try:
        return int(quotient) == quotient
    except OverflowError:
        return (Fraction(number) / Fraction(multiple)).denominator == 1


def _meets_branch(value: Any, flat: Flat) -> bool:
    """What a branch asks beside its subschemas (from negations, dependencies, a oneOf's
    proof): its types, and of an object its required, forbidden and held-off properties."""
    if not type_of(value) & flat.types:
        return False
    if not isinstance(value, dict):
        return True
    if flat.forbidden & value.keys() or not flat.required <= value.keys():
        return False
    return not any(
        name in value and canonical(value[name]) == canonical(held) for name, held in flat.excluded
    )


def type_of(value: Any) -> frozenset[str]:
    """A JSON value's type, as a Flat counts types (1.0 an integer, 1.5 a fraction)."""
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return frozenset({"integer"})
    if isinstance(value, float):
        return frozenset({"fraction"})
    if isinstance(value, str):
        return frozenset({"string"})
    return frozenset({"array" if isinstance(value, list) else "object"})


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(map(_finite, value.values()))
    if isinstance(value, list):
        return all(map(_finite, value))
    return True


def _finite_bound(bound, sign: int):
    """A bound at +-infinity (a JSON number like 1e400): none at all, or False when no number
    meets it."""
    if bound is None or math.isfinite(bound[0]):
        return bound
    return None if (bound[0] < 0) == (sign > 0) else False


def _integer_above(value: float, exclusive: bool) -> int:
    least = math.ceil(value)
    return least + 1 if exclusive and least == value else least


def _integer_below(value: float, exclusive: bool) -> int:
    most = math.floor(value)
    return most - 1 if exclusive and most == value else most


def _integer(low: int | None, high: int | None, multiple: int | None) -> dict:
    schema: dict[str, Any] = {"type": "integer"}
    if low is not None:
        schema["minimum"] = low
    if high is not None:
        schema["maximum"] = high
    if multiple is not None:
        schema["multipleOf"] = multiple
    return schema


def _listed_multiples(multiple: int, low: int | None, high: int | None, path: str) -> dict:
    if low is None:  # from 0 up, or the last multiples at or below a negative maximum
        low = (
            0 if high is None else min(0, (high // multiple - MAX_LISTED_MULTIPLES + 1) * multiple)
        )
    values = []
    value = -(-low // multiple) * multiple
    while len(values) < MAX_LISTED_MULTIPLES and (high is None or value <= high):
        values.append(value)
        value += multiple
    if not values:
        raise Empty(path, f"no multiple of {multiple} lies between its bounds")
    return {"enum": values}
