"""Mounts: a volume served as an ordinary directory through FUSE.

The per-request path is C (native/bridge_*.c); `slates.fuse.bridge` is the
bridge process (`python -m slates.fuse.bridge`) and its Python half.
PROTOCOL.md in this package specifies the fs.* requests a bridge sends to
the owning shard.  Nothing is imported here, so that running the bridge
module with -m does not import it twice.
"""

from __future__ import annotations

__all__: list[str] = []
