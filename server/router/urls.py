"""A worker's base URL, checked and written one way, so that one worker is one worker.

Every URL that names a worker (`--prefill` / `--decode`, `POST` and `DELETE /workers`, a pod
found by discovery) passes through `worker_url` before the router keeps it or compares it:

    " HTTP://LocalHost:80/ "  refused: a space (no byte of a URL is trimmed or guessed)
    "HTTP://LocalHost:80/"    -> "http://127.0.0.1"          scheme and host lowercased, the
    "http://127.0.0.1"        -> "http://127.0.0.1"          default port and a trailing / dropped,
    "http://[0:0::1]:8000"    -> "http://[::1]:8000"         localhost is 127.0.0.1, an IP
    "http://[::ffff:10.0.0.7]:8000" -> "http://10.0.0.7:8000"  address in its one spelling

and everything else that is not a base URL is refused with a ValueError naming the problem: a
control character or space anywhere (CR/LF would split an HTTP header), another scheme, a port
outside 1..65535, user info, a path, query or fragment, a host that is neither an IP address nor
a DNS name (`127.1` and `2130706433` are refused rather than read as the addresses some
resolvers make of them). Host names are not resolved: two names of one address stay two workers
(only `localhost` is known to be 127.0.0.1, as `baton serve` binds it by default).
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

import httpx

DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_URL_CHARS = 2048
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
_NUMERIC = re.compile(r"[0-9.]+")  # looks like an IPv4 address; must then be a whole one
EXAMPLE = "such as http://10.0.0.7:8000"


def worker_url(value: object) -> str:
    """`value` as a worker's canonical base URL, `scheme://host[:port]` (ValueError naming what
    is wrong)."""
    if not isinstance(value, str):
        raise ValueError(f"a worker URL is a string {EXAMPLE}, got {type(value).__name__}")
    if len(value) > MAX_URL_CHARS:
        raise ValueError(f"a worker URL has at most {MAX_URL_CHARS} characters, got {len(value)}")
    for position, char in enumerate(value):
        if not char.isascii() or not char.isprintable() or char.isspace():
            raise ValueError(
                f"worker URL {value!r}: character {char!r} at position {position} is not "
                "allowed (control characters, spaces and non-ASCII; an IDN host goes in its "
                "xn-- form)"
            )
    parts = urlsplit(value)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise ValueError(f"worker URL {value!r}: the scheme must be http or https {EXAMPLE}")
    if "@" in parts.netloc:
        raise ValueError(f"worker URL {value!r}: user info (user:password@) is not allowed")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "?" in value or "#" in value:
        raise ValueError(
            f"worker URL {value!r}: give the worker's base URL {EXAMPLE}, without a path, "
            "query or fragment"
        )
    host = _host(value, parts.netloc, parts.hostname)
    port = _port(value, parts.netloc)
    shown = "" if port is None or port == DEFAULT_PORTS[scheme] else f":{port}"
    canonical = f"{scheme}://{host}{shown}"
    try:  # what the router's HTTP client will be given: its rules too (an A-label must decode)
        if not httpx.URL(canonical).host:
            raise ValueError("no host")
    except Exception as error:
        raise ValueError(f"worker URL {value!r}: {error}") from None
    return canonical


def _port(value: str, netloc: str) -> int | None:
    text = netloc.rpartition("]")[2] if netloc.startswith("[") else netloc
    _, colon, digits = text.rpartition(":")
    if not colon or digits == "":
        return None
    if not digits.isdigit() or not 1 <= int(digits) <= 65535:
        raise ValueError(f"worker URL {value!r}: port {digits!r} is not a number in 1..65535")
    return int(digits)


def _host(value: str, netloc: str, hostname: str | None) -> str:
    if not hostname:
        raise ValueError(f"worker URL {value!r} names no host {EXAMPLE}")
    if netloc.startswith("["):
        try:
            address = ipaddress.IPv6Address(hostname)
        except ValueError:
            address = None
        if address is None or address.scope_id is not None:
            raise ValueError(
                f"worker URL {value!r}: [{hostname}] is not an IPv6 address (zone ids are not "
                "allowed)"
            )
        mapped = address.ipv4_mapped
        return str(mapped) if mapped is not None else f"[{address.compressed}]"
    if _NUMERIC.fullmatch(hostname):
        try:
            return str(ipaddress.IPv4Address(hostname))
        except ValueError:
            raise ValueError(
                f"worker URL {value!r}: {hostname} is not an IPv4 address a.b.c.d"
            ) from None
    name = hostname.removesuffix(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise ValueError(f"worker URL {value!r}: {hostname!r} is not a valid host name")
    return "127.0.0.1" if name == "localhost" else name
