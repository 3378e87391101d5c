"""The daemon-backed CLI against a real service: volumes, snapshots, clones, files, status.

Theory of operation: each test starts a real anchor (the `service` fixture,
two shards in a temporary runtime directory) and runs
`python -m slates_cli.main ...` as a child process, as a person would,
checking stdout, stderr and the exit code.  What the CLI claims is checked
against the service itself through the SDK (a blocking Client on the same
runtime directory) or against files the test wrote, so a command that
printed plausible output without doing the work would fail.  Errors are
checked by their printed code (`error: <code>: ...`) and by the exit code
that code's fault calls for (2 for the caller's, 1 otherwise).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slates import Client
from slates.errors import error_from_wire
from tests.anchor_fixture import Service, service

__all__ = ["service"]  # the fixture, re-exported for pytest

REPO = Path(__file__).resolve().parent.parent
ERROR_LINE = re.compile(r"^error: (\w+): (.+)$", re.MULTILINE)


@functools.cache
def _python_path() -> str | None:
    """None when slates_cli is installed; else the repository root, which holds it."""
    if importlib.util.find_spec("slates_cli") is not None:
        return None
    return str(REPO)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SLATES_RUNTIME_DIR"}
    if (path := _python_path()) is not None:
        env["PYTHONPATH"] = path
    env["COLUMNS"] = "200"  # tables wide enough that ids and paths are not folded
    env.update(extra or {})
    return env


def slates(
    *args: str | Path, stdin: bytes = b"", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "slates_cli.main", *map(str, args)],
        input=stdin,
        env=_env(env),
        capture_output=True,
        timeout=60,
        check=False,
    )


def ok(*args: str | Path, stdin: bytes = b"") -> bytes:
    done = slates(*args, stdin=stdin)
    assert done.returncode == 0, (args, done.returncode, done.stderr.decode())
    return done.stdout


def ok_json(*args: str | Path) -> Any:
    return json.loads(ok(*args, "--json"))


def failed(done: subprocess.CompletedProcess[bytes], code: str) -> str:
    """Assert the command failed with `code` and its fault's exit code; returns the message."""
    stderr = done.stderr.decode()
    found = ERROR_LINE.search(stderr)
    assert found is not None, (done.returncode, stderr)
    assert found.group(1) == code, stderr
    fault = error_from_wire({"code": code, "message": ""}).fault
    assert done.returncode == (2 if fault == "caller" else 1), (done.returncode, stderr)
    assert done.stdout == b""
    return found.group(2)


def volumes_of(service: Service) -> list[dict[str, Any]]:
    with Client(service.runtime) as client:
        found: list[dict[str, Any]] = client.list_volumes()
    return found


@pytest.fixture
def base_dir(tmp_path: Path) -> Path:
    base = tmp_path / "project"
    (base / "src" / "deep").mkdir(parents=True)
    (base / "README.md").write_bytes(b"# project\n")
    (base / "src" / "main.c").write_bytes(b"int main(void) { return 0; }\n")
    (base / "src" / "deep" / "data.bin").write_bytes(bytes(range(256)) * 40)
    return base


def test_volume_lifecycle_over_a_base(service: Service, base_dir: Path) -> None:
    rt = ("--runtime-dir", service.runtime)
    made = ok_json("volume", "create", "alpha", "--base", base_dir, "--bounded", "64MiB", *rt)
    vid = made["id"]
    assert made["name"] == "alpha" and made["bounded"] is True and made["limit"] == 64 << 20
    assert made["base"] == str(base_dir.resolve())
    with Client(service.runtime) as client:
        assert client.show_volume(vid)["name"] == "alpha"
        assert client.read(vid, "/src/main.c") == (base_dir / "src" / "main.c").read_bytes()

    listed = ok_json("volume", "list", *rt)
    assert [v["id"] for v in listed] == [v["id"] for v in volumes_of(service)] == [vid]
    table = ok("volume", "list", *rt).decode()
    for column in ("id", "name", "shard", "base", "quota", "referenced", "unique"):
        assert column in table
    row = next(line for line in table.splitlines() if vid in line)
    assert "alpha" in row and str(base_dir.resolve()) in row and "bounded 64.00 MiB" in row

    by_id = ok_json("volume", "show", vid, *rt)
    by_name = ok_json("volume", "show", "alpha", *rt)
    with Client(service.runtime) as client:
        assert by_id == by_name == client.show_volume(vid)
    shown = ok("volume", "show", "alpha", *rt).decode()
    assert vid in shown and "bounded 64.00 MiB" in shown

    # An edit in alpha, then a snapshot (by name) and a clone of it that sees the edit.
    ok("write", "alpha", "/README.md", *rt, stdin=b"# edited\n")
    snap = ok("snapshot", "alpha", *rt).decode().strip()
    assert re.fullmatch(r"snap-\d+-\d+", snap), snap
    snap_json = ok_json("snapshot", vid, *rt)
    assert snap_json["volume"] == vid and snap_json["snapshot"] != snap
    cloned = ok_json("clone", snap, "beta", "--dynamic", "32MiB", *rt)
    assert cloned["name"] == "beta" and cloned["bounded"] is False
    assert cloned["limit"] == 32 << 20 and cloned["id"] != vid
    assert ok("read", "beta", "/README.md", *rt) == b"# edited\n"
    assert ok("read", cloned["id"], "/src/deep/data.bin", *rt) == bytes(range(256)) * 40
    human_clone = ok("clone", snap, "gamma", *rt).decode()
    assert "gamma" in human_clone and snap in human_clone

    # Delete by name and by id; the service agrees they are gone.
    assert ok_json("volume", "delete", "beta", *rt) == {"deleted": cloned["id"]}
    assert ok("volume", "delete", vid, *rt).decode().strip() == f"deleted {vid}"
    assert [v["name"] for v in volumes_of(service)] == ["gamma"]
    failed(slates("volume", "show", vid, *rt), "NotFound")
    failed(slates("volume", "show", "alpha", *rt), "NotFound")


