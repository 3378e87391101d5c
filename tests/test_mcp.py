"""`slates mcp` through the official MCP client: stdio_client + ClientSession.

Theory of operation: one test starts a real anchor (the `service` fixture),
makes a green volume from a small project directory with the SDK, then
launches `python -m slates_cli.main mcp --runtime-dir RUNTIME` as the MCP
SDK's stdio subprocess and acts as an agent would: lists the tools (the
expected set, and none that approves, grants, applies or takes a
credential), creates work volumes, writes, edits and reads files (UTF-8 and
base64), submits, meets a structured conflict, rebases, reads the ledger
and the changed paths, requests a landing plan into the project directory
and reads the disk through read_base.  Argument and result names agree
(read_file's offset/length in and out, write_file's offset and length
written, rename's source and destination); a submit of an unchanged work
volume says no version was made, and a dry run reports its paths and makes
none.  Bad input (an unknown volume, a bad range, bad base64, an argument
the tool does not take) comes back as a tool error carrying the Slates
error code, and the server keeps serving.  Throughout, the project directory on
disk must stay exactly as it was.  What the tools claim is checked against
the service through the SDK.  The MCP client is anyio (asyncio): the test is
a plain function that runs it with anyio.run.  Without an anchor: the
argument check and a property of submit's status sentence.
"""

from __future__ import annotations

import base64
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.types import CallToolResult, TextContent

from slates import Client
from slates.errors import InvalidArgument, VerificationFailed
from slates.mcp.results import submit_result
from slates.mcp.server import CHUNK, TOOL_NAMES, SlatesTools, blob, build_server, decode_data
from tests.anchor_fixture import Service, service

__all__ = ["service"]  # the fixture, re-exported for pytest

CONF = b"quality=80\ncache=off\n"
BINARY = bytes([0, 0xFF, 0xFE, 0x80, 10])
EXPECTED_TOOLS = {
    "list_volumes",
    "show_volume",
    "create_work",
    "read_file",
    "write_file",
    "edit_file",
    "make_dir",
    "remove",
    "rename",
    "list_dir",
    "submit",
    "rebase",
    "versions",
    "changed_since",
    "land_plan",
    "land_show",
    "read_base",
}
FORBIDDEN_WORDS = ("approv", "grant", "apply", "credential", "secret", "permit", "key")
CALL_SECONDS = 30


def _project(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "image.conf").write_bytes(CONF)
    (root / "src" / "main.c").write_bytes(b"int main(void) { return 0; }\n")
    (root / "blob.bin").write_bytes(BINARY)
    return root


