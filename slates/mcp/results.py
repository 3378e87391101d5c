"""What the MCP tools return, and the conversions from the SDK's replies.

Theory of operation.  This module owns the shapes an agent sees: each tool's
result is one of the TypedDicts below (the MCP SDK derives the published
output schema from them), built from an SDK reply by a pure function here.
slates.mcp.server, the tools, is the only caller.  Nothing here does I/O.

Names agree between a tool's arguments and its result, across tools:
`volume`, `path` (normalised to start with "/"), `work`, `green` and
`manifest` come back as the id or reference the tool acted on; `offset` and
`length` are a byte range read or written (read_file takes both and reports
both; write_file takes `offset` and reports it with the `length` written);
`start` and `end` bound the bytes an edit replaces; `size` is only ever a
file's size; `version` is a green version (create_work and changed_since
take it and report it); rename reports the `source` and `destination` it
took.

Bytes: content that decodes as UTF-8 is that text with `encoding` "utf-8";
anything else is base64 with `encoding` "base64" (`blob`).  Arguments that
carry bytes take the same switch (`decode_data`).

Submit: `submit_status` says in a plain sentence what happened,
above all whether a version was made ("nothing to submit: no version was
made"), so an agent never reads an empty submission as an accepted change.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Literal

from mcp.types import CallToolResult, TextContent
from typing_extensions import TypedDict

from slates.errors import InvalidArgument, SlatesError, VerificationFailed

__all__ = [
    "Blob",
    "ChangedPaths",
    "ConflictRegion",
    "RegionSide",
    "DiskContent",
    "Edited",
    "Encoding",
    "FileContent",
    "LandingPlan",
    "Ledger",
    "Listing",
    "PathDone",
    "RebaseResult",
    "Renamed",
    "SubmitResult",
    "VolumeInfo",
    "VolumeList",
    "Written",
    "blob",
    "decode_data",
    "error_result",
    "ledger",
    "listing",
    "plan",
    "rebase_result",
    "submit_result",
    "SUBMIT_FIELDS",
    "submit_status",
    "volume_info",
]

Encoding = Literal["utf-8", "base64"]

PLAN_STATUS = (
    "requested: nothing was written; whether this lands on disk is decided by a "
    "person outside this server"
)


class Blob(TypedDict):
    """Bytes as text: UTF-8 when they decode, else base64."""

    encoding: Encoding
    data: str


class VolumeInfo(TypedDict):
    """A volume: its role (green, work or volume), and for a work volume its
    green volume and the version it is based on (for a green volume, its head)."""

    id: str
    name: str
    role: str
    green: str | None
    version: int | None


class VolumeList(TypedDict):
    volumes: list[VolumeInfo]


class FileContent(TypedDict):
    """Bytes of a file from `offset`; `length` is the number of bytes returned."""

    volume: str
    path: str
    offset: int
    length: int
    encoding: Encoding
    data: str


class Written(TypedDict):
    """`length` bytes were written at `offset`."""

    volume: str
    path: str
    offset: int
    length: int


class Edited(TypedDict):
    """Bytes [start, end) were replaced by `length` bytes; `size` is the file's new size."""

    volume: str
    path: str
    start: int
    end: int
    length: int
    size: int


class PathDone(TypedDict):
    volume: str
    path: str
    action: str


class Renamed(TypedDict):
    volume: str
    source: str
    destination: str
    action: str


class DirEntry(TypedDict):
    name: str
    kind: str


class Listing(TypedDict):
    volume: str
    path: str
    entries: list[DirEntry]


class RegionSide(TypedDict):
    """Where one side's differing bytes are in its whole file: [start, end), the
    1-based lines they span (null for binary files), and whether `data` was cut."""

    start: int
    end: int
    line: int | None
    end_line: int | None
    truncated: bool
    data: Blob


class ConflictRegion(TypedDict):
    """The smallest region where the accepted and proposed bytes differ: in the head
    file, in the author's file and (when known) in the base, with shared context."""

    accepted: RegionSide
    proposed: RegionSide
    base: RegionSide | None
    before: Blob
    after: Blob
    text: bool


class MergeConflict(TypedDict):
    """One conflict: `base` and `head` are byte ranges [start, end) in the submission's
    base version and in the accepted `version`; the bytes of the range as they were
    (base_bytes), as accepted, and as proposed (null where a kind has no bytes);
    `region`, where the two sides differ; `rewrite`, one side's edits were refined
    from a whole-file rewrite."""

    path: str
    kind: str
    version: int | None
    base: list[int] | None
    head: list[int] | None
    base_bytes: Blob | None
    accepted: Blob | None
    proposed: Blob | None
    region: ConflictRegion | None
    rewrite: bool


