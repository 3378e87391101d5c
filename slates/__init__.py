"""Slates: in-RAM copy-on-write workspaces for parallel coding agents.

The pure state machine lives in `slates.core`; base directories are read by
`slates.base`; every failure is one of `slates.errors`.
"""

from slates import errors
from slates.errors import SlatesError
from slates.sdk import AsyncClient, Client

__all__ = ["AsyncClient", "Client", "SlatesError", "errors"]
__version__ = "0.1.0"
