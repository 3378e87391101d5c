"""`slates mcp`: Slates for coding agents over the Model Context Protocol (stdio).

Theory of operation.  This module owns the MCP face of Slates and nothing
else: `build_server` makes an `mcp.server.mcpserver.MCPServer` (the
official SDK's high-level server) whose tools are thin over the blocking
SDK, `slates.Client`; `run_stdio` serves it on stdin/stdout until the
client closes stdin.  `slates mcp [--runtime-dir DIR]` (slates_cli/main.py) is its
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
entries, list a directory; submit (or a dry run of it) and rebase
(conflicts come back structured: path, kind, byte ranges, and the base,
accepted and proposed bytes); see the ledger (`versions`) and the paths
changed since a version; request a landing plan (`land_plan`, `land_show`)
and read what the target directory holds now (`read_base`).  The result
shapes, and the rule that argument and result names agree, are in
slates.mcp.results.

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

Arguments: each tool takes exactly its method's parameters.  The MCP SDK's
argument models would drop a name they do not know (a misspelt optional
argument would silently take its default), so `_StrictServer` refuses the
call first with InvalidArgument naming the unknown and the accepted
arguments, and every input schema says `additionalProperties: false`.

Errors: a SlatesError becomes an MCP tool error (`isError`) whose text is
`<code>: <message>` followed by the details as JSON, and whose structured
content is {"error": {"code", "message", "fault", "details"}}; the server
keeps serving.  A submit or rebase refused because of conflicts is not an
error: its result has `ok` false and the conflicts.  Volumes are named as
everywhere in Slates (slates.sdk.names, through `Client.resolve`): an id
(`vol-<shard>-<n>`) as is, or a name that matches exactly one volume (for
a green argument one green volume, for submit and rebase one work volume).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.tools import Tool
from mcp.types import CallToolResult, InputRequiredResult, ToolAnnotations
from pydantic import Field

from slates import __version__
from slates.errors import InvalidArgument, SlatesError
from slates.mcp import results
from slates.mcp.results import (
    ChangedPaths,
    DiskContent,
    Edited,
    Encoding,
    FileContent,
    LandingPlan,
    Ledger,
    Listing,
    PathDone,
    RebaseResult,
    Renamed,
    SubmitResult,
    VolumeInfo,
    VolumeList,
    Written,
    blob,
    decode_data,
    error_result,
)
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
submit with dry_run=true shows the paths a submission would carry and
makes no version; each submit result's `status` says whether a version
was made.  A submit that overlaps work accepted since your base comes
back with structured conflicts and changes nothing; rebase moves your
volume onto the newest version.  Prefer edit_file (replace bytes
[start, end)) to rewriting whole files: precise edits conflict only
where they overlap.  The developer's directory on disk is never changed
by these tools; land_plan only describes what a landing would change,
and read_base shows what the disk holds now.  Acceptance is not a test
result.  Bytes travel as UTF-8 text, or as base64 when they are not
UTF-8 (each result says which in `encoding`).  Byte ranges are
offset/length (read_file, write_file) or start/end (edit_file); size is
a file's size.  A tool refuses arguments it does not take."""


