"""The error vocabulary shared by the SDK, the wire protocol, the CLI and FUSE.

Theory of operation: every failure a caller can see is one of the classes
below (DESIGN.md section 9).  Each names who is at fault (`fault`): the
caller (bad input), the environment (the base directory, the host's
capacity), or the system (a Slates invariant or peer failed).  Errors carry
structured details so a program can act on them; they convert to an errno
only at the FUSE boundary (`errno_name`) and to an exit code only in the CLI.

Filesystem-shaped input errors (a missing name, an existing name, a file
where a directory was needed, ...) are subclasses of InvalidArgument: the
caller is at fault for all of them, yet a mount must still tell ENOENT from
EEXIST, so each carries its own errno name.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "SlatesError",
    "InvalidArgument",
    "NotFound",
    "AlreadyExists",
    "NotADirectory",
    "IsADirectory",
    "DirectoryNotEmpty",
    "NameTooLong",
    "NotPermitted",
    "NoSuchAttribute",
    "FileTooLarge",
    "OutOfRange",
    "TooBig",
    "NotSupported",
    "NoSuchOffset",
    "ConsistentBaseUnavailable",
    "BaseDrift",
    "Conflict",
    "CapacityExhausted",
    "SnapshotBarrierFailed",
    "MissingContent",
    "VerificationFailed",
    "NotOwner",
    "EpochFenced",
    "AccessDenied",
    "GrantInvalid",
    "LandingConflict",
    "RequestExpired",
    "Unavailable",
    "error_from_wire",
]


class SlatesError(Exception):
    """Base of every Slates error; `code` is the stable wire name."""

    code: ClassVar[str] = "SlatesError"
    fault: ClassVar[str] = "system"
    errno_name: ClassVar[str] = "EIO"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.details))


def _rebuild(cls: type[SlatesError], message: str, details: dict[str, Any]) -> SlatesError:
    return cls(message, **details)


class InvalidArgument(SlatesError):
    code = "InvalidArgument"
    fault = "caller"
    errno_name = "EINVAL"


class NotFound(InvalidArgument):
    code = "NotFound"
    errno_name = "ENOENT"


class AlreadyExists(InvalidArgument):
    code = "AlreadyExists"
    errno_name = "EEXIST"


class NotADirectory(InvalidArgument):
    code = "NotADirectory"
    errno_name = "ENOTDIR"


class IsADirectory(InvalidArgument):
    code = "IsADirectory"
    errno_name = "EISDIR"


class DirectoryNotEmpty(InvalidArgument):
    code = "DirectoryNotEmpty"
    errno_name = "ENOTEMPTY"


class NameTooLong(InvalidArgument):
    code = "NameTooLong"
    errno_name = "ENAMETOOLONG"


class NotPermitted(InvalidArgument):
    code = "NotPermitted"
    errno_name = "EPERM"


class NoSuchAttribute(InvalidArgument):
    code = "NoSuchAttribute"
    errno_name = "ENODATA"


class FileTooLarge(InvalidArgument):
    code = "FileTooLarge"
    errno_name = "EFBIG"


class OutOfRange(InvalidArgument):
    code = "OutOfRange"
    errno_name = "ERANGE"


class TooBig(InvalidArgument):
    code = "TooBig"
    errno_name = "E2BIG"


class NotSupported(InvalidArgument):
    code = "NotSupported"
    errno_name = "EOPNOTSUPP"


class NoSuchOffset(InvalidArgument):
    code = "NoSuchOffset"
    errno_name = "ENXIO"


class ConsistentBaseUnavailable(SlatesError):
    """A capture could not read one consistent version of a live directory."""

    code = "ConsistentBaseUnavailable"
    fault = "environment"
    errno_name = "EIO"


class BaseDrift(SlatesError):
    """A live base file no longer matches the fingerprint the volume read."""

    code = "BaseDrift"
    fault = "environment"
    errno_name = "EIO"


class Conflict(SlatesError):
    """A submission or rebase competes with accepted work; details list conflicts."""

    code = "Conflict"
    fault = "caller"
    errno_name = "EBUSY"


class CapacityExhausted(SlatesError):
    """The volume's quota or the host's memory cannot hold the operation."""

    code = "CapacityExhausted"
    fault = "environment"
    errno_name = "ENOSPC"


class SnapshotBarrierFailed(SlatesError):
    code = "SnapshotBarrierFailed"
    fault = "system"
    errno_name = "EIO"


class MissingContent(SlatesError):
    code = "MissingContent"
    fault = "system"
    errno_name = "EIO"


class VerificationFailed(SlatesError):
    code = "VerificationFailed"
    fault = "system"
    errno_name = "EIO"


class NotOwner(SlatesError):
    """The request reached a node that does not own the volume (details: redirect)."""

    code = "NotOwner"
    fault = "system"
    errno_name = "EAGAIN"


class EpochFenced(SlatesError):
    code = "EpochFenced"
    fault = "system"
    errno_name = "EAGAIN"


class AccessDenied(SlatesError):
    code = "AccessDenied"
    fault = "caller"
    errno_name = "EACCES"


class GrantInvalid(SlatesError):
    code = "GrantInvalid"
    fault = "caller"
    errno_name = "EACCES"


class LandingConflict(SlatesError):
    code = "LandingConflict"
    fault = "environment"
    errno_name = "EBUSY"


class RequestExpired(SlatesError):
    code = "RequestExpired"
    fault = "caller"
    errno_name = "ESTALE"


class Unavailable(SlatesError):
    """A peer host or the fleet's configuration group (etcd) did not answer in time, or
    a commit's outcome is unknown (details say which): try again, or elsewhere."""

    code = "Unavailable"
    fault = "environment"
    errno_name = "EAGAIN"


def _all_error_classes() -> dict[str, type[SlatesError]]:
    found: dict[str, type[SlatesError]] = {}
    pending: list[type[SlatesError]] = [SlatesError]
    while pending:
        cls = pending.pop()
        found[cls.code] = cls
        pending.extend(cls.__subclasses__())
    return found


_BY_CODE = _all_error_classes()


def error_from_wire(wire: dict[str, Any]) -> SlatesError:
    """Rebuild the named error from its wire form; an unknown code is a SlatesError."""
    cls = _BY_CODE.get(str(wire.get("code")), SlatesError)
    details = wire.get("details") or {}
    return cls(str(wire.get("message", "")), **details)