class RebaseResult(TypedDict):
    """`ok` false: refused because of `conflicts`; the volume is unchanged."""

    work: str
    ok: bool
    version: int | None
    rebased: bool
    conflicts: list[MergeConflict]


class SubmitResult(TypedDict):
    """`status` says in words what happened.  `made_version` is true only when a new
    version was made (then `version` is it); `nothing` is true when there was nothing
    to submit.  `paths` are the submitted paths (for a dry run, those that would be);
    `private` counts changed paths that stayed private (under .git/, or ignored);
    `refined` lists paths whose rewrites were narrowed to the bytes that changed,
    `literal` those sent as a whole replacement (too large to narrow)."""

    work: str
    status: str
    ok: bool
    dry_run: bool
    made_version: bool
    nothing: bool
    version: int | None
    rebased: bool
    private: int
    paths: list[str]
    refined: list[str]
    literal: list[str]
    conflicts: list[MergeConflict]


class LedgerVersion(TypedDict):
    version: int
    base: int
    work: str
    paths: list[str]


class Ledger(TypedDict):
    green: str
    head: int
    versions: list[LedgerVersion]


class ChangedPaths(TypedDict):
    """The paths changed by the versions after `version`."""

    green: str
    version: int
    paths: list[str]


class EntryState(TypedDict):
    kind: str
    digest: str | None
    mode: int


class PlanEntry(TypedDict):
    path: str
    change: Literal["create", "modify", "delete"]
    witnessed: EntryState | None
    proposed: EntryState | None


class LandingPlan(TypedDict):
    """A landing plan (manifest): what writing `source` (the snapshot holding the
    proposed content) into `target` would change."""

    manifest: str
    id: str
    source: str
    target: str
    entries: list[PlanEntry]
    status: str


class DiskContent(TypedDict):
    """What the plan's target directory holds at `path` now (`exists` false: absent);
    `length` is the number of bytes."""

    manifest: str
    path: str
    exists: bool
    length: int
    encoding: Encoding
    data: str


# -- bytes and errors ------------------------------------------------------------


def blob(data: bytes) -> Blob:
    """Bytes as text: the UTF-8 text when they decode, else base64."""
    try:
        return {"encoding": "utf-8", "data": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"encoding": "base64", "data": base64.b64encode(data).decode("ascii")}


def _maybe_blob(data: Any) -> Blob | None:
    return None if data is None else blob(bytes(data))


