"""Slates: in-RAM copy-on-write workspaces for parallel coding agents.

The pure state machine lives in `slates.core`; base directories are read by
`slates.base`; every failure is one of `slates.errors`.
"""

from typing import TYPE_CHECKING, Any

from slates import errors
from slates.errors import SlatesError

if TYPE_CHECKING:
    from slates.sdk import AsyncClient, Client


def __getattr__(name: str) -> Any:
    # The SDK loads on first use, so processes that need none of it, the mount
    # bridge above all, start quickly; trio loads only with an opened AsyncClient.
    if name in ("AsyncClient", "Client"):
        from slates import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'slates' has no attribute {name!r}")


__all__ = ["AsyncClient", "Client", "SlatesError", "errors"]
__version__ = "0.1.0"
