"""Landing: writing approved results back into the developer's directory (DESIGN.md section 6)."""

from slates.land.manifest import Decision, Entry, Manifest, State, decide

__all__ = ["Decision", "Entry", "Manifest", "State", "decide"]
