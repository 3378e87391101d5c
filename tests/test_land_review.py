"""Regressions from the landing security review: what an agent must not be able to reach.

An agent with only the SDK (no credential file, no terminal) must not read
the approver credential through a plan, a base or read_base; disk reads
stop at the manifest's own entries and never block on a fifo or leak
descriptors; a landing removes only its own temporary names and puts back
an outside save a crash left in one; an empty credential approves nothing;
setuid, setgid and sticky bits are highlighted before the human is asked.
"""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest
from rich.console import Console

from slates import Client
from slates.errors import AccessDenied, InvalidArgument
from slates.land.disk import Target
from slates.land.manifest import Decision, Entry, State
from slates.node.runtime import Runtime
from slates_cli import land as cli_land
from tests.anchor_fixture import Service, service
from tests.test_cli_land import _approve_on_a_terminal
from tests.test_mount import mounted

__all__ = ["service"]


def _file(data: bytes, mode: int = 0o644) -> State:
    return State("file", blake3.blake3(data).hexdigest(), mode)


def _project(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.c").write_bytes(b"int a;\n")
    return root


def test_no_base_or_landing_reaches_the_runtime_directory(service: Service, tmp_path: Path) -> None:
    runtime = service.runtime
    with Client(runtime) as client:
        for base in (runtime, runtime.parent):  # the directory itself, or one holding it
            with pytest.raises(AccessDenied):
                client.create_volume("spy", base=base)
            with pytest.raises(AccessDenied):
                client.create_green("spy", base=base)
        green = client.create_green("main")  # empty: no directory of its own
        work = str(client.create_work(green, "w")["id"])
        client.write(work, "/approver.key", b"mine")
        with pytest.raises(AccessDenied):
            client.land_plan(work, runtime)
        project = _project(tmp_path / "project")
        other = _project(tmp_path / "other")
        captured = client.create_green("captured", base=project)
        with pytest.raises(InvalidArgument):  # only where it was captured from
            client.land_plan(captured, other)
        plan = client.land_plan(client.create_work(captured, "w2")["id"], project)
        with pytest.raises(InvalidArgument):
            client.read_base(plan["manifest"], "src/a.c")  # unchanged: not an entry


def test_read_base_never_blocks_on_a_fifo_nor_leaks_descriptors(
    service: Service, tmp_path: Path
) -> None:
    project = _project(tmp_path / "project")
    with Client(service.runtime) as client:
        green = client.create_green("main", base=project)
        work = str(client.create_work(green, "w")["id"])
        client.write(work, "/src/a.c", b"int b;\n", truncate=True)
        plan = client.land_plan(work, project)
        shard_pid = int(client.status()["shards"][0]["pid"])
        fds = len(os.listdir(f"/proc/{shard_pid}/fd"))
        for _ in range(100):
            assert client.read_base(plan["manifest"], "src/a.c") == b"int a;\n"
        assert len(os.listdir(f"/proc/{shard_pid}/fd")) <= fds + 2
        (project / "src" / "a.c").unlink()
        os.mkfifo(project / "src" / "a.c")
        with pytest.raises(InvalidArgument):
            client.read_base(plan["manifest"], "src/a.c")
        assert client.list_volumes()  # the shard still answers


def test_a_landing_removes_only_its_own_temporary_names(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"old\n")
    (tmp_path / ".slates-land-my-notes.txt").write_bytes(b"the developer's\n")
    entry = Entry("a.txt", _file(b"old\n"), _file(b"new\n"))
    with Target(str(tmp_path)) as target:
        assert target.apply(entry, b"new\n")[0] is Decision.APPLY
        target.finish()
    assert (tmp_path / "a.txt").read_bytes() == b"new\n"
    assert (tmp_path / ".slates-land-my-notes.txt").read_bytes() == b"the developer's\n"


def test_an_outside_save_left_at_a_temporary_name_by_a_crash_goes_back(tmp_path: Path) -> None:
    """A crash between the swap and its check left someone's save at the temporary name."""
    entry = Entry("a.txt", _file(b"old\n"), _file(b"new\n"))
    with Target(str(tmp_path)) as target:
        temp = target._temp_name("a.txt")
    (tmp_path / "a.txt").write_bytes(b"new\n")  # our proposal went in...
    (tmp_path / temp).write_bytes(b"outside save\n")  # ...over an editor's save
    with Target(str(tmp_path)) as target:
        decision, _disk = target.apply(entry, b"new\n")
    assert decision is Decision.CONFLICT
    assert (tmp_path / "a.txt").read_bytes() == b"outside save\n"
    assert not (tmp_path / temp).exists()


def test_a_new_directory_without_write_permission_is_finished_last(tmp_path: Path) -> None:
    entries = [
        Entry("docs", None, State("dir", None, 0o555)),
        Entry("docs/readme", None, _file(b"read me\n")),
    ]
    with Target(str(tmp_path)) as target:
        for entry in entries:
            body = None if entry.proposed is None or entry.proposed.kind == "dir" else b"read me\n"
            assert target.apply(entry, body)[0] is Decision.APPLY
        target.finish()
    assert (tmp_path / "docs" / "readme").read_bytes() == b"read me\n"
    assert (tmp_path / "docs").stat().st_mode & 0o777 == 0o555


def test_a_short_or_empty_credential_is_replaced(tmp_path: Path) -> None:
    runtime = Runtime(tmp_path / "run")
    runtime.prepare()
    runtime.approver_key_file.write_bytes(b"")
    os.chmod(runtime.approver_key_file, 0o600)
    runtime.ensure_approver_key()
    key = runtime.approver_key_file.read_bytes().strip()
    assert len(key) >= 32
    assert runtime.approver_key_file.stat().st_mode & 0o777 == 0o600
    runtime.ensure_approver_key()
    assert runtime.approver_key_file.read_bytes().strip() == key  # kept once good


def test_the_approval_screen_highlights_setuid_setgid_and_sticky_before_asking(
    service: Service, tmp_path: Path
) -> None:
    """An agent's `chmod u+s` in its mount is landed only as the human saw it: the table
    marks the entry and a warning names it before the question on the terminal."""
    project = _project(tmp_path / "project")
    with Client(service.runtime) as client:
        green = client.create_green("main", base=project)
        work = str(client.create_work(green, "w")["id"])
        client.write(work, "/src/tool", b"#!/bin/sh\n")
        client.write(work, "/src/plain", b"plain\n")
        with mounted(client, work, tmp_path / "mnt") as mnt:
            os.chmod(mnt / "src" / "tool", 0o4755)
            os.chmod(mnt / "src" / "plain", 0o755)
        plan = client.land_plan(work, project)
    modes = {e["path"]: e["proposed"][2] for e in plan["entries"]}
    assert modes == {"src/plain": 0o755, "src/tool": 0o4755}
    code, output = _approve_on_a_terminal(service, plan["manifest"], "nope")
    assert code != 0 and "not approved" in output
    question = output.index("to approve landing")
    warning = output.index("WARNING: 1 entry lands with setuid")
    assert warning < question
    assert "SETUID" in output[:question] and "setuid" in output[warning:question]
    assert "src/tool" in output[warning:question]
    assert "src/plain" not in output[warning:question]  # only the entry that asks
    assert "SETUID/SETGID/STICKY" in output[question:]  # said again in the question
    assert not (project / "src" / "tool").exists()  # nothing landed


def test_the_manifest_table_marks_only_entries_with_special_bits() -> None:
    digest = "0" * 64
    plan = {
        "manifest": "man-0-" + digest,
        "source": "snap-1",
        "target": "/t",
        "entries": [
            {"path": "a", "witnessed": None, "proposed": ["file", digest, 0o2755]},
            {"path": "b", "witnessed": None, "proposed": ["dir", None, 0o1777]},
            {"path": "c", "witnessed": ["file", digest, 0o4755], "proposed": None},
            {"path": "d", "witnessed": None, "proposed": ["file", digest, 0o755]},
        ],
    }
    console = Console(record=True, width=200)
    console.print(cli_land._manifest_table(plan, "Approve"))
    cells = [[c.strip() for c in line.split("│")] for line in console.export_text().splitlines()]
    rows = {row[2]: row[4] for row in cells if len(row) == 6 and row[2] in "abcd"}
    assert sorted(rows) == ["a", "b", "c", "d"]
    assert "SETGID" in rows["a"] and "STICKY" in rows["b"]
    assert not any(word in rows[p] for p in ("c", "d") for word in ("SETUID", "SETGID"))