def decode_data(data: str, encoding: str) -> bytes:
    """A tool's `data` argument as bytes; InvalidArgument for bad base64 or encodings."""
    if encoding == "utf-8":
        try:
            return data.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument("data is not valid UTF-8 text (lone surrogates)") from None
    if encoding == "base64":
        try:
            return base64.b64decode(data.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise InvalidArgument("data is not valid base64") from None
    raise InvalidArgument("encoding is utf-8 or base64", encoding=encoding)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return blob(bytes(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def error_result(error: SlatesError) -> CallToolResult:
    """A SlatesError as an MCP tool error: `<code>: <message> <details>`, and structured."""
    details = _jsonable(error.details)
    text = f"{error.code}: {error.message}"
    if details:
        text += " " + json.dumps(details, sort_keys=True)
    return CallToolResult(
        content=[TextContent(type="text", text=text)],
        structured_content={
            "error": {
                "code": error.code,
                "message": error.message,
                "fault": error.fault,
                "details": details,
            }
        },
        is_error=True,
    )


# -- replies ---------------------------------------------------------------------


def volume_info(info: dict[str, Any]) -> VolumeInfo:
    green = info.get("green")
    version = info.get("version")
    return {
        "id": str(info["id"]),
        "name": str(info["name"]),
        "role": str(info.get("role", "volume")),
        "green": None if green is None else str(green),
        "version": None if version is None else int(version),
    }


def listing(volume: str, path: str, entries: list[dict[str, Any]]) -> Listing:
    return {
        "volume": volume,
        "path": path,
        "entries": [{"name": str(e["name"]), "kind": str(e["kind"])} for e in entries],
    }


def _span(raw: Any) -> list[int] | None:
    return None if raw is None else [int(x) for x in raw]


def _conflict(raw: dict[str, Any]) -> MergeConflict:
    version = raw.get("version")
    return {
        "path": str(raw["path"]),
        "kind": str(raw["kind"]),
        "version": None if version is None else int(version),
        "base": _span(raw.get("base")),
        "head": _span(raw.get("head")),
        "base_bytes": _maybe_blob(raw.get("base_bytes")),
        "accepted": _maybe_blob(raw.get("accepted")),
        "proposed": _maybe_blob(raw.get("proposed")),
        "region": _region(raw.get("region")),
        "rewrite": bool(raw.get("rewrite", False)),
    }


def _side(raw: dict[str, Any]) -> RegionSide:
    return {
        "start": int(raw["start"]),
        "end": int(raw["end"]),
        "line": _optional_int(raw.get("line")),
        "end_line": _optional_int(raw.get("end_line")),
        "truncated": bool(raw.get("truncated", False)),
        "data": blob(bytes(raw["data"])),
    }


def _region(raw: Any) -> ConflictRegion | None:
    if not isinstance(raw, dict):
        return None
    return {
        "accepted": _side(raw["accepted"]),
        "proposed": _side(raw["proposed"]),
        "base": None if raw.get("base") is None else _side(raw["base"]),
        "before": blob(bytes(raw["before"])),
        "after": blob(bytes(raw["after"])),
        "text": bool(raw["text"]),
    }


def _optional_int(raw: Any) -> int | None:
    return None if raw is None else int(raw)


def _paths(raw: Any) -> list[str]:
    return [str(p) for p in raw]


def _count(what: str, n: int) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def submit_status(result: SubmitResult) -> str:
    """One plain sentence: what the submission did, and whether a version was made."""
    conflicts = len(result["conflicts"])
    paths = result["paths"]
    if not result["ok"]:
        told = "would refuse the submission" if result["dry_run"] else "refused the submission"
        said = f"refused: {_count('conflict', conflicts)} {told}; no version was made"
        return said + " and nothing changed anywhere"
    if result["dry_run"]:
        said = (
            f"dry run: {_count('path', len(paths))} to submit; "
            "nothing was submitted and no version was made"
        )
    elif result["nothing"]:
        said = "nothing to submit: no version was made"
    elif result["made_version"]:
        said = f"accepted: version {result['version']} was made"
    else:
        said = f"no version was made: version {result['version']} already holds these changes"
    private = result["private"]
    if private:
        said += f"; {_count('changed path', private)} stayed private (e.g. under .git/)"
    return said


SUBMIT_FIELDS = (
    "ok",
    "version",
    "conflicts",
    "made_version",
    "nothing",
    "private",
    "paths",
    "refined",
    "literal",
    "dry_run",
)
"""What every submit reply of the service carries (issue 11's wire contract)."""


def submit_result(work: str, raw: dict[str, Any]) -> SubmitResult:
    """A submit reply as the tool's result; VerificationFailed if the service left
    out a field of the contract (an older anchor), rather than guessing it."""
    missing = [key for key in SUBMIT_FIELDS if key not in raw]
    if missing:
        raise VerificationFailed(
            "the service's submit reply lacks fields this server needs (an older anchor?)",
            missing=missing,
        )
    result: SubmitResult = {
        "work": work,
        "status": "",
        "ok": bool(raw["ok"]),
        "dry_run": bool(raw["dry_run"]),
        "made_version": bool(raw["made_version"]),
        "nothing": bool(raw["nothing"]),
        "version": _optional_int(raw["version"]),
        "rebased": bool(raw.get("rebased", False)),
        "private": int(raw["private"]),
        "paths": _paths(raw["paths"]),
        "refined": _paths(raw["refined"]),
        "literal": _paths(raw["literal"]),
        "conflicts": [_conflict(c) for c in raw["conflicts"]],
    }
    result["status"] = submit_status(result)
    return result


def rebase_result(work: str, raw: dict[str, Any]) -> RebaseResult:
    ok = bool(raw["ok"])
    return {
        "work": work,
        "ok": ok,
        "version": _optional_int(raw.get("version")),
        "rebased": ok,
        "conflicts": [_conflict(c) for c in raw.get("conflicts", [])],
    }


def ledger(raw: dict[str, Any]) -> Ledger:
    return {
        "green": str(raw["green"]),
        "head": int(raw["head"]),
        "versions": [
            {
                "version": int(v["version"]),
                "base": int(v["base"]),
                "work": str(v["work"]),
                "paths": [str(p) for p in v["paths"]],
            }
            for v in raw["versions"]
        ],
    }


def _state(raw: Any) -> EntryState | None:
    if raw is None:
        return None
    kind, digest, mode = raw
    return {"kind": str(kind), "digest": None if digest is None else str(digest), "mode": int(mode)}


def plan(raw: dict[str, Any]) -> LandingPlan:
    entries: list[PlanEntry] = []
    for entry in raw["entries"]:
        witnessed, proposed = _state(entry["witnessed"]), _state(entry["proposed"])
        change: Literal["create", "modify", "delete"] = (
            "create" if witnessed is None else "delete" if proposed is None else "modify"
        )
        entries.append(
            {
                "path": str(entry["path"]),
                "change": change,
                "witnessed": witnessed,
                "proposed": proposed,
            }
        )
    return {
        "manifest": str(raw["manifest"]),
        "id": str(raw["id"]),
        "source": str(raw["source"]),
        "target": str(raw["target"]),
        "entries": entries,
        "status": PLAN_STATUS,
    }