def _disk_state(root: Path) -> dict[str, tuple[bytes | None, int, int]]:
    """Every entry under root: content (None for directories), mode and mtime."""
    state: dict[str, tuple[bytes | None, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            info = path.lstat()
            content = None if path.is_dir() else path.read_bytes()
            state[str(path.relative_to(root))] = (content, info.st_mode, info.st_mtime_ns)
    return state


def _structured(result: CallToolResult) -> dict[str, Any]:
    assert isinstance(result.structured_content, dict), result
    return result.structured_content


def _text(result: CallToolResult) -> str:
    return "".join(c.text for c in result.content if isinstance(c, TextContent))


Call = Callable[[str, dict[str, Any]], Awaitable[CallToolResult]]


def _session_call(session: ClientSession) -> Call:
    async def call(name: str, arguments: dict[str, Any]) -> CallToolResult:
        with anyio.fail_after(CALL_SECONDS):
            result = await session.call_tool(name, arguments)
        assert isinstance(result, CallToolResult)
        return result

    return call


async def ok(call: Call, tool: str, /, **arguments: Any) -> dict[str, Any]:
    result = await call(tool, arguments)
    assert not result.is_error, _text(result)
    return _structured(result)


async def failed(call: Call, code: str, tool: str, /, **arguments: Any) -> dict[str, Any]:
    """Assert a tool error carrying the Slates error `code`; returns its structured error."""
    result = await call(tool, arguments)
    assert result.is_error, result
    assert _text(result).startswith(f"{code}: "), _text(result)
    error: dict[str, Any] = _structured(result)["error"]
    assert error["code"] == code, error
    return error


async def _check_tools(session: ClientSession) -> None:
    listed = (await session.list_tools()).tools
    names = {tool.name for tool in listed}
    assert names == EXPECTED_TOOLS == TOOL_NAMES
    for tool in listed:
        # Nothing offers approval: no name, description, argument or title speaks of it.
        text = " ".join(
            [tool.name, tool.description or "", tool.title or "", *tool.input_schema["properties"]]
        ).lower()
        for word in FORBIDDEN_WORDS:
            assert word not in text, (tool.name, word)
        assert tool.output_schema is not None, tool.name
        assert tool.input_schema.get("additionalProperties") is False, tool.name
    init = session.initialize_result
    assert init is not None
    instructions = (init.instructions or "").lower()
    assert all(word not in instructions for word in FORBIDDEN_WORDS)


async def _agent(call: Call, session: ClientSession, project: Path, green: str) -> str:
    await _check_tools(session)

    # A work volume on the green head, by the green volume's name.
    work = await ok(call, "create_work", green="main", name="agent1")
    w1 = work["id"]
    assert (work["role"], work["green"], work["version"]) == ("work", green, 0)
    listed = await ok(call, "list_volumes")
    assert {v["id"] for v in listed["volumes"]} == {green, w1}

    read = await ok(call, "read_file", volume=w1, path="/image.conf")
    assert (read["encoding"], read["data"], read["length"]) == ("utf-8", CONF.decode(), len(CONF))
    raw = await ok(call, "read_file", volume="agent1", path="blob.bin")
    assert raw["encoding"] == "base64"
    assert base64.b64decode(raw["data"]) == BINARY

    # edit = replace [start, end); write; base64 write; a new directory; a rename.
    edited = await ok(call, "edit_file", volume=w1, path="/image.conf", start=8, end=10, data="90")
    assert (edited["start"], edited["end"], edited["length"], edited["size"]) == (
        8,
        10,
        2,
        len(CONF),
    )
    wrote = await ok(call, "write_file", volume=w1, path="/notes.txt", data="héllo\n")
    assert (wrote["path"], wrote["offset"], wrote["length"]) == (
        "/notes.txt",
        0,
        len("héllo\n".encode()),
    )
    payload = base64.b64encode(b"\x01\x02\xff").decode()
    await ok(call, "write_file", volume=w1, path="/data.bin", data=payload, encoding="base64")
    await ok(call, "make_dir", volume=w1, path="/docs")
    moved = await ok(call, "rename", volume=w1, source="notes.txt", destination="/docs/notes.txt")
    assert (moved["source"], moved["destination"]) == ("/notes.txt", "/docs/notes.txt")
    await ok(call, "write_file", volume=w1, path="/scratch", data="x")
    await ok(call, "remove", volume=w1, path="/scratch")
    root = await ok(call, "list_dir", volume=w1, path="/")
    assert {e["name"]: e["kind"] for e in root["entries"]} == {
        "image.conf": "file",
        "src": "dir",
        "blob.bin": "file",
        "data.bin": "file",
        "docs": "dir",
    }
    await _offset_and_length(call, w1)

    submitted = await ok(call, "submit", work=w1)
    assert (submitted["ok"], submitted["version"], submitted["conflicts"]) == (True, 1, [])
    _says_a_version_was_made(submitted, 1)
    await _unchanged_submit_makes_no_version(call, w1, green)

    # A second agent from version 0 changes the same bytes: a structured conflict.
    w2 = (await ok(call, "create_work", green=green, name="agent2", version=0))["id"]
    await ok(call, "edit_file", volume=w2, path="/image.conf", start=8, end=10, data="60")
    refused = await ok(call, "submit", work="agent2")
    assert (refused["ok"], refused["version"]) == (False, None)
    [conflict] = refused["conflicts"]
    assert conflict["path"] == "/image.conf"
    assert (conflict["kind"], conflict["version"]) == ("overlap", 1)
    assert (conflict["base"], conflict["head"]) == ([8, 10], [8, 10])
    utf8 = "utf-8"
    assert conflict["base_bytes"] == {"encoding": utf8, "data": "80"}
    assert conflict["accepted"] == {"encoding": utf8, "data": "90"}
    assert conflict["proposed"] == {"encoding": utf8, "data": "60"}
    again = await ok(call, "rebase", work=w2)
    assert (again["ok"], again["version"], len(again["conflicts"])) == (False, 0, 1)

    # A third agent changes other bytes of the same file: rebase, then submit.
    w3 = (await ok(call, "create_work", green=green, name="agent3", version=0))["id"]
    await ok(call, "edit_file", volume=w3, path="/image.conf", start=17, end=20, data="on")
    rebased = await ok(call, "rebase", work=w3)
    assert (rebased["ok"], rebased["version"], rebased["conflicts"]) == (True, 1, [])
    shown = await ok(call, "show_volume", volume=w3)
    assert shown["version"] == 1
    await _dry_runs(call, green, w2, w3)
    read = await ok(call, "read_file", volume=w3, path="/image.conf")
    assert read["data"] == "quality=90\ncache=on\n"
    submitted = await ok(call, "submit", work=w3)
    assert (submitted["ok"], submitted["version"]) == (True, 2)

    ledger = await ok(call, "versions", green="main")
    assert ledger["head"] == 2
    assert [(v["version"], v["base"], v["work"]) for v in ledger["versions"]] == [
        (0, -1, ""),
        (1, 0, w1),
        (2, 1, w3),  # rebased onto version 1 before submitting
    ]
    changed = await ok(call, "changed_since", green="main", version=0)
    assert (changed["green"], changed["version"]) == (green, 0)
    assert set(changed["paths"]) >= {"/image.conf", "/data.bin", "/docs", "/docs/notes.txt"}
    assert (await ok(call, "changed_since", green=green, version=1))["paths"] == ["/image.conf"]

    # A landing plan into the project directory: requested, nothing written.
    plan = await ok(call, "land_plan", volume="main", target=str(project))
    assert plan["target"] == str(project.resolve())
    entries = {e["path"]: e for e in plan["entries"]}
    assert entries["image.conf"]["change"] == "modify"
    assert entries["docs/notes.txt"]["change"] == "create"
    assert entries["docs/notes.txt"]["witnessed"] is None
    assert entries["docs"]["proposed"]["kind"] == "dir"
    again_shown = await ok(call, "land_show", manifest=plan["manifest"])
    assert again_shown["id"] == plan["id"]
    only = await ok(call, "land_plan", volume=green, target=str(project), paths=["image.conf"])
    assert [e["path"] for e in only["entries"]] == ["image.conf"]
    assert only["id"] != plan["id"]
    disk = await ok(call, "read_base", manifest=plan["manifest"], path="image.conf")
    assert (disk["exists"], disk["encoding"], disk["data"]) == (True, "utf-8", CONF.decode())
    assert disk["length"] == len(CONF)
    # Only the manifest's own entries can be read: blob.bin is unchanged, so not one.
    await failed(call, "InvalidArgument", "read_base", manifest=plan["manifest"], path="blob.bin")
    absent = await ok(call, "read_base", manifest=plan["manifest"], path="docs/notes.txt")
    assert (absent["exists"], absent["length"]) == (False, 0)
    return str(w2)


async def _offset_and_length(call: Call, work: str) -> None:
    """read_file takes `offset` and `length` and reports them under the same names;
    write_file reports the `offset` it took and the `length` it wrote."""
    read = await ok(call, "read_file", volume=work, path="/image.conf", offset=8, length=2)
    assert (read["data"], read["offset"], read["length"]) == ("90", 8, 2)
    end = len(CONF) - 3
    tail = await ok(call, "read_file", volume=work, path="image.conf", offset=end, length=100)
    assert (tail["path"], tail["offset"], tail["length"]) == ("/image.conf", end, 3)
    assert tail["data"] == CONF[end:].decode()
    empty = await ok(call, "read_file", volume=work, path="/image.conf", length=0)
    assert (empty["length"], empty["data"]) == (0, "")
    wrote = await ok(call, "write_file", volume=work, path="/scratch2", data="abcdef", offset=4)
    assert (wrote["offset"], wrote["length"]) == (4, 6)
    back = await ok(
        call,
        "read_file",
        volume=work,
        path="/scratch2",
        offset=wrote["offset"],
        length=wrote["length"],
    )
    assert (back["data"], back["length"]) == ("abcdef", 6)
    whole = await ok(call, "read_file", volume=work, path="/scratch2")
    assert (whole["length"], whole["data"]) == (10, "\0\0\0\0abcdef")
    gone = await ok(call, "remove", volume=work, path="/scratch2")
    assert (gone["path"], gone["action"]) == ("/scratch2", "removed")


def _says_a_version_was_made(result: dict[str, Any], version: int) -> None:
    assert (result["made_version"], result["nothing"], result["dry_run"]) == (True, False, False)
    assert result["status"] == f"accepted: version {version} was made"
    assert "/scratch" not in result["paths"]  # made and removed: not a change
    assert set(result["paths"]) >= {"/image.conf", "/data.bin", "/docs/notes.txt"}
    assert result["private"] == 0


async def _unchanged_submit_makes_no_version(call: Call, work: str, green: str) -> None:
    """Submitting a work volume with nothing new says plainly that no version was made."""
    before = await ok(call, "versions", green=green)
    again = await ok(call, "submit", work=work)
    assert await ok(call, "versions", green=green) == before
    assert (again["ok"], again["version"], again["conflicts"]) == (True, before["head"], [])
    assert (again["made_version"], again["nothing"], again["paths"]) == (False, True, [])
    assert again["status"] == "nothing to submit: no version was made"


async def _dry_runs(call: Call, green: str, conflicting: str, clean: str) -> None:
    """A dry run reports the paths it would submit and makes no version."""
    before = await ok(call, "versions", green=green)
    dry = await ok(call, "submit", work=clean, dry_run=True)
    assert (dry["ok"], dry["dry_run"], dry["made_version"], dry["nothing"]) == (
        True,
        True,
        False,
        False,
    )
    assert (dry["paths"], dry["conflicts"]) == (["/image.conf"], [])
    assert dry["status"] == (
        "dry run: 1 path to submit; nothing was submitted and no version was made"
    )
    other = await ok(call, "submit", work=conflicting, dry_run=True)
    assert (other["dry_run"], other["made_version"], other["paths"]) == (
        True,
        False,
        ["/image.conf"],
    )
    # Whether a dry run looks for conflicts is the service's choice; the reply agrees with itself.
    assert other["ok"] == (other["conflicts"] == [])
    assert "no version was made" in other["status"]
    assert await ok(call, "versions", green=green) == before
    # The dry runs left both volumes as they were: the clean one still submits.
    shown = await ok(call, "read_file", volume=clean, path="/image.conf")
    assert shown["data"] == "quality=90\ncache=on\n"


async def _unknown_arguments_refused(call: Call, work: str) -> None:
    """An argument a tool does not take is an InvalidArgument naming it and the accepted
    ones, before the tool acts (not silently dropped, its default taken instead)."""
    error = await failed(
        call, "InvalidArgument", "read_file", volume=work, path="/image.conf", size=2
    )
    assert error["details"] == {
        "tool": "read_file",
        "unknown": ["size"],
        "accepted": ["volume", "path", "offset", "length"],
    }
    assert "size" in error["message"] and "volume, path, offset, length" in error["message"]
    error = await failed(call, "InvalidArgument", "list_volumes", verbose=True)
    assert error["details"] == {"tool": "list_volumes", "unknown": ["verbose"], "accepted": []}
    before = await ok(call, "read_file", volume=work, path="/image.conf")
    await failed(
        call, "InvalidArgument", "write_file", volume=work, path="/image.conf", data="x", trunc=1
    )
    assert await ok(call, "read_file", volume=work, path="/image.conf") == before


async def _bad_input(call: Call, w2: str) -> None:
    """Errors come back as tool errors with the Slates code; the server keeps serving."""
    error = await failed(call, "NotFound", "read_file", volume="vol-0-999", path="/x")
    assert error["details"] == {"volume": "vol-0-999"}
    await failed(call, "NotFound", "read_file", volume="nosuch", path="/x")
    await failed(call, "NotFound", "read_file", volume=w2, path="/missing")
    await failed(call, "InvalidArgument", "edit_file", volume=w2, path="/image.conf", **_range())
    await failed(
        call, "InvalidArgument", "write_file", volume=w2, path="/x", data="!!", encoding="base64"
    )
    await failed(call, "InvalidArgument", "land_plan", volume="main", target="relative/dir")
    await failed(call, "NotFound", "create_work", green="nosuch", name="agent4")
    # Schema violations are tool errors too (the MCP SDK's, without a Slates code).
    result = await call("read_file", {"volume": w2})
    assert result.is_error
    await _unknown_arguments_refused(call, w2)
    # Still serving.
    read = await ok(call, "read_file", volume=w2, path="/image.conf")
    assert read["data"] == "quality=60\ncache=off\n"


async def _big_pieces(call: Call, w2: str) -> None:
    """Writes and edits larger than one request's CHUNK go in pieces, in order."""
    big = "".join(chr(ord("a") + i % 26) for i in range(2 * CHUNK + 1000))
    wrote = await ok(call, "write_file", volume=w2, path="/big.txt", data=big)
    assert (wrote["offset"], wrote["length"]) == (0, len(big))
    edited = await ok(
        call, "edit_file", volume=w2, path="/big.txt", start=10, end=20, data=big.upper()
    )
    assert (edited["length"], edited["size"]) == (len(big), 2 * len(big) - 10)
    expected = big[:10] + big.upper() + big[20:]
    read = await ok(call, "read_file", volume=w2, path="/big.txt")
    assert (read["length"], read["data"] == expected) == (len(expected), True)
    tail = await ok(call, "read_file", volume=w2, path="/big.txt", offset=len(expected) - 5)
    assert tail["data"] == expected[-5:]


def _range() -> dict[str, Any]:
    return {"start": 500, "end": 600, "data": "x"}


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real failure inside the task groups' exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def test_mcp_server_end_to_end(service: Service, tmp_path: Path) -> None:
    project = _project(tmp_path / "project")
    with Client(service.runtime) as client:
        green = client.create_green("main", base=str(project))
    before = _disk_state(project)

    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "slates_cli.main", "mcp", "--runtime-dir", str(service.runtime)],
        cwd=str(tmp_path),
    )
    log_path = tmp_path / "mcp-server.log"

    async def main() -> str:
        with open(log_path, "w") as errlog:
            async with (
                stdio_client(params, errlog=errlog) as (read, write),
                ClientSession(read, write) as session,
            ):
                with anyio.fail_after(CALL_SECONDS):
                    await session.initialize()
                call = _session_call(session)
                w2 = await _agent(call, session, project, green)
                await _bad_input(call, w2)
                await _big_pieces(call, w2)
                return w2

    try:
        w2 = anyio.run(main)
    except BaseException as exc:
        print(log_path.read_text(), file=sys.stderr)
        raise _first_leaf(exc) from exc

    # What the tools claimed, checked through the SDK.
    with Client(service.runtime) as client:
        assert client.versions(green) == 2
        assert client.read(green, "/image.conf") == b"quality=90\ncache=on\n"
        assert client.read(green, "/data.bin") == b"\x01\x02\xff"
        assert client.read(green, "/docs/notes.txt") == "héllo\n".encode()
        assert client.read(w2, "/image.conf") == b"quality=60\ncache=off\n"
    # Nothing the MCP client did touched the project directory.
    assert _disk_state(project) == before