def test_status_reports_shards_volumes_and_mounts(service: Service, base_dir: Path) -> None:
    rt = ("--runtime-dir", service.runtime)
    made = [ok_json("volume", "create", f"v{i}", "--base", base_dir, *rt) for i in range(4)]
    report = ok_json("status", *rt)
    assert report["anchor_pid"] == service.process.pid
    assert report["mounts"] == []
    pids = service.shard_pids()
    assert [s["pid"] for s in report["shards"]] == pids and len(pids) == 2
    for pid in pids:
        os.kill(pid, 0)  # a live process, not a made-up number
    placed = {v["id"]: s["shard"] for s in report["shards"] for v in s["volumes"]}
    assert placed == {v["id"]: v["shard"] for v in made}
    for shard in report["shards"]:
        assert {"pid", "restarts", "volumes"} <= shard.keys()

    human = ok("status", *rt).decode()
    assert str(service.process.pid) in human and "2.00 GiB" in human
    for pid in pids:
        assert str(pid) in human
    for v in made:
        assert v["id"] in human


def test_runtime_dir_from_the_environment(service: Service) -> None:
    done = slates(
        "volume", "create", "envvol", "--json", env={"SLATES_RUNTIME_DIR": str(service.runtime)}
    )
    assert done.returncode == 0, done.stderr.decode()
    assert [v["name"] for v in volumes_of(service)] == ["envvol"]


BAD_SIZES = ("4XB", "-1GiB", "0", "GiB", "nan", "inf", "1.5.2MiB")


def test_bad_size_changes_nothing(service: Service) -> None:
    rt = ("--runtime-dir", service.runtime)
    ok("volume", "create", "src", *rt)
    snap = ok("snapshot", "src", *rt).decode().strip()
    for size in BAD_SIZES:
        for args in (
            ("volume", "create", "bad", "--bounded", size),
            ("volume", "create", "bad", "--dynamic", size, "--json"),
            ("clone", snap, "bad", "--bounded", size),
        ):
            message = failed(slates(*args, *rt), "InvalidArgument")
            assert size in message, message
    assert [v["name"] for v in volumes_of(service)] == ["src"]


def test_conflicting_options_change_nothing(service: Service, base_dir: Path) -> None:
    rt = ("--runtime-dir", service.runtime)
    for args in (
        ("volume", "create", "bad", "--bounded", "1MiB", "--dynamic", "2MiB"),
        ("volume", "create", "bad", "--capture"),
        ("volume", "create", "bad", "--base", base_dir, "--from", "snap-0-1"),
    ):
        failed(slates(*args, *rt), "InvalidArgument")
    assert volumes_of(service) == []


def test_create_with_mount_serves_or_changes_nothing(
    service: Service, base_dir: Path, tmp_path: Path
) -> None:
    rt = ("--runtime-dir", service.runtime)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "file").write_bytes(b"")
    # A mount the anchor refuses (a directory that is not empty, or none) deletes the
    # volume the same command created: nothing is left, whatever the error.
    failed(
        slates("volume", "create", "bad", "--base", base_dir, "--mount", busy, *rt),
        "InvalidArgument",
    )
    failed(
        slates("volume", "create", "bad", "--mount", tmp_path / "absent", "--json", *rt), "NotFound"
    )
    assert volumes_of(service) == []

    # For people: the new volume's table, then where it is mounted.
    where = tmp_path / "work"
    where.mkdir()
    human = ok("volume", "create", "work", "--base", base_dir, "--mount", where, *rt).decode()
    try:
        (made,) = volumes_of(service)
        assert f"Created volume {made['id']}" in human
        assert f"{made['id']} mounted at {where.resolve()} (bridge pid " in human
        assert (where / "src" / "main.c").read_bytes() == (base_dir / "src" / "main.c").read_bytes()
    finally:
        ok("unmount", where, *rt)
    assert ok_json("volume", "list", *rt)[0]["mounted_at"] is None


