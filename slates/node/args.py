"""Reading a request's arguments: one rule for every operation of a shard.

Each helper returns the argument or raises InvalidArgument naming it, so a
malformed request changes nothing.  Called by slates.node.service and the
operation modules beside it.
"""

from __future__ import annotations

import posixpath
from typing import Any

from slates.errors import InvalidArgument

__all__ = ["int_arg", "str_arg", "path_arg"]


def int_arg(args: dict[str, Any], key: str, default: int | None = None) -> int:
    value = args.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{key} must be a non-negative integer", value=str(value))
    return value


def str_arg(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{key} is required", field=key)
    return value


def path_arg(args: dict[str, Any], key: str = "path") -> str:
    path = str_arg(args, key)
    if not path.startswith("/"):
        raise InvalidArgument("paths are absolute", path=path)
    return posixpath.normpath(path).replace("//", "/")
