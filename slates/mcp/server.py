"""`slates mcp`: Slates for coding agents over the Model Context Protocol (stdio).

Theory of operation.  This module owns the MCP face of Slates and nothing
else: `build_server` makes an `mcp.server.mcpserver.MCPServer` (the
official SDK's high-level server) whose tools are thin over the blocking
SDK, `slates.Client`; `run_stdio` serves it on stdin/stdout until the
client closes stdin.  `slates mcp [--runtime-dir DIR]` (cli/main.py) is its
only caller in the product; tests/test_mcp.py drives it through the SDK's
stdio client.  It never speaks the wire protocol itself.

Threads: the MCP server runs on anyio (asyncio); slates.AsyncClient is
trio-only.  So every tool is a plain function, which the MCP SDK runs on an
anyio worker thread, calling one shared blocking `slates.Client` (itself a
private trio thread; calls from several threads are safe).  The client is
opened on the first tool call, not at start: a server started before the
anchor serves once the anchor is up, and "no anchor" is a tool error.

What an agent can do: list and show volumes; create a work volume on a green
version (by green name or id); read, write and edit files (edit replaces
bytes [start, end) with new bytes), make directories, remove and rename
entries, list a directory; submit and rebase (conflicts come back
structured: path, kind, byte ranges, and the base, accepted and proposed
bytes); see the ledger (`versions`) and the paths changed since a version;
request a landing plan (`land_plan`, `land_show`) and read what the target
directory holds now (`read_base`).

Invariant: nothing here changes the developer's directory.  No tool lands a
plan or takes part in deciding one: there is no tool that issues or uses a
landing permit and none that reads or accepts the approver's secret, and
the server never opens the runtime directory's key file.  Landing stays
with `slates land approve` on a person's terminal (DESIGN.md section 6).
tests/test_mcp.py checks the tool list for this.

Bytes in results: content that decodes as UTF-8 comes back as that text
with `encoding` "utf-8"; anything else as base64 with `encoding` "base64".
Tools that take bytes take `data` with the same `encoding` switch (default
"utf-8").  Big writes and edits go to the service in pieces of CHUNK bytes
(one request must fit the client's ring); a failure part way leaves the
pieces already sent.

Errors: a SlatesError becomes an MCP tool error (`isError`) whose text is
`<code>: <message>` followed by the details as JSON, and whose structured
content is {"error": {"code", "message", "fault", "details"}}; the server
keeps serving.  A submit or rebase refused because of conflicts is not an
error: its result has `ok` false and the conflicts.  Volumes are named by
id (`vol-<shard>-<n>`, taken as is) or by a name that matches exactly one
volume (for a green argument, one green volume).
"""

from __future__ import annotations

import base64
import binascii
import functools
import inspect
import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import Field
from typing_extensions import TypedDict

from slates import __version__
from slates.errors import InvalidArgument, NotFound, SlatesError
from slates.sdk import Client

__all__ = [
    "CHUNK",
    "INSTRUCTIONS",
    "SERVER_NAME",
    "TOOL_NAMES",
    "SlatesTools",
    "blob",
    "build_server",
    "decode_data",
    "error_result",
    "run_stdio",
]

SERVER_NAME = "slates"
CHUNK = 256 << 10
"""Most bytes of a write or an edit sent in one request (well under a ring's message limit)."""

INSTRUCTIONS = """\
Slates gives you a private, in-memory copy of a project to work in.
A green volume holds the shared versions (v0, v1, ...) of the project.
Make your own work volume on it with create_work, change files there
(read_file, write_file, edit_file, make_dir, remove, rename, list_dir),
then submit: accepted changes become the green volume's next version.
A submit that overlaps work accepted since your base comes back with
structured conflicts and changes nothing; rebase moves your volume onto
the newest version.  Prefer edit_file (replace bytes [start, end)) to
rewriting whole files: precise edits conflict only where they overlap.
The developer's directory on disk is never changed by these tools;
land_plan only describes what a landing would change, and read_base
shows what the disk holds now.  Acceptance is not a test result.
Bytes travel as UTF-8 text, or as base64 when they are not UTF-8
(each result says which in `encoding`)."""

_VOLUME_ID = re.compile(r"vol-\d+-\d+")