def _path(path: str) -> str:
    """Paths inside a volume are absolute; "src/a.c" means "/src/a.c"."""
    return path if path.startswith("/") else "/" + path


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

    def __init__(self, runtime_dir: str | Path | None = None, token: str | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.token = token  # an agent's credential: the session acts as that agent
        self._client: Client | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Client:
        """The shared client, opened on first use (so a missing anchor is a tool error)."""
        with self._lock:
            if self._client is None:
                self._client = Client(self.runtime_dir, token=self.token)
            return self._client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- volumes --------------------------------------------------------------------

    def list_volumes(self) -> VolumeList:
        """List every volume: id, name, role (green, work or volume), and for a work
        volume its green volume and base version (for a green volume, its head)."""
        volumes = self.client.list_volumes()
        return {"volumes": [results.volume_info(v) for v in volumes]}

    def show_volume(self, volume: VolumeRef) -> VolumeInfo:
        """Show one volume: role, green volume and version (a work volume's base version)."""
        return results.volume_info(self.client.show_volume(self.client.resolve(volume)))

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
        info = self.client.create_work(self.client.resolve(green, "green"), name, version=version)
        return results.volume_info(info)

    # -- files ------------------------------------------------------------------------

    def read_file(
        self,
        volume: VolumeRef,
        path: VolumePath,
        offset: Offset = 0,
        length: Annotated[
            int | None, Field(ge=0, description="Most bytes to read (default: to the end).")
        ] = None,
    ) -> FileContent:
        """Read `length` bytes of a file from `offset` (a green volume reads its head).
        The bytes come back as UTF-8 text with encoding "utf-8" when they decode,
        else base64 with encoding "base64"; the result's `length` counts the bytes
        returned (fewer at the end of the file), not characters."""
        vid, where = self.client.resolve(volume), _path(path)
        data = self.client.read(vid, where, offset, length)
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
        """Write bytes into a file at `offset`, creating the file when absent; the
        result's `length` is the number of bytes written.  Without truncate, bytes
        past the written range stay as they were; with truncate=true the file is
        emptied first, which rewrites the whole file (and conflicts with any other
        change to it at submit).  To change part of an existing file prefer
        edit_file.  `data` is UTF-8 text, or base64 with encoding="base64"."""
        vid, where = self.client.resolve(volume), _path(path)
        payload = decode_data(data, encoding)
        written = 0
        while True:
            piece = payload[written : written + CHUNK]
            count = self.client.write(
                vid, where, piece, offset + written, truncate=truncate and written == 0
            )
            written += count
            if written >= len(payload) or count == 0:
                break
        return {"volume": vid, "path": where, "offset": offset, "length": written}

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
        edit at [0, 0).  Offsets count bytes, not characters.  Returns the range
        replaced, the `length` in bytes of what replaced it, and the file's new
        `size`.  Precise edits conflict at submit only where they overlap another
        accepted change."""
        vid, where = self.client.resolve(volume), _path(path)
        payload = decode_data(data, encoding)
        size = self.client.edit(vid, where, start, end, payload[:CHUNK])
        at = start + min(len(payload), CHUNK)
        for cut in range(CHUNK, len(payload), CHUNK):
            piece = payload[cut : cut + CHUNK]
            size = self.client.edit(vid, where, at, at, piece)
            at += len(piece)
        return {
            "volume": vid,
            "path": where,
            "start": start,
            "end": end,
            "length": len(payload),
            "size": size,
        }

    def make_dir(self, volume: WorkRef, path: VolumePath) -> PathDone:
        """Make a directory (its parent must exist)."""
        vid, where = self.client.resolve(volume), _path(path)
        self.client.mkdir(vid, where)
        return {"volume": vid, "path": where, "action": "made directory"}

    def remove(self, volume: WorkRef, path: VolumePath) -> PathDone:
        """Remove a file, a symbolic link or an empty directory."""
        vid, where = self.client.resolve(volume), _path(path)
        if self.client.stat(vid, where).get("kind") == "dir":
            self.client.rmdir(vid, where)
        else:
            self.client.unlink(vid, where)
        return {"volume": vid, "path": where, "action": "removed"}

    def rename(
        self,
        volume: WorkRef,
        source: Annotated[str, Field(description="The path to move.")],
        destination: Annotated[str, Field(description="Its new path (replaced if present).")],
    ) -> Renamed:
        """Rename (move) a file or directory inside the volume."""
        vid, src, dst = self.client.resolve(volume), _path(source), _path(destination)
        self.client.rename(vid, src, dst)
        return {"volume": vid, "source": src, "destination": dst, "action": "renamed"}

    def list_dir(self, volume: VolumeRef, path: VolumePath = "/") -> Listing:
        """List a directory: each entry's name and kind (file, dir, symlink, ...)."""
        vid, where = self.client.resolve(volume), _path(path)
        return results.listing(vid, where, self.client.list(vid, where))

    # -- submit, rebase, versions -------------------------------------------------------

    def submit(
        self,
        work: WorkRef,
        dry_run: Annotated[
            bool,
            Field(description="Only report what would be submitted (`paths`); make no version."),
        ] = False,
    ) -> SubmitResult:
        """Offer your work volume's changes to its green volume; `status` says in
        words what happened.  Accepted (made_version true): they become the new head
        `version` and your volume moves onto it.  Nothing changed (nothing true):
        no version is made.  Refused (ok false): `conflicts` lists each overlap with
        work accepted since your base (path, kind, byte ranges, and the base,
        accepted and proposed bytes); nothing changed anywhere and your volume keeps
        its edits: fix them, or rebase.  `paths` are the submitted paths and
        `private` counts changed paths that stay private (under .git/ or ignored).
        dry_run=true only reports: no version is made.  Acceptance is not a test
        result."""
        vid = self.client.resolve(work, "work")
        return results.submit_result(vid, self.client.submit(vid, dry_run=dry_run))

    def rebase(self, work: WorkRef) -> RebaseResult:
        """Move your work volume onto its green volume's head, keeping your changes;
        publishes nothing (submit does).  Refused because of conflicts (ok false),
        the volume is unchanged and `conflicts` says why, as for submit."""
        vid = self.client.resolve(work, "work")
        return results.rebase_result(vid, self.client.rebase(vid))

    def versions(
        self,
        green: GreenRef,
        limit: Annotated[int, Field(ge=0, description="Show the last N versions.")] = 20,
    ) -> Ledger:
        """The green volume's ledger: the head version, and for each of the last
        versions the version it was based on, the work volume that submitted it and
        the paths it changed."""
        gid = self.client.resolve(green, "green")
        return results.ledger(self.client.ledger(gid, limit=limit))

    def changed_since(
        self,
        green: GreenRef,
        version: Annotated[int, Field(ge=0, description="The version to compare from.")],
    ) -> ChangedPaths:
        """The paths changed by the green volume's versions after `version`."""
        gid = self.client.resolve(green, "green")
        return {"green": gid, "version": version, "paths": self.client.changed_since(gid, version)}

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
        BLAKE3 digest and mode); `source` is the snapshot holding the proposed
        content.  Nothing is written: whether a plan lands on disk is decided by a
        person outside this server, and no tool here lands it."""
        if not Path(target).is_absolute():
            raise InvalidArgument("the target is an absolute directory path", target=target)
        vid = self.client.resolve(volume)
        return results.plan(self.client.land_plan(vid, target, paths=paths, version=version))

    def land_show(self, manifest: ManifestRef) -> LandingPlan:
        """Show a landing plan requested earlier (by its manifest reference)."""
        return results.plan(self.client.land_show(manifest))

    def read_base(
        self,
        manifest: ManifestRef,
        path: Annotated[str, Field(description="A path in the plan's target directory.")],
    ) -> DiskContent:
        """Read what the plan's target directory on disk holds at `path` now
        (exists false when absent), as UTF-8 text or base64 like read_file;
        `length` counts the bytes."""
        data = self.client.read_base(manifest, path)
        content = blob(b"" if data is None else data)
        return {
            "manifest": manifest,
            "path": path,
            "exists": data is not None,
            "length": 0 if data is None else len(data),
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


def accepted_arguments(method: Callable[..., Any]) -> tuple[str, ...]:
    """The argument names a tool takes (its method's parameters), in order."""
    return tuple(inspect.signature(method).parameters)


def unknown_arguments(tool: str, accepted: tuple[str, ...], given: list[str]) -> InvalidArgument:
    """The error for arguments a tool does not take: names them and the accepted ones."""
    unknown = [name for name in given if name not in accepted]
    plural = "s" if len(unknown) > 1 else ""
    takes = ", ".join(accepted) if accepted else "no arguments"
    return InvalidArgument(
        f"{tool} does not take the argument{plural} {', '.join(unknown)}; it takes {takes}",
        tool=tool,
        unknown=unknown,
        accepted=list(accepted),
    )


class _StrictServer(MCPServer[Any]):
    """An MCPServer whose tools refuse arguments they do not take.

    The SDK's argument models ignore unknown names, so a misspelt optional
    argument (say `size` for `length`) would silently fall back to its default;
    here it is an InvalidArgument tool error naming it and the accepted ones.
    """

    def __init__(self, accepted: dict[str, tuple[str, ...]], **options: Any) -> None:
        super().__init__(**options)
        self._accepted = accepted

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None
    ) -> CallToolResult | InputRequiredResult:
        accepted = self._accepted.get(name)
        if accepted is not None and not set(arguments) <= set(accepted):
            return error_result(unknown_arguments(name, accepted, list(arguments)))
        return await super().call_tool(name, arguments, context)