def test_unknown_and_ambiguous_volumes(service: Service) -> None:
    rt = ("--runtime-dir", service.runtime)
    for args in (
        ("volume", "show", "nosuch"),
        ("volume", "show", "vol-0-999"),
        ("volume", "delete", "nosuch"),
        ("snapshot", "nosuch"),
        ("read", "nosuch", "/a"),
        ("ls", "vol-1-999"),
        ("clone", "snap-0-999", "x"),
    ):
        failed(slates(*args, *rt), "NotFound")
    first = ok_json("volume", "create", "twin", *rt)["id"]
    message = failed(slates("volume", "create", "twin", *rt), "AlreadyExists")
    assert first in message  # names are unique: the second is refused, naming the first
    assert len(volumes_of(service)) == 1


def test_capture_then_read_back(service: Service, base_dir: Path) -> None:
    rt = ("--runtime-dir", service.runtime)
    expected = (base_dir / "src" / "deep" / "data.bin").read_bytes()
    captured = ok_json("volume", "create", "captured", "--base", base_dir, "--capture", *rt)
    # A capture holds its own copy: changing the directory afterwards changes nothing.
    (base_dir / "src" / "deep" / "data.bin").write_bytes(b"changed on disk")
    (base_dir / "README.md").unlink()
    assert ok("read", captured["id"], "/src/deep/data.bin", *rt) == expected
    assert ok("read", "captured", "README.md", *rt) == b"# project\n"
    assert captured["counters"]["referenced_bytes"] >= len(expected)
    listing = ok_json("ls", "captured", *rt)
    assert sorted((e["name"], e["kind"]) for e in listing) == [
        ("README.md", "file"),
        ("src", "dir"),
    ]
    # Without --json the capture runs behind a spinner on stderr and prints a table.
    human = slates("volume", "create", "snap2", "--base", base_dir, "--capture", *rt)
    assert human.returncode == 0, human.stderr.decode()
    assert b"snap2" in human.stdout
    with Client(service.runtime) as client:
        (vid,) = [v["id"] for v in client.list_volumes() if v["name"] == "snap2"]
        assert client.read(vid, "/src/deep/data.bin") == b"changed on disk"


def test_write_then_read_round_trip(service: Service) -> None:
    rt = ("--runtime-dir", service.runtime)
    vid = ok_json("volume", "create", "files", "--case-insensitive", *rt)["id"]
    ok("write", "files", "/docs", *rt, stdin=b"")  # a file named docs, then replaced by a dir
    with Client(service.runtime) as client:
        client.unlink(vid, "/docs")
        client.mkdir(vid, "/docs")
    # Larger than one request's piece, with every byte value.
    data = os.urandom(600_000) + bytes(range(256))
    written = json.loads(ok("write", vid, "/docs/Blob.BIN", "--json", *rt, stdin=data))
    assert written == {"volume": vid, "path": "/docs/Blob.BIN", "written": len(data)}
    assert ok("read", "files", "/docs/Blob.BIN", *rt) == data
    assert ok("read", "files", "docs/blob.bin", *rt) == data  # case-insensitive volume
    with Client(service.runtime) as client:
        assert client.stat(vid, "/docs/Blob.BIN")["size"] == len(data)
    # A shorter write replaces the whole file; an empty one leaves it empty.
    human = ok("write", "files", "/docs/Blob.BIN", *rt, stdin=b"short").decode()
    assert f"wrote 5 B to {vid}:/docs/Blob.BIN" in human
    assert ok("read", vid, "/docs/Blob.BIN", *rt) == b"short"
    ok("write", vid, "/docs/Blob.BIN", *rt, stdin=b"")
    assert ok("read", vid, "/docs/Blob.BIN", *rt) == b""
    table = ok("ls", "files", "/docs", *rt).decode()
    assert "Blob.BIN" in table and "file" in table
    failed(slates("read", vid, "/docs", *rt), "IsADirectory")
    failed(slates("read", vid, "/missing", *rt), "NotFound")


def test_no_anchor_running(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for runtime in (empty, tmp_path / "absent"):
        for args in (("status", "--json"), ("volume", "list"), ("read", "v", "/a")):
            done = slates(*args, "--runtime-dir", runtime)
            message = failed(done, "NotFound")
            assert "slates anchor" in message, message