def test_bytes_as_text() -> None:
    assert blob("héllo".encode()) == {"encoding": "utf-8", "data": "héllo"}
    assert blob(BINARY) == {"encoding": "base64", "data": base64.b64encode(BINARY).decode()}
    assert decode_data("héllo", "utf-8") == "héllo".encode()
    assert decode_data(base64.b64encode(BINARY).decode(), "base64") == BINARY
    for data, encoding in (("not base64!", "base64"), ("\ud800", "utf-8"), ("x", "latin-1")):
        with pytest.raises(InvalidArgument):
            decode_data(data, encoding)


def test_no_anchor_is_a_tool_error(tmp_path: Path) -> None:
    """The server starts without an anchor; each call says so, with the Slates code."""
    tools = SlatesTools(tmp_path / "nowhere")
    server = build_server(tools)

    async def main() -> CallToolResult:
        result = await server.call_tool("list_volumes", {})
        assert isinstance(result, CallToolResult)
        return result

    try:
        result = anyio.run(main)
    finally:
        tools.close()
    assert result.is_error
    assert _text(result).startswith("NotFound: no Slates anchor is running here")
    assert _structured(result)["error"]["code"] == "NotFound"


def test_unknown_arguments_are_refused_before_the_client_opens(tmp_path: Path) -> None:
    """The argument check comes first: no anchor is asked (none runs here)."""
    tools = SlatesTools(tmp_path / "nowhere")
    server = build_server(tools)

    async def main() -> CallToolResult:
        result = await server.call_tool("submit", {"work": "w", "dryrun": True})
        assert isinstance(result, CallToolResult)
        return result

    try:
        result = anyio.run(main)
    finally:
        tools.close()
    assert result.is_error
    assert _text(result).startswith(
        "InvalidArgument: submit does not take the argument dryrun; it takes work, dry_run"
    )
    assert tools._client is None  # refused before the client was opened