Encoding = Literal["utf-8", "base64"]

# -- results ---------------------------------------------------------------------


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
    volume: str
    path: str
    written: int


class Edited(TypedDict):
    """`size` is the file's size after the edit."""

    volume: str
    path: str
    size: int


class Done(TypedDict):
    volume: str
    action: str
    paths: list[str]


class DirEntry(TypedDict):
    name: str
    kind: str


class Listing(TypedDict):
    volume: str
    path: str
    entries: list[DirEntry]


class MergeConflict(TypedDict):
    """One conflict: `base` and `head` are byte ranges [start, end) in the submission's
    base version and in the accepted `version`; the bytes of the range as they were
    (base_bytes), as accepted, and as proposed (null where a kind has no bytes)."""

    path: str
    kind: str
    version: int | None
    base: list[int] | None
    head: list[int] | None
    base_bytes: Blob | None
    accepted: Blob | None
    proposed: Blob | None


class MergeResult(TypedDict):
    """`ok` false: refused because of `conflicts`; nothing changed anywhere."""

    work: str
    ok: bool
    version: int | None
    rebased: bool
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
    green: str
    since: int
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
    """A landing plan (manifest): what writing `source` into `target` would change."""

    manifest: str
    id: str
    source: str
    target: str
    entries: list[PlanEntry]
    status: str


class DiskContent(TypedDict):
    """What the plan's target directory holds at `path` now (`exists` false: absent)."""

    manifest: str
    path: str
    exists: bool
    encoding: Encoding
    data: str


PLAN_STATUS = (
    "requested: nothing was written; whether this lands on disk is decided by a "
    "person outside this server"
)

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


def _path(path: str) -> str:
    """Paths inside a volume are absolute; "src/a.c" means "/src/a.c"."""
    return path if path.startswith("/") else "/" + path


def _volume_info(info: dict[str, Any]) -> VolumeInfo:
    green = info.get("green")
    version = info.get("version")
    return {
        "id": str(info["id"]),
        "name": str(info["name"]),
        "role": str(info.get("role", "volume")),
        "green": None if green is None else str(green),
        "version": None if version is None else int(version),
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
    }


def _state(raw: Any) -> EntryState | None:
    if raw is None:
        return None
    kind, digest, mode = raw
    return {"kind": str(kind), "digest": None if digest is None else str(digest), "mode": int(mode)}


def _plan(raw: dict[str, Any]) -> LandingPlan:
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


# -- argument types (their descriptions reach the agent in the input schemas) ----------

VolumeRef = Annotated[
    str, Field(description="A volume id (vol-<shard>-<n>) or a name that matches one volume.")
]
WorkRef = Annotated[str, Field(description="A work volume: id, or a name that matches one.")]
GreenRef = Annotated[
    str, Field(description="A green volume: id, or a name that matches one green volume.")
]
VolumePath = Annotated[
    str, Field(description='A path inside the volume, e.g. "/src/main.c" (relative means from /).')
]
Data = Annotated[str, Field(description="The bytes: UTF-8 text, or base64 (see encoding).")]
DataEncoding = Annotated[
    Encoding, Field(description='How `data` is written: "utf-8" (default) or "base64".')
]
ManifestRef = Annotated[str, Field(description="A landing plan's manifest reference (man-...).")]
Offset = Annotated[int, Field(ge=0, description="Byte offset (0-based).")]


