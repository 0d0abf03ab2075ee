"""A raw ZMTP 3.0 peer (NULL mechanism) for tests that forge traffic: it claims any socket type
and sends any frames, which a well-behaved pyzmq socket cannot (a PULL socket never sends)."""

from __future__ import annotations

import socket
import struct

SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"


def _greeting() -> bytes:
    return SIGNATURE + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def _short_or_long(flags: int, data: bytes) -> bytes:
    if len(data) < 256:
        return bytes([flags, len(data)]) + data
    return bytes([flags | 0x02]) + struct.pack(">Q", len(data)) + data


def frame(data: bytes, more: bool = False) -> bytes:
    return _short_or_long(0x01 if more else 0x00, data)


def _ready(socket_type: bytes) -> bytes:
    name = b"Socket-Type"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(socket_type))
    return _short_or_long(0x04, body + socket_type)


def connect(address: str, socket_type: bytes) -> socket.socket:
    """A connection to `address` (tcp://host:port or ipc://path) past the ZMTP handshake,
    claiming to be a `socket_type` peer."""
    if address.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address.removeprefix("ipc://"))
    else:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
    sock.settimeout(10)
    sock.sendall(_greeting())
    greeting = b""
    while len(greeting) < 64:
        greeting += sock.recv(64 - len(greeting))
    sock.sendall(_ready(socket_type))
    return sock


def send_all(sock: socket.socket, data: bytes) -> bool:
    """False once the peer has closed the connection (libzmq drops a peer that breaks a limit)."""
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True
