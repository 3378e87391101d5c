"""msgpack framing helpers shared by the core's record encoding and the wire protocol.

Theory of operation: both pack a large bytes value as its own part (the
header here, then the caller's buffer as it is) instead of copying it into
one packed message; the header is exactly what msgpack itself writes, so the
joined parts decode as if msgpack had packed the whole.  No imports beyond
the standard library: the CLI and the bridge load this at start-up.
"""

from __future__ import annotations

__all__ = ["bin_header"]


def bin_header(length: int) -> bytes:
    """msgpack's header of a bin of `length` bytes (bin 8/16/32, as msgpack picks)."""
    if length <= 0xFF:
        return bytes((0xC4, length))
    if length <= 0xFFFF:
        return b"\xc5" + length.to_bytes(2, "big")
    return b"\xc6" + length.to_bytes(4, "big")