class SlatesTools:
    """The tools: each a plain (blocking) method over one lazily opened slates.Client."""

    def __init__(self, runtime_dir: str | Path | None = None) -> None:
        self.runtime_dir = runtime_dir
        self._client: Client | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Client:
        """The shared client, opened on first use (so a missing anchor is a tool error)."""
        with self._lock:
            if self._client is None:
                self._client = Client(self.runtime_dir)
            return self._client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def resolve(self, ref: str, role: str | None = None) -> str:
        """A volume id for `ref`: an id as is, else the one volume (of `role`) so named."""
        if _VOLUME_ID.fullmatch(ref):
            return ref
        volumes: list[dict[str, Any]] = self.client.list_volumes()
        named = [v for v in volumes if v["name"] == ref]
        if role is not None and any(v.get("role") == role for v in named):
            named = [v for v in named if v.get("role") == role]
        if not named:
            raise NotFound(f"no volume has the id or name {ref!r}", volume=ref)
        if len(named) > 1:
            ids = [str(v["id"]) for v in named]
            raise InvalidArgument(
                f"{len(ids)} volumes are named {ref!r} ({', '.join(ids)}); use an id",
                name=ref,
                ids=ids,
            )
        return str(named[0]["id"])

    # -- volumes --------------------------------------------------------------------

    def list_volumes(self) -> VolumeList:
        """List every volume: id, name, role (green, work or volume), and for a work
        volume its green volume and base version (for a green volume, its head)."""
        volumes: list[dict[str, Any]] = self.client.list_volumes()
        return {"volumes": [_volume_info(v) for v in volumes]}

    def show_volume(self, volume: VolumeRef) -> VolumeInfo:
        """Show one volume: role, green volume and version (a work volume's base version)."""
        info: dict[str, Any] = self.client.show_volume(self.resolve(volume))
        return _volume_info(info)

    def create_work(
        self,
        green: GreenRef,
        name: Annotated[str, Field(description="A name for the new work volume.")],
        version: Annotated[
            int | None,
            Field(ge=0, description="The green version to start from (default: the head)."),
        ] = None,
    ) -> VolumeInfo:
        """Create your own work volume on a version of a green volume (the head by
        default).  Nothing is copied; your changes stay private until you submit.
        Returns the work volume's id and `version`, the version it is based on."""
        info: dict[str, Any] = self.client.create_work(
            self.resolve(green, "green"), name, version=version
        )
        return _volume_info(info)

    # -- files ------------------------------------------------------------------------

    def read_file(
        self,
        volume: VolumeRef,
        path: VolumePath,
        offset: Offset = 0,
        size: Annotated[
            int | None, Field(ge=0, description="Most bytes to read (default: to the end).")
        ] = None,
    ) -> FileContent:
        """Read a file (a green volume reads its head).  The bytes come back as UTF-8
        text with encoding "utf-8" when they decode, else base64 with encoding
        "base64"; `length` counts bytes, not characters."""
        vid, where = self.resolve(volume), _path(path)
        data: bytes = self.client.read(vid, where, offset, size)
        content = blob(data)
        return {
            "volume": vid,
            "path": where,
            "offset": offset,
            "length": len(data),
            "encoding": content["encoding"],
            "data": content["data"],
        }

    def write_file(
        self,
        volume: WorkRef,
        path: VolumePath,
        data: Data,
        encoding: DataEncoding = "utf-8",
        offset: Offset = 0,
        truncate: Annotated[
            bool,
            Field(description="Empty the file first (replace its whole content)."),
        ] = False,
    ) -> Written:
        """Write bytes into a file at `offset`, creating the file when absent.
        Without truncate, bytes past the written range stay as they were; with
        truncate=true the file is emptied first, which rewrites the whole file
        (and conflicts with any other change to it at submit).  To change part of
        an existing file prefer edit_file.  `data` is UTF-8 text, or base64 with
        encoding="base64"."""
        vid, where = self.resolve(volume), _path(path)
        payload = decode_data(data, encoding)
        written = 0
        while True:
            piece = payload[written : written + CHUNK]
            count: int = self.client.write(
                vid, where, piece, offset + written, truncate=truncate and written == 0
            )
            written += count
            if written >= len(payload) or count == 0:
                break
        return {"volume": vid, "path": where, "written": written}

    def edit_file(
        self,
        volume: WorkRef,
        path: VolumePath,
        start: Annotated[int, Field(ge=0, description="First byte replaced (0-based).")],
        end: Annotated[int, Field(ge=0, description="Byte after the last one replaced.")],
        data: Data,
        encoding: DataEncoding = "utf-8",
    ) -> Edited:
        """Replace bytes [start, end) of a file with `data`, moving what follows
        (insert: start == end; delete: empty data).  A new file is created by an
        edit at [0, 0).  Offsets count bytes, not characters.  Returns the file's
        new size.  Precise edits conflict at submit only where they overlap
        another accepted change."""
        vid, where = self.resolve(volume), _path(path)
        payload = decode_data(data, encoding)
        size: int = self.client.edit(vid, where, start, end, payload[:CHUNK])
        at = start + min(len(payload), CHUNK)
        for cut in range(CHUNK, len(payload), CHUNK):
            piece = payload[cut : cut + CHUNK]
            size = self.client.edit(vid, where, at, at, piece)
            at += len(piece)
        return {"volume": vid, "path": where, "size": size}

    def make_dir(self, volume: WorkRef, path: VolumePath) -> Done:
        """Make a directory (its parent must exist)."""
        vid, where = self.resolve(volume), _path(path)
        self.client.mkdir(vid, where)
        return {"volume": vid, "action": "made directory", "paths": [where]}

    def remove(self, volume: WorkRef, path: VolumePath) -> Done:
        """Remove a file, a symbolic link or an empty directory."""
        vid, where = self.resolve(volume), _path(path)
        info: dict[str, Any] = self.client.stat(vid, where)
        if info.get("kind") == "dir":
            self.client.rmdir(vid, where)
        else:
            self.client.unlink(vid, where)
        return {"volume": vid, "action": "removed", "paths": [where]}

    def rename(
        self,
        volume: WorkRef,
        source: Annotated[str, Field(description="The path to move.")],
        destination: Annotated[str, Field(description="Its new path (replaced if present).")],
    ) -> Done:
        """Rename (move) a file or directory inside the volume."""
        vid, src, dst = self.resolve(volume), _path(source), _path(destination)
        self.client.rename(vid, src, dst)
        return {"volume": vid, "action": "renamed", "paths": [src, dst]}

    def list_dir(self, volume: VolumeRef, path: VolumePath = "/") -> Listing:
        """List a directory: each entry's name and kind (file, dir, symlink, ...)."""
        vid, where = self.resolve(volume), _path(path)
        entries: list[dict[str, Any]] = self.client.list(vid, where)
        return {
            "volume": vid,
            "path": where,
            "entries": [{"name": str(e["name"]), "kind": str(e["kind"])} for e in entries],
        }

    # -- submit, rebase, versions -------------------------------------------------------

    def submit(self, work: WorkRef) -> MergeResult:
        """Offer your work volume's changes to its green volume.  Accepted (ok true):
        they become the new head `version` and your volume moves onto it.  Refused
        (ok false): `conflicts` lists each overlap with work accepted since your base
        (path, kind, byte ranges, and the base, accepted and proposed bytes); nothing
        changed anywhere and your volume keeps its edits: fix them, or rebase.
        Acceptance is not a test result."""
        vid = self.resolve(work)
        result: dict[str, Any] = self.client.submit(vid)
        return {
            "work": vid,
            "ok": bool(result["ok"]),
            "version": None if result.get("version") is None else int(result["version"]),
            "rebased": bool(result.get("rebased", False)),
            "conflicts": [_conflict(c) for c in result.get("conflicts", [])],
        }

    def rebase(self, work: WorkRef) -> MergeResult:
        """Move your work volume onto its green volume's head, keeping your changes;
        publishes nothing (submit does).  Refused because of conflicts (ok false),
        the volume is unchanged and `conflicts` says why, as for submit."""
        vid = self.resolve(work)
        result: dict[str, Any] = self.client.rebase(vid)
        ok = bool(result["ok"])
        return {
            "work": vid,
            "ok": ok,
            "version": None if result.get("version") is None else int(result["version"]),
            "rebased": ok,
            "conflicts": [_conflict(c) for c in result.get("conflicts", [])],
        }

    def versions(
        self,
        green: GreenRef,
        limit: Annotated[int, Field(ge=0, description="Show the last N versions.")] = 20,
    ) -> Ledger:
        """The green volume's ledger: the head version, and for each of the last
        versions the version it was based on, the work volume that submitted it and
        the paths it changed."""
        gid = self.resolve(green, "green")
        ledger: dict[str, Any] = self.client.ledger(gid, limit=limit)
        return {
            "green": str(ledger["green"]),
            "head": int(ledger["head"]),
            "versions": [
                {
                    "version": int(v["version"]),
                    "base": int(v["base"]),
                    "work": str(v["work"]),
                    "paths": [str(p) for p in v["paths"]],
                }
                for v in ledger["versions"]
            ],
        }

    def changed_since(
        self,
        green: GreenRef,
        version: Annotated[int, Field(ge=0, description="The version to compare from.")],
    ) -> ChangedPaths:
        """The paths changed by the green volume's versions after `version`."""
        gid = self.resolve(green, "green")
        paths: list[str] = self.client.changed_since(gid, version)
        return {"green": gid, "since": version, "paths": paths}

    # -- landing (requesting and reading only) ----------------------------------------

    def land_plan(
        self,
        volume: Annotated[
            str,
            Field(description="A green volume (a version of it) or a work volume (as it is now)."),
        ],
        target: Annotated[str, Field(description="The directory on disk (an absolute path).")],
        paths: Annotated[
            list[str] | None, Field(description="Only these paths (and what is below them).")
        ] = None,
        version: Annotated[
            int | None, Field(ge=0, description="The green version (default: the head).")
        ] = None,
    ) -> LandingPlan:
        """Request a landing plan: the manifest of what writing a green version (or
        a work volume, as it is now) into the target directory would change, entry
        by entry (path, create/modify/delete, the witnessed and proposed kind,
        BLAKE3 digest and mode).  Nothing is written: whether a plan lands on disk
        is decided by a person outside this server, and no tool here lands it."""
        if not Path(target).is_absolute():
            raise InvalidArgument("the target is an absolute directory path", target=target)
        vid = self.resolve(volume)
        plan: dict[str, Any] = self.client.land_plan(vid, target, paths=paths, version=version)
        return _plan(plan)

    def land_show(self, manifest: ManifestRef) -> LandingPlan:
        """Show a landing plan requested earlier (by its manifest reference)."""
        plan: dict[str, Any] = self.client.land_show(manifest)
        return _plan(plan)

    def read_base(
        self,
        manifest: ManifestRef,
        path: Annotated[str, Field(description="A path in the plan's target directory.")],
    ) -> DiskContent:
        """Read what the plan's target directory on disk holds at `path` now
        (exists false when absent), as UTF-8 text or base64 like read_file."""
        data: bytes | None = self.client.read_base(manifest, path)
        content = blob(b"" if data is None else data)
        return {
            "manifest": manifest,
            "path": path,
            "exists": data is not None,
            "encoding": content["encoding"],
            "data": content["data"],
        }


