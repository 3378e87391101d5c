"""slates.base: reading source directories (live, on demand) and capturing them.

Its modules load on first use: the mount bridge needs only `beneath`, and
`capturing` and `live` bring the whole pure core with them.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slates.base.beneath import Anchored
    from slates.base.capturing import capture, capture_into
    from slates.base.live import LiveDirectory

_HOMES = {
    "Anchored": "slates.base.beneath",
    "capture": "slates.base.capturing",
    "capture_into": "slates.base.capturing",
    "LiveDirectory": "slates.base.live",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'slates.base' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)


__all__ = ["Anchored", "LiveDirectory", "capture", "capture_into"]
