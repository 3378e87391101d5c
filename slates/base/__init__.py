"""slates.base: reading source directories (live, on demand) and capturing them."""

from slates.base.beneath import Anchored
from slates.base.capturing import capture, capture_into
from slates.base.live import LiveDirectory

__all__ = ["Anchored", "LiveDirectory", "capture", "capture_into"]