def build_server(tools: SlatesTools) -> MCPServer[Any]:
    """An MCPServer offering `tools` (see TOOLS); it does not open the client.

    Each tool's input schema says `additionalProperties: false`, and the server
    enforces it (_StrictServer)."""
    registered: list[Tool] = []
    accepted: dict[str, tuple[str, ...]] = {}
    for name, hints in TOOLS.items():
        method: Callable[..., Any] = getattr(tools, name)
        tool = Tool.from_function(
            _guarded(method),
            name=name,
            description=inspect.cleandoc(method.__doc__ or ""),
            annotations=hints,
            structured_output=True,
        )
        tool.parameters = {**tool.parameters, "additionalProperties": False}
        registered.append(tool)
        accepted[name] = accepted_arguments(method)
    return _StrictServer(
        accepted,
        name=SERVER_NAME,
        title="Slates",
        instructions=INSTRUCTIONS,
        version=__version__,
        log_level="WARNING",
        tools=registered,
    )


def run_stdio(runtime_dir: str | Path | None = None, token: str | None = None) -> None:
    """Serve on stdin/stdout until the client closes stdin; then close the Slates client.

    With `token` (an agent's credential) every tool acts as that agent."""
    tools = SlatesTools(runtime_dir, token)
    try:
        build_server(tools).run("stdio")
    finally:
        tools.close()
