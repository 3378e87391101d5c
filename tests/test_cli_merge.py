"""The green/work CLI against a real service: green and work create, submit, rebase, versions.

Theory of operation: as in tests/test_cli_service.py (whose helpers this
module uses), each test starts a real anchor (the `service` fixture) and
runs `python -m slates_cli.main ...` as a child process, checking stdout,
stderr and the exit code.  What a command claims is checked against the
service through the SDK: the green head's files, the ledger, the work
volumes' own files.  The conflicts are the product description's quality
example (80 -> 90 accepted, 80 -> 60 refused) plus a long binary proposal
(cut for people, whole and latin-1 in JSON) and a modify-vs-delete.  A
refused submit or rebase exits with 3 and says `error: Conflict: ...` on
stderr; other failures exit as tests/test_cli_service.py's `failed` expects.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from slates import Client
from tests.anchor_fixture import Service, service
from tests.test_cli_service import failed, ok, ok_json, slates, volumes_of

__all__ = ["service"]  # the fixture, re-exported for pytest

CONF = b"quality=80\ncache=off\n"
NOTES = b"n" * 100
PROPOSED_NOTES = b"b" * 99 + b"\xff"
CONFLICT_LINE = re.compile(r"^error: Conflict: (.+)$", re.MULTILINE)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    base = tmp_path / "project"
    (base / "d").mkdir(parents=True)
    (base / "image.conf").write_bytes(CONF)
    (base / "notes.txt").write_bytes(NOTES)
    (base / "d" / "f").write_bytes(b"hello\n")
    return base


def runtime(service: Service) -> tuple[str, str]:
    return ("--runtime-dir", str(service.runtime))


def refused(done: subprocess.CompletedProcess[bytes], what: str, vid: str) -> str:
    """Assert a submit or rebase was refused (exit 3, one Conflict line); returns stdout."""
    stderr = done.stderr.decode()
    assert done.returncode == 3, (done.returncode, stderr)
    found = CONFLICT_LINE.search(stderr)
    assert found is not None, stderr
    assert found.group(1).startswith(f"{what} of {vid} refused: "), stderr
    stdout: str = done.stdout.decode()
    return stdout


def test_green_and_work_create(service: Service, project: Path) -> None:
    rt = runtime(service)
    human = ok("green", "create", "main", "--base", project, "--bounded", "64MiB", *rt).decode()
    with Client(service.runtime) as client:
        (gid,) = [v["id"] for v in client.list_volumes() if v["name"] == "main"]
        info = client.show_volume(gid)
        assert info["role"] == "green" and info["version"] == 0
        assert info["bounded"] is True and info["limit"] == 64 << 20
        # The base is captured: changing the directory afterwards changes nothing.
        (project / "image.conf").write_bytes(b"changed on disk\n")
        assert client.read(gid, "/image.conf") == CONF
        assert client.versions(gid) == 0
    assert f"Created green volume {gid}" in human and "green, head version 0" in human

    made = ok_json("green", "create", "empty", *rt)
    assert made["role"] == "green" and made["version"] == 0 and made["name"] == "empty"

    work = ok_json("work", "create", "main", "agent1", *rt)  # the green by name
    assert work["role"] == "work" and work["green"] == gid
    assert work["base"] == 0 and work["version"] == 0 and work["name"] == "agent1"
    human = ok("work", "create", gid, "agent2", *rt).decode()  # ... and by id
    with Client(service.runtime) as client:
        (wid,) = [v["id"] for v in client.list_volumes() if v["name"] == "agent2"]
        assert client.show_volume(wid)["green"] == gid
        assert client.read(work["id"], "/image.conf") == CONF
        assert client.read(wid, "/notes.txt") == NOTES
    assert f"Created work volume {wid}" in human
    assert f"work on {gid}, from version 0" in human
    assert sorted(v["name"] for v in volumes_of(service)) == ["agent1", "agent2", "empty", "main"]


def test_submit_versions_and_changed(service: Service, project: Path) -> None:
    rt = runtime(service)
    gid = ok_json("green", "create", "main", "--base", project, *rt)["id"]
    one = ok_json("work", "create", "main", "one", *rt)["id"]
    two = ok_json("work", "create", "main", "two", *rt)["id"]
    with Client(service.runtime) as client:
        client.edit(one, "/image.conf", 0, 0, b"format=webp\n")
        client.edit(two, "/image.conf", 8, 10, b"90")  # the same file, another range
        client.mkdir(two, "/src")
        client.edit(two, "/src/a.c", 0, 0, b"int a;\n")

    assert ok("submit", "one", *rt).decode() == f"{one}: accepted; the green head is version 1\n"
    assert ok_json("submit", two, *rt) == {
        "ok": True,
        "version": 2,
        "conflicts": [],
        "made_version": True,
        "nothing": False,
        "dry_run": False,
        "private": 0,
        "paths": ["/image.conf", "/src", "/src/a.c"],
        "refined": [],
        "literal": [],
        "rebased": True,
    }
    with Client(service.runtime) as client:
        assert client.read(gid, "/image.conf") == b"format=webp\nquality=90\ncache=off\n"
        assert client.read(gid, "/src/a.c") == b"int a;\n"
        assert client.versions(gid) == 2
        ledger = client.ledger(gid)

    # versions: the ledger as the SDK sees it, and as a table.
    assert ok_json("versions", "main", *rt) == ledger
    assert [(v["version"], v["base"], v["work"]) for v in ledger["versions"]] == [
        (0, -1, ""),
        (1, 0, one),
        (2, 0, two),
    ]
    assert ledger["versions"][2]["paths"] == ["/image.conf", "/src", "/src/a.c"]
    table = ok("versions", gid, *rt).decode()
    assert f"Versions of {gid} (head 2)" in table
    for column in ("version", "base", "work", "changed paths"):
        assert column in table
    rows = {line.split()[1]: line for line in table.splitlines() if re.match(r"^│ +\d ", line)}
    assert sorted(rows) == ["0", "1", "2"], table
    assert one in rows["1"] and "/image.conf" in rows["1"] and "/src" not in rows["1"]
    assert two in rows["2"] and "/src/a.c" not in rows["2"]  # the next path is on its own line
    assert "/src/a.c" in table
    last = ok_json("versions", "main", "--limit", "1", *rt)
    assert last["head"] == 2 and [v["version"] for v in last["versions"]] == [2]

    # changed --since: one path per line, or a JSON list; nothing after the head.
    assert ok("changed", "main", "--since", "0", *rt).decode().splitlines() == [
        "/image.conf",
        "/src",
        "/src/a.c",
    ]
    assert ok_json("changed", gid, "--since", "1", *rt) == ["/image.conf", "/src", "/src/a.c"]
    assert ok("changed", "main", "--since", "2", *rt) == b""
    assert ok_json("changed", "main", "--since", "2", *rt) == []

    # A work volume can start from an older version.
    old = ok_json("work", "create", "main", "old", "--version", "1", *rt)
    assert old["base"] == 1
    with Client(service.runtime) as client:
        assert client.read(old["id"], "/image.conf") == b"format=webp\nquality=80\ncache=off\n"


def _conflicting_pair(service: Service, project: Path) -> tuple[str, str, str]:
    """The green, an accepted work volume (version 1) and one whose submit conflicts."""
    rt = runtime(service)
    gid = ok_json("green", "create", "main", "--base", project, *rt)["id"]
    first = ok_json("work", "create", "main", "agent1", *rt)["id"]
    second = ok_json("work", "create", "main", "agent2", *rt)["id"]
    with Client(service.runtime) as client:
        client.edit(first, "/image.conf", 8, 10, b"90")
        client.edit(first, "/notes.txt", 0, 100, b"a" * 100)
        client.unlink(first, "/d/f")
        client.edit(second, "/image.conf", 8, 10, b"60")
        client.edit(second, "/notes.txt", 0, 100, PROPOSED_NOTES)
        client.edit(second, "/d/f", 0, 0, b"x")
    assert ok_json("submit", first, *rt)["version"] == 1
    return gid, first, second


def test_conflicting_submit(service: Service, project: Path) -> None:
    rt = runtime(service)
    gid, _first, second = _conflicting_pair(service, project)

    out = refused(slates("submit", "agent2", *rt), "submit", second)
    assert "Conflict 1 of 3" in out and "Conflict 3 of 3" in out
    sections = re.split(r"(?m)^Conflict \d of 3: ", out)[1:]
    by_path = {section.splitlines()[0].strip(): section for section in sections}
    assert sorted(by_path) == ["/d/f", "/image.conf", "/notes.txt"], out
    quality = by_path["/image.conf"]
    assert re.search(r"kind +│ overlap ", quality), quality
    assert re.search(r"accepted in +│ version 1 ", quality), quality
    assert re.search(r"base range +│ \[8, 10\) ", quality), quality
    assert re.search(r"head range +│ \[8, 10\) ", quality), quality
    # The smallest region where the sides differ, with its line: 9 against 6 (from 8).
    assert re.search(r"│ accepted \(v1\) +│ line 1: quality=90 ", quality), quality
    assert re.search(r"│ proposed +│ line 1: quality=60 ", quality), quality
    assert "differs at [8, 9): '9'" in quality and "differs at [8, 9): '6'" in quality
    assert re.search(r"│ base +│ line 1 at \[8, 9\): '8' ", quality), quality
    notes = by_path["/notes.txt"]
    assert re.search(r"kind +│ overlap ", notes), notes
    assert f"{b'b' * 64!r}... (100 B in all)" in notes  # cut for people
    assert f"{b'n' * 64!r}... (100 B in all)" in notes
    deleted = by_path["/d/f"]
    assert re.search(r"kind +│ modify vs delete ", deleted), deleted
    assert re.search(r"base range +│ - ", deleted) and re.search(r"proposed +│ - ", deleted)

    # With --json: the whole result, bytes as latin-1 strings; still exit 3.
    done = slates("submit", second, "--json", *rt)
    result = json.loads(refused(done, "submit", second))
    assert result["ok"] is False and result["version"] is None
    conflicts = {c["path"]: c for c in result["conflicts"]}
    region = conflicts["/image.conf"].pop("region")
    # The smallest region where the sides differ: the word 90 against 60, on line 1.
    assert (region["accepted"]["data"], region["proposed"]["data"]) == ("9", "6"), region
    assert region["accepted"]["line"] == region["proposed"]["line"] == 1, region
    assert conflicts["/image.conf"] == {
        "path": "/image.conf",
        "kind": "overlap",
        "base": [8, 10],
        "head": [8, 10],
        "base_bytes": "80",
        "accepted": "90",
        "proposed": "60",
        "version": 1,
        "rewrite": False,
    }
    assert conflicts["/notes.txt"]["proposed"].encode("latin-1") == PROPOSED_NOTES
    assert conflicts["/notes.txt"]["base_bytes"].encode("latin-1") == NOTES
    assert conflicts["/d/f"]["kind"] == "modify vs delete"

    # Nothing changed anywhere: the head is version 1, the work keeps its edits.
    with Client(service.runtime) as client:
        assert client.versions(gid) == 1
        assert client.read(gid, "/image.conf") == b"quality=90\ncache=off\n"
        assert client.read(second, "/image.conf") == b"quality=60\ncache=off\n"
        assert client.read(second, "/notes.txt") == PROPOSED_NOTES


def test_rebase(service: Service, project: Path) -> None:
    rt = runtime(service)
    gid, _first, second = _conflicting_pair(service, project)
    third = ok_json("work", "create", "main", "agent3", "--version", "0", *rt)["id"]
    with Client(service.runtime) as client:
        client.edit(third, "/image.conf", 21, 21, b"ttl=300\n")  # after the accepted range

    # A conflicting rebase is refused like a submit and leaves the work volume alone.
    out = refused(slates("rebase", "agent2", *rt), "rebase", second)
    assert "/image.conf" in out and "overlap" in out and "quality=60" in out
    result = json.loads(refused(slates("rebase", second, "--json", *rt), "rebase", second))
    assert result["ok"] is False and result["version"] == 0
    assert {c["path"] for c in result["conflicts"]} == {"/image.conf", "/notes.txt", "/d/f"}

    # A clean rebase moves the work onto the head, keeping its change; it publishes nothing.
    assert ok("rebase", "agent3", *rt).decode() == f"{third}: rebased onto version 1\n"
    with Client(service.runtime) as client:
        assert client.show_volume(third)["version"] == 1
        assert client.read(third, "/image.conf") == b"quality=90\ncache=off\nttl=300\n"
        assert client.read(third, "/notes.txt") == b"a" * 100
        assert client.versions(gid) == 1
        assert client.read(gid, "/image.conf") == b"quality=90\ncache=off\n"
        assert client.read(second, "/image.conf") == b"quality=60\ncache=off\n"
        assert client.show_volume(second)["version"] == 0
    assert ok_json("rebase", third, *rt) == {"ok": True, "version": 1, "conflicts": []}
    assert ok_json("submit", third, *rt) == {
        "ok": True,
        "version": 2,
        "conflicts": [],
        "made_version": True,
        "nothing": False,
        "dry_run": False,
        "private": 0,
        "paths": ["/image.conf"],
        "refined": [],
        "literal": [],
        "rebased": True,
    }
    with Client(service.runtime) as client:
        assert client.read(gid, "/image.conf") == b"quality=90\ncache=off\nttl=300\n"


def test_help_documents_the_conflict_exit_code() -> None:
    for command in ("submit", "rebase"):
        done = slates(command, "--help")
        assert done.returncode == 0
        assert "exit code is 3" in " ".join(done.stdout.decode().split())


def test_bad_input(service: Service, project: Path) -> None:
    rt = runtime(service)
    plain = ok_json("volume", "create", "plain", *rt)["id"]
    gid = ok_json("green", "create", "main", *rt)["id"]
    wid = ok_json("work", "create", "main", "agent", *rt)["id"]
    before = volumes_of(service)

    for args in (
        ("work", "create", "nosuch", "x"),
        ("work", "create", "vol-0-999", "x"),
        ("work", "create", "main", "x", "--version", "9"),
        ("submit", "nosuch"),
        ("rebase", "vol-1-999"),
        ("versions", "nosuch"),
        ("changed", "nosuch", "--since", "0"),
        ("changed", "main", "--since", "1"),
        ("green", "create", "g", "--base", project.parent / "missing"),
    ):
        failed(slates(*args, *rt), "NotFound")
    # A name of a volume of another role: not found among work volumes, and it says so.
    for other_role in (
        ("submit", "plain"),
        ("work", "create", "plain", "x"),
        ("versions", "agent"),
    ):
        assert "it names" in failed(slates(*other_role, *rt), "NotFound"), other_role
    for refused_args, says in (
        (("submit", gid), "not a work volume"),
        (("rebase", plain), "not a work volume"),
        (("work", "create", wid, "x"), "not a green volume"),
        (("changed", plain, "--since", "0", "--json"), "not a green volume"),
        (("green", "create", "g", "--bounded", "1MiB", "--dynamic", "2MiB"), "not both"),
        (("green", "create", "g", "--bounded", "4XB"), "4XB"),
    ):
        assert says in failed(slates(*refused_args, *rt), "InvalidArgument"), refused_args
    # click's own usage errors: exit 2, before anything is asked of the service.
    for usage in (
        ("changed", "main"),  # --since is required
        ("changed", "main", "--since", "-1"),
        ("versions", "main", "--limit", "-1"),
        ("work", "create", "main", "x", "--version", "one"),
    ):
        done = slates(*usage, *rt)
        assert done.returncode == 2 and done.stdout == b"", usage
        assert b"Error:" in done.stderr, usage
    # Bad input changed nothing.
    assert volumes_of(service) == before
    with Client(service.runtime) as client:
        assert client.versions(gid) == 0
        assert client.show_volume(plain)["role"] == "volume"