_READS = ToolAnnotations(read_only_hint=True, open_world_hint=False)
_ADDS = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
_CHANGES = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)

TOOLS: dict[str, ToolAnnotations] = {
    "list_volumes": _READS,
    "show_volume": _READS,
    "create_work": _ADDS,
    "read_file": _READS,
    "write_file": _CHANGES,
    "edit_file": _CHANGES,
    "make_dir": _ADDS,
    "remove": _CHANGES,
    "rename": _CHANGES,
    "list_dir": _READS,
    "submit": _ADDS,
    "rebase": _CHANGES,
    "versions": _READS,
    "changed_since": _READS,
    "land_plan": _ADDS,
    "land_show": _READS,
    "read_base": _READS,
}
TOOL_NAMES = frozenset(TOOLS)


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, with a SlatesError returned as an MCP tool error (see error_result).

    functools.wraps keeps the method's signature (inspect follows __wrapped__), so
    the MCP SDK derives the same input and output schemas from it.
    """

    @functools.wraps(method)
    def call(**arguments: Any) -> Any:
        try:
            return method(**arguments)
        except SlatesError as error:
            return error_result(error)

    return call


def build_server(tools: SlatesTools) -> MCPServer[Any]:
    """An MCPServer offering `tools` (see TOOLS); it does not open the client."""
    server: MCPServer[Any] = MCPServer(
        SERVER_NAME,
        title="Slates",
        instructions=INSTRUCTIONS,
        version=__version__,
        log_level="WARNING",
    )
    for name, hints in TOOLS.items():
        method: Callable[..., Any] = getattr(tools, name)
        server.add_tool(
            _guarded(method),
            name=name,
            description=inspect.cleandoc(method.__doc__ or ""),
            annotations=hints,
            structured_output=True,
        )
    return server


def run_stdio(runtime_dir: str | Path | None = None) -> None:
    """Serve on stdin/stdout until the client closes stdin; then close the Slates client."""
    tools = SlatesTools(runtime_dir)
    try:
        build_server(tools).run("stdio")
    finally:
        tools.close()
