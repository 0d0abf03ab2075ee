"""A prefill worker's word for its own transfer address, so that a decode worker only dials
addresses a holder of the disaggregation secret gave out.

A decode request names its prefill worker's transfer address in `baton_disagg.prefill_addr`.
The router puts it there, but the router holds no secret, and anyone with the API key who
reaches a decode worker can send a request of their own: without more, the decode worker would
dial whatever it is told (a port scanner driven from inside the cluster). So a prefill worker
vouches for its address with an HMAC under the secret (`/disagg/info`'s `transfer_addr_token`);
the router hands the token on beside the address (`baton_disagg.prefill_addr_token`), and a
decode worker with a secret dials only addresses whose token it can check. Without a secret
nothing is authenticated anywhere, and the decode side's bound on unanswered links
(disagg/peer_link.py) is the only limit.

Torch-free: the HTTP server processes compute and check tokens.
"""

from __future__ import annotations

import hashlib
import hmac

# Set apart from the transfer messages' MACs (disagg/protocol.py), which cover length-prefixed
# frames: no token is ever a valid MAC of a message, or the other way round.
_DOMAIN = b"baton prefill transfer address v1\0"
TOKEN_CHARS = 64  # sha256, in hex


def vouch(secret: str, address: str) -> str:
    """The token for `address` under `secret`."""
    return hmac.new(secret.encode(), _DOMAIN + address.encode(), hashlib.sha256).hexdigest()


def vouched(secret: str, address: str, token: str | None) -> bool:
    """Whether `token` is `address`'s under `secret` (compared in constant time)."""
    return token is not None and hmac.compare_digest(vouch(secret, address), token)