@given(
    ok_=st.booleans(),
    made=st.booleans(),
    nothing=st.booleans(),
    dry_run=st.booleans(),
    private=st.integers(0, 3),
    paths=st.lists(st.sampled_from(["/a", "/b/c", "/d"]), unique=True),
)
def test_a_submit_status_says_whether_a_version_was_made(
    ok_: bool, made: bool, nothing: bool, dry_run: bool, private: int, paths: list[str]
) -> None:
    made = made and ok_ and not nothing and not dry_run  # the only replies the contract allows
    raw = {
        "ok": ok_,
        "version": 3 if ok_ else None,
        "conflicts": [] if ok_ else [{"path": "/a", "kind": "overlap"}],
        "made_version": made,
        "nothing": nothing,
        "private": private,
        "paths": paths,
        "refined": [],
        "literal": [],
        "dry_run": dry_run,
    }
    result = submit_result("vol-0-1", raw)
    status = result["status"]
    assert ("no version was made" in status) == (not made), status
    assert status.startswith("accepted: version 3 was made") == made, status
    assert ("stayed private" in status) == (ok_ and private > 0), status
    if ok_ and nothing and not dry_run:
        assert status.startswith("nothing to submit: no version was made")
    for key in raw:
        with pytest.raises(VerificationFailed) as raised:
            submit_result("vol-0-1", {k: v for k, v in raw.items() if k != key})
        assert raised.value.details["missing"] == [key]
