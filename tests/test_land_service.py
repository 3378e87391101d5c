"""Landing through a real anchor: plans, approval, apply, read_base and rewitness.

The product description's "Writing Approved Changes to Disk" and "Resolving
a Disk Conflict" (quality=80 on the base, 90 agreed, 60 written on disk
meanwhile: M7 conflicts, rewitness gives M8, M7's grant cannot approve M8),
DESIGN.md section 6 and issue 6: grants are single-use and only the holder
of the approver credential issues them (tests do it the way the approval
interface does: `land.grant` with RUNTIME/approver.key; the SDK has no such
call); a concurrent writer never loses its bytes; a SIGKILL in the middle of
a multi-file landing (SLATES_LAND_CRASH_ONCE) leaves every entry old or new
and the retry finishes; nothing is written outside the target.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import pytest

from slates import AsyncClient, Client
from slates.errors import AccessDenied, GrantInvalid, InvalidArgument, NotFound
from slates.land.disk import TEMP_PREFIX
from slates.land.manifest import Entry, Manifest, State
from slates.node.service import shard_of
from tests.anchor_fixture import Service, checkpointing_service, service, start_service

__all__ = ["checkpointing_service", "service"]  # fixtures, re-exported for pytest


NONCE = "0123456789abcdef0123456789abcdef"


BUILD_TREE = {"build/out.o": b"o", "build/cache/x": b"x", "build/cache/y": b"y", "keep.txt": b"k1"}


def remove_build_tree(client: Client, work: str) -> None:
    """`rm -r build` in a work volume, entry by entry."""
    for path in ("/build/cache/x", "/build/cache/y"):
        client.unlink(work, path)
    client.rmdir(work, "/build/cache")
    client.unlink(work, "/build/out.o")
    client.rmdir(work, "/build")


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def approve(client: Client, runtime: Path, manifest: str) -> str:
    """What the approval interface does after a human confirmed: a grant for one manifest."""
    credential = (runtime / "approver.key").read_bytes().strip()
    reply = client.call(
        shard_of(manifest),
        "land.grant",
        manifest=manifest,
        credential=credential,
        nonce=secrets.token_hex(16),
    )
    assert reply["manifest"] == manifest
    return str(reply["grant"])


def outcomes(result: dict[str, Any]) -> dict[str, str]:
    found = {str(e["path"]): str(e["outcome"]) for e in result["entries"]}
    assert len(found) == len(result["entries"])  # every entry exactly once
    return found


def rebuilt(view: dict[str, Any]) -> Manifest:
    """The manifest a plan's view describes, rebuilt locally (its id must match)."""
    entries = tuple(
        Entry(e["path"], State.from_wire(e["witnessed"]), State.from_wire(e["proposed"]))
        for e in view["entries"]
    )
    identity = view["target_identity"]
    return Manifest(
        view["source"], view["target"], entries, None if identity is None else tuple(identity)
    )


def make_tree(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return root


def fingerprint(root: Path) -> dict[str, tuple[Any, ...]]:
    """Names, kinds, bytes, modes and mtimes of everything below root (links not followed)."""
    out: dict[str, tuple[Any, ...]] = {}
    for directory, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            full = os.path.join(directory, name)
            st_ = os.lstat(full)
            if stat.S_ISLNK(st_.st_mode):
                body: Any = os.readlink(full)
            elif stat.S_ISREG(st_.st_mode):
                body = Path(full).read_bytes()
            else:
                body = None
            out[os.path.relpath(full, root)] = (st_.st_mode, body, st_.st_mtime_ns)
    out["."] = (os.lstat(root).st_mode, None, os.lstat(root).st_mtime_ns)
    return out


def temp_names(root: Path) -> list[str]:
    return [
        os.path.join(d, n)
        for d, dirs, files in os.walk(root)
        for n in dirs + files
        if n.startswith(TEMP_PREFIX)
    ]


def green_and_work(client: Client, base: Path, name: str) -> tuple[str, str]:
    green = client.create_green(name, base=base)
    work = str(client.create_work(green, f"{name}-agent")["id"])
    return green, work


# -- the product's disk-conflict flow -------------------------------------------------------


def test_the_product_disk_conflict_flow(service: Service, tmp_path: Path) -> None:
    project = make_tree(tmp_path / "project", {"settings.conf": b"quality=80\n"})
    conf = project / "settings.conf"
    with Client(service.runtime) as client:
        green = client.create_green("main", base=project)
        agent1 = str(client.create_work(green, "agent1")["id"])
        agent2 = str(client.create_work(green, "agent2")["id"])
        client.edit(agent1, "/settings.conf", 8, 10, b"90")
        client.edit(agent2, "/settings.conf", 8, 10, b"90")
        assert client.submit(agent1)["version"] == 1
        assert client.read(green, "/settings.conf") == b"quality=90\n"
        assert client.submit(agent2)["ok"]  # the same change: they agree on 90
        head = client.versions(green)
        assert client.read(green, "/settings.conf") == b"quality=90\n"

        untouched = fingerprint(project)
        m7 = client.land_plan(green, project)
        assert m7 == client.land_plan(green, project, version=head)  # the green head
        assert m7["target"] == str(project.resolve())
        assert m7["entries"] == [
            {
                "path": "settings.conf",
                "witnessed": ["file", digest(b"quality=80\n"), 0o644],
                "proposed": ["file", digest(b"quality=90\n"), 0o644],
            }
        ]
        assert rebuilt(m7).manifest_id == m7["id"]
        assert m7["manifest"] == f"man-{shard_of(green)}-{m7['id']}"
        assert client.land_show(m7["manifest"]) == m7
        assert fingerprint(project) == untouched  # planning writes nothing

        conf.write_bytes(b"quality=60\n")  # the developer, meanwhile
        grant7 = approve(client, service.runtime, m7["manifest"])
        result = client.land_apply(m7["manifest"], grant7)
        assert outcomes(result) == {"settings.conf": "conflict"}
        assert result["complete"] is False and result["conflicts"] == 1
        (entry,) = result["entries"]
        assert entry["disk"] == ["file", digest(b"quality=60\n"), 0o644]
        assert conf.read_bytes() == b"quality=60\n"  # the outside edit is kept

        assert client.read_base(m7["manifest"], "settings.conf") == b"quality=60\n"
        assert client.land_content(m7["manifest"], "settings.conf") == {
            "proposed": b"quality=90\n",
            "disk": b"quality=60\n",
        }

        m8 = client.rewitness(m7["manifest"])
        assert m8["id"] != m7["id"] and m8["manifest"] != m7["manifest"]
        assert rebuilt(m8).manifest_id == m8["id"]
        assert m8["source"] == m7["source"] and m8["target"] == m7["target"]
        assert m8["entries"] == [
            {
                "path": "settings.conf",
                "witnessed": ["file", digest(b"quality=60\n"), 0o644],
                "proposed": ["file", digest(b"quality=90\n"), 0o644],
            }
        ]
        assert conf.read_bytes() == b"quality=60\n"  # rewitness changes no disk

        with pytest.raises(GrantInvalid):
            client.land_apply(m8["manifest"], grant7)  # M7's grant cannot approve M8
        assert conf.read_bytes() == b"quality=60\n"

        grant8 = approve(client, service.runtime, m8["manifest"])
        assert grant8 != grant7
        result = client.land_apply(m8["manifest"], grant8)
        assert outcomes(result) == {"settings.conf": "applied"}
        assert result["complete"] is True and result["conflicts"] == 0
        assert conf.read_bytes() == b"quality=90\n"

        # single use: neither grant lands anything again
        with pytest.raises(GrantInvalid):
            client.land_apply(m8["manifest"], grant8)
        with pytest.raises(GrantInvalid):
            client.land_apply(m7["manifest"], grant7)
        with pytest.raises(GrantInvalid):
            client.land_apply(m8["manifest"], "0" * 64)  # a made-up grant
        assert conf.read_bytes() == b"quality=90\n"
        assert temp_names(project) == []


def test_an_outside_edit_reverted_after_review_can_be_approved_and_landed(
    service: Service, tmp_path: Path
) -> None:
    """The review concludes the outside edit (60) was a mistake and reverts it to 80.
    rewitness then records 80, which is what M7 witnessed: the "new" manifest has M7's
    id.  A human must still be able to approve it; the proposal must stay landable."""
    project = make_tree(tmp_path / "project", {"settings.conf": b"quality=80\n"})
    conf = project / "settings.conf"
    with Client(service.runtime) as client:
        green, work = green_and_work(client, project, "revert")
        client.edit(work, "/settings.conf", 8, 10, b"90")
        assert client.submit(work)["ok"]
        m7 = client.land_plan(green, project)
        conf.write_bytes(b"quality=60\n")
        result = client.land_apply(m7["manifest"], approve(client, service.runtime, m7["manifest"]))
        assert outcomes(result) == {"settings.conf": "conflict"}

        conf.write_bytes(b"quality=80\n")  # reviewed: the developer reverts the edit
        m8 = client.rewitness(m7["manifest"])
        grant = approve(client, service.runtime, m8["manifest"])
        result = client.land_apply(m8["manifest"], grant)
        assert outcomes(result) == {"settings.conf": "applied"}
        assert conf.read_bytes() == b"quality=90\n"


def test_only_the_approver_credential_issues_a_grant(service: Service, tmp_path: Path) -> None:
    key = service.runtime / "approver.key"
    st_ = key.lstat()
    assert stat.S_ISREG(st_.st_mode) and stat.S_IMODE(st_.st_mode) == 0o600
    assert st_.st_uid == os.geteuid()
    credential = key.read_bytes().strip()
    assert len(credential) >= 32
    project = make_tree(tmp_path / "project", {"a.txt": b"one\n"})
    with Client(service.runtime) as client:
        green, work = green_and_work(client, project, "cred")
        client.write(work, "/a.txt", b"two\n", truncate=True)
        assert client.submit(work)["ok"]
        plan = client.land_plan(green, project)
        shard = shard_of(plan["manifest"])
        for wrong in (b"", b"wrong", credential + b"x", credential[:-1], credential.decode(), None):
            with pytest.raises(AccessDenied):
                client.call(
                    shard, "land.grant", manifest=plan["manifest"], credential=wrong, nonce=NONCE
                )
        with pytest.raises(AccessDenied):
            client.call(shard, "land.grant", manifest=plan["manifest"], nonce=NONCE)
        with pytest.raises(NotFound):
            client.call(
                shard,
                "land.grant",
                manifest=f"man-{shard}-{'0' * 64}",
                credential=credential,
                nonce=NONCE,
            )
        assert (project / "a.txt").read_bytes() == b"one\n"
        grant = approve(client, service.runtime, plan["manifest"])
        assert client.land_apply(plan["manifest"], grant)["complete"] is True
        assert (project / "a.txt").read_bytes() == b"two\n"


def test_the_sdk_has_no_call_that_approves(service: Service) -> None:
    for cls in (AsyncClient, Client):
        names = [n for n in dir(cls) if "grant" in n.lower() or "approv" in n.lower()]
        assert names == [], cls
    with Client(service.runtime) as client:
        for name in ("grant", "land_grant", "approve", "land_approve", "approve_landing"):
            with pytest.raises(AttributeError):
                getattr(client, name)
        assert not [n for n in dir(client) if "grant" in n.lower() or "approv" in n.lower()]


@pytest.mark.parametrize("restart", ["journal", "checkpoint"])
def test_plans_and_grants_survive_a_shard_restart(
    request: pytest.FixtureRequest, tmp_path: Path, restart: str
) -> None:
    running: Service = request.getfixturevalue(
        "service" if restart == "journal" else "checkpointing_service"
    )
    project = make_tree(tmp_path / "project", {"a.txt": b"a1\n", "b.txt": b"b1\n"})
    with Client(running.runtime) as client:
        green, work = green_and_work(client, project, f"restart-{restart}")
        client.write(work, "/a.txt", b"a2\n", truncate=True)
        client.write(work, "/b.txt", b"b2\n", truncate=True)
        assert client.submit(work)["ok"]
        first = client.land_plan(green, project, paths=["a.txt"])
        second = client.land_plan(green, project, paths=["b.txt"])
        used = approve(client, running.runtime, first["manifest"])
        assert client.land_apply(first["manifest"], used)["complete"] is True
        unused = approve(client, running.runtime, second["manifest"])
        if restart == "checkpoint":  # enough journal for the shard to checkpoint
            for i in range(4):
                client.write(work, f"/filler{i}", os.urandom(48 << 10))
        index = shard_of(first["manifest"])
        running.wait_restarted(index, running.kill_shard(index))
        assert client.land_show(first["manifest"]) == first
        with pytest.raises(GrantInvalid):
            client.land_apply(first["manifest"], used)
        result = client.land_apply(second["manifest"], unused)
        assert outcomes(result) == {"b.txt": "applied"}
    assert (project / "a.txt").read_bytes() == b"a2\n"
    assert (project / "b.txt").read_bytes() == b"b2\n"


# -- plans ------------------------------------------------------------------------------------


def test_plans_are_reproducible_and_any_change_of_selection_gives_a_new_id(
    service: Service, tmp_path: Path
) -> None:
    project = make_tree(
        tmp_path / "project",
        {"src/app.py": b"v1\n", "src/util.py": b"u1\n", "docs/a.md": b"a\n", "old.txt": b"o\n"},
    )
    other = make_tree(tmp_path / "other", {})
    with Client(service.runtime) as client:
        green, work = green_and_work(client, project, "plans")
        client.write(work, "/src/app.py", b"v2\n", truncate=True)
        client.write(work, "/src/new.py", b"n\n")
        client.unlink(work, "/old.txt")
        client.symlink(work, "/docs/latest", "a.md")
        assert client.submit(work)["version"] == 1
        work2 = str(client.create_work(green, "plans-agent2")["id"])
        client.write(work2, "/docs/a.md", b"a2\n", truncate=True)
        assert client.submit(work2)["version"] == 2

        untouched = fingerprint(project)
        head = client.land_plan(green, project)
        assert client.land_plan(green, project) == head  # the same plan twice: the same id
        views = {
            "head": head,
            "v1": client.land_plan(green, project, version=1),
            "src": client.land_plan(green, project, paths=["src"]),
            "one file": client.land_plan(green, project, paths=["/src/app.py"]),
            "two": client.land_plan(green, project, paths=["src/app.py", "old.txt"]),
        }
        with pytest.raises(InvalidArgument):  # a green lands only where it was captured
            client.land_plan(green, other)
        assert len({v["id"] for v in views.values()}) == len(views)
        for view in views.values():
            assert rebuilt(view).manifest_id == view["id"]
            assert client.land_show(view["manifest"]) == view
        assert fingerprint(project) == untouched

        entries = {e["path"]: e for e in head["entries"]}
        assert sorted(entries) == [
            "docs/a.md",
            "docs/latest",
            "old.txt",
            "src/app.py",
            "src/new.py",
        ]
        assert entries["old.txt"]["proposed"] is None  # a delete
        assert entries["old.txt"]["witnessed"] == ["file", digest(b"o\n"), 0o644]
        assert entries["src/new.py"]["witnessed"] is None  # absent
        assert entries["docs/latest"]["proposed"] == ["symlink", digest(b"a.md"), 0o777]
        assert entries["docs/a.md"]["proposed"] == ["file", digest(b"a2\n"), 0o644]
        assert [e["path"] for e in views["v1"]["entries"]] == [
            "docs/latest",
            "old.txt",
            "src/app.py",
            "src/new.py",
        ]
        assert [e["path"] for e in views["src"]["entries"]] == ["src/app.py", "src/new.py"]
        assert [e["path"] for e in views["two"]["entries"]] == ["old.txt", "src/app.py"]
        with pytest.raises(NotFound):
            client.land_show(f"man-{shard_of(green)}-{'0' * 64}")


# -- the three-way table and every kind of entry ---------------------------------------------


def test_a_landing_reports_each_entry_and_lands_every_kind(
    service: Service, tmp_path: Path
) -> None:
    project = make_tree(
        tmp_path / "project",
        {
            "settings.conf": b"quality=80\n",
            "README.md": b"readme\n",
            "run.sh": b"#!/bin/sh\n",
            "build/out.o": b"\x7fELF",
            "build/cache/x": b"x",
            "docs": b"docs were a file\n",
            "same.txt": b"s1\n",
            "other.txt": b"o1\n",
            "gone.txt": b"g\n",
        },
    )
    (project / "tool").symlink_to("run.sh")
    with Client(service.runtime) as client:
        green, work = green_and_work(client, project, "kinds")
        client.edit(work, "/settings.conf", 8, 10, b"90")
        client.unlink(work, "/README.md")
        ino = client.stat(work, "/run.sh")["ino"]
        client.call(shard_of(work), "fs.setattr", volume=work, ino=ino, mode=0o755)
        client.unlink(work, "/build/cache/x")
        client.rmdir(work, "/build/cache")
        client.unlink(work, "/build/out.o")
        client.rmdir(work, "/build")
        client.write(work, "/build", b"build is a file now\n")
        client.unlink(work, "/docs")
        client.mkdir(work, "/docs", 0o750)
        client.write(work, "/docs/index.md", b"# docs\n")
        client.mkdir(work, "/new")
        client.mkdir(work, "/new/deep", 0o700)
        client.symlink(work, "/new/deep/link", "../../settings.conf")
        client.unlink(work, "/tool")
        client.symlink(work, "/tool", "settings.conf")
        client.write(work, "/same.txt", b"s2\n", truncate=True)
        client.write(work, "/other.txt", b"o2\n", truncate=True)
        client.unlink(work, "/gone.txt")
        assert client.submit(work)["ok"]
        plan = client.land_plan(green, project)

        (project / "same.txt").write_bytes(b"s2\n")  # the disk already holds the proposal
        (project / "other.txt").write_bytes(b"developer\n")  # an outside edit
        (project / "gone.txt").unlink()  # already deleted
        result = client.land_apply(
            plan["manifest"], approve(client, service.runtime, plan["manifest"])
        )
    found = outcomes(result)
    assert found == {
        "README.md": "applied",
        "build": "applied",
        "build/cache": "applied",
        "build/cache/x": "applied",
        "build/out.o": "applied",
        "docs": "applied",
        "docs/index.md": "applied",
        "gone.txt": "identical",
        "new": "applied",
        "new/deep": "applied",
        "new/deep/link": "applied",
        "other.txt": "conflict",
        "run.sh": "applied",
        "same.txt": "identical",
        "settings.conf": "applied",
        "tool": "applied",
    }
    assert result["complete"] is False and result["conflicts"] == 1
    by_path = {e["path"]: e for e in result["entries"]}
    assert by_path["other.txt"]["disk"] == ["file", digest(b"developer\n"), 0o644]
    assert by_path["gone.txt"]["disk"] is None
    assert sorted(os.listdir(project)) == [
        "build",
        "docs",
        "new",
        "other.txt",
        "run.sh",
        "same.txt",
        "settings.conf",
        "tool",
    ]
    assert (project / "settings.conf").read_bytes() == b"quality=90\n"
    assert (project / "other.txt").read_bytes() == b"developer\n"
    assert (project / "same.txt").read_bytes() == b"s2\n"
    assert stat.S_IMODE(os.lstat(project / "run.sh").st_mode) == 0o755
    assert (project / "build").read_bytes() == b"build is a file now\n"
    assert stat.S_ISDIR(os.lstat(project / "docs").st_mode)
    assert stat.S_IMODE(os.lstat(project / "docs").st_mode) == 0o750
    assert (project / "docs" / "index.md").read_bytes() == b"# docs\n"
    assert stat.S_IMODE(os.lstat(project / "new" / "deep").st_mode) == 0o700
    assert os.readlink(project / "new" / "deep" / "link") == "../../settings.conf"
    assert os.readlink(project / "tool") == "settings.conf"
    assert temp_names(project) == []


def test_entries_below_a_directory_the_developer_removed_are_identical(
    service: Service, tmp_path: Path
) -> None:
    """The plan removes build/ (and everything in it); the developer ran `rm -r build/cache`
    meanwhile.  Those entries are already as proposed: identical, and the rest lands."""
    project = make_tree(
        tmp_path / "project",
        BUILD_TREE,
    )
    with Client(service.runtime) as client:
        green, work = green_and_work(client, project, "rmrf")
        remove_build_tree(client, work)
        client.write(work, "/keep.txt", b"k2", truncate=True)
        assert client.submit(work)["ok"]
        plan = client.land_plan(green, project)
        shutil.rmtree(project / "build" / "cache")
        result = client.land_apply(
            plan["manifest"], approve(client, service.runtime, plan["manifest"])
        )
    assert outcomes(result) == {
        "build": "applied",
        "build/cache": "identical",
        "build/cache/x": "identical",
        "build/cache/y": "identical",
        "build/out.o": "applied",
        "keep.txt": "applied",
    }
    assert sorted(os.listdir(project)) == ["keep.txt"]


# -- why entries conflict, and merging an outside edit (rewitness --merge) -------------------


def check(client: Client, manifest: str) -> dict[str, dict[str, Any]]:
    """What the approval screen asks before the question: each entry's outcome if landed now."""
    reply = client.call(shard_of(manifest), "land.check", manifest=manifest)
    assert reply["manifest"] == manifest
    return {str(e["path"]): e for e in reply["entries"]}


def test_the_approval_check_and_every_conflict_outcome_say_why(
    service: Service, tmp_path: Path
) -> None:
    names = ("changed.txt", "gone.txt", "kind.txt", "mode.txt", "ok.txt")
    project = make_tree(tmp_path / "project", {n: f"{n} 1\n".encode() for n in names})
    with Client(service.runtime) as client:
        green, work = green_and_work(client, project, "why")
        for n in names:
            client.write(work, "/" + n, f"{n} 2\n".encode(), truncate=True)
        client.write(work, "/fresh.txt", b"agents\n")
        assert client.submit(work)["ok"]
        plan = client.land_plan(green, project)
        before = check(client, plan["manifest"])
        assert {p: e["outcome"] for p, e in before.items()} == {
            n: "apply" for n in [*names, "fresh.txt"]
        }
        assert all("reason" not in e for e in before.values())

        (project / "changed.txt").write_bytes(b"developer\n")
        (project / "gone.txt").unlink()
        (project / "kind.txt").unlink()
        (project / "kind.txt").mkdir()
        (project / "mode.txt").chmod(0o600)
        (project / "fresh.txt").write_bytes(b"mine\n")
        on_disk = digest(b"developer\n")[:12]
        expected = {
            "changed.txt": f"content changed since the witness (BLAKE3 {on_disk} on disk",
            "gone.txt": "the disk entry vanished",
            "kind.txt": "the disk is a directory, the witness a file and the proposal a file",
            "mode.txt": "mode changed since the witness (600 on disk, 644 witnessed)",
            "fresh.txt": "the disk has a file here where the witness had nothing",
        }
        untouched = fingerprint(project)
        seen = check(client, plan["manifest"])
        assert fingerprint(project) == untouched  # the check only reads
        assert seen["ok.txt"]["outcome"] == "apply"
        for path, words in expected.items():
            assert seen[path]["outcome"] == "conflict", path
            assert words in seen[path]["reason"], (path, seen[path]["reason"])

        result = client.land_apply(
            plan["manifest"], approve(client, service.runtime, plan["manifest"])
        )
    found = outcomes(result)
    assert found == {"ok.txt": "applied", **{p: "conflict" for p in expected}}
    for entry in result["entries"]:
        if entry["outcome"] == "conflict":
            assert expected[entry["path"]] in entry["reason"], entry
            assert entry["reason"] == seen[entry["path"]]["reason"]
        else:
            assert "reason" not in entry
    assert (project / "changed.txt").read_bytes() == b"developer\n"
    assert (project / "ok.txt").read_bytes() == b"ok.txt 2\n"


SETTINGS = b"quality=80\ncache=off\nsize=10\n"


@pytest.mark.parametrize("restart", ["journal", "checkpoint"])
def test_rewitness_merge_keeps_the_developers_line_and_lands_both(
    request: pytest.FixtureRequest, tmp_path: Path, restart: str
) -> None:
    running: Service = request.getfixturevalue(
        "service" if restart == "journal" else "checkpointing_service"
    )
    project = make_tree(tmp_path / "project", {"settings.conf": SETTINGS, "other.conf": b"a=1\n"})
    settings_conf, other_conf = project / "settings.conf", project / "other.conf"
    with Client(running.runtime) as client:
        green, work = green_and_work(client, project, f"merge-{restart}")
        client.edit(work, "/settings.conf", 8, 10, b"90")
        client.write(work, "/other.conf", b"a=2\n", truncate=True)
        assert client.submit(work)["ok"]
        m7 = client.land_plan(green, project)
        grant7 = approve(client, running.runtime, m7["manifest"])  # approved, not yet used

        settings_conf.write_bytes(b"quality=80\ncache=off\nsize=12\n")  # another line
        other_conf.write_bytes(b"a=3\n")  # the very bytes the agents changed
        m8 = client.rewitness(m7["manifest"], merge=True)
        merged = b"quality=90\ncache=off\nsize=12\n"
        assert m8["merged"] == ["settings.conf"]
        [unmerged] = m8["unmerged"]
        assert unmerged["path"] == "other.conf" and "overlaps the proposal" in unmerged["reason"]
        assert m8["id"] != m7["id"] and rebuilt(m8).manifest_id == m8["id"]
        entries = {e["path"]: e for e in m8["entries"]}
        assert entries["settings.conf"] == {
            "path": "settings.conf",
            "witnessed": ["file", digest(b"quality=80\ncache=off\nsize=12\n"), 0o644],
            "proposed": ["file", digest(merged), 0o644],
        }
        assert entries["other.conf"] == next(
            e for e in m7["entries"] if e["path"] == "other.conf"
        )  # the overlapping one stays as it was: it will conflict
        assert settings_conf.read_bytes() == b"quality=80\ncache=off\nsize=12\n"  # no disk write
        assert client.land_content(m8["manifest"], "settings.conf")["proposed"] == merged
        # Only the overlapping entry is selected: nothing merges, the manifest is the same.
        same = client.rewitness(m7["manifest"], paths=["other.conf"], merge=True)
        assert same["id"] == m7["id"] and same["merged"] == []
        assert [u["path"] for u in same["unmerged"]] == ["other.conf"]

        with pytest.raises(GrantInvalid):
            client.land_apply(m8["manifest"], grant7)  # M7's grant cannot approve M8
        assert settings_conf.read_bytes() == b"quality=80\ncache=off\nsize=12\n"

        # The merged bytes exist in no snapshot: the shard must keep them across a restart.
        if restart == "checkpoint":
            for i in range(4):
                client.write(work, f"/filler{i}", os.urandom(48 << 10))
        index = shard_of(m8["manifest"])
        running.wait_restarted(index, running.kill_shard(index))
        view = {k: v for k, v in m8.items() if k not in ("merged", "unmerged")}
        assert client.land_show(m8["manifest"]) == view
        assert client.land_content(m8["manifest"], "settings.conf")["proposed"] == merged

        # A person resolves other.conf (the agents' value wins) with a plain rewitness;
        # the merged proposal of settings.conf goes along into that manifest.
        m9 = client.rewitness(m8["manifest"], paths=["other.conf"])
        assert m9["id"] not in (m7["id"], m8["id"])
        result = client.land_apply(m9["manifest"], approve(client, running.runtime, m9["manifest"]))
        assert outcomes(result) == {"other.conf": "applied", "settings.conf": "applied"}
    assert settings_conf.read_bytes() == merged  # the developer's line and the agents' change
    assert other_conf.read_bytes() == b"a=2\n"
    assert temp_names(project) == []


def test_landing_a_merged_manifest_with_an_overlap_left_conflicts_with_its_reason(
    service: Service, tmp_path: Path
) -> None:
    project = make_tree(tmp_path / "project", {"settings.conf": SETTINGS, "other.conf": b"a=1\n"})
    with Client(service.runtime) as client:
        green, work = green_and_work(client, project, "merge-overlap")
        client.edit(work, "/settings.conf", 8, 10, b"90")
        client.write(work, "/other.conf", b"a=2\n", truncate=True)
        assert client.submit(work)["ok"]
        m7 = client.land_plan(green, project)
        (project / "settings.conf").write_bytes(b"quality=80\ncache=on\nsize=10\n")
        (project / "other.conf").write_bytes(b"a=3\n")
        m8 = client.rewitness(m7["manifest"], merge=True)
        seen = check(client, m8["manifest"])
        assert seen["settings.conf"]["outcome"] == "apply"
        assert seen["other.conf"]["outcome"] == "conflict"
        assert "content changed since the witness" in seen["other.conf"]["reason"]
        result = client.land_apply(m8["manifest"], approve(client, service.runtime, m8["manifest"]))
    assert outcomes(result) == {"other.conf": "conflict", "settings.conf": "applied"}
    assert (project / "settings.conf").read_bytes() == b"quality=90\ncache=on\nsize=10\n"
    assert (project / "other.conf").read_bytes() == b"a=3\n"  # left for a person to resolve


# -- path traversal -----------------------------------------------------------------------------


@pytest.fixture
def escape_project(tmp_path: Path) -> tuple[Path, Path]:
    outside = make_tree(tmp_path / "outside", {"f": b"quality=80\n", "secret": b"secret\n"})
    project = make_tree(tmp_path / "project", {"sub/f": b"quality=80\n", "top": b"top1\n"})
    return project, outside


def test_a_selection_or_path_leaving_the_target_is_refused(
    service: Service, escape_project: tuple[Path, Path]
) -> None:
    project, outside = escape_project
    before = fingerprint(outside)
    with Client(service.runtime) as client:
        green, work = green_and_work(client, project, "dots")
        client.write(work, "/sub/f", b"quality=90\n", truncate=True)
        assert client.submit(work)["ok"]
        for bad in ("..", "../outside", "sub/../../outside", "sub/..", "a//b", "./sub", "/.."):
            with pytest.raises(InvalidArgument):
                client.land_plan(green, project, paths=[bad])
        with pytest.raises(InvalidArgument):  # the SDK resolves targets; the shard insists
            client.call(shard_of(green), "land.plan", volume=green, target="relative/project")
        plan = client.land_plan(green, project)
        for bad in ("../outside/secret", "sub/../../outside/secret", "..", "a//b"):
            with pytest.raises(InvalidArgument):
                client.read_base(plan["manifest"], bad)
            with pytest.raises(InvalidArgument):
                client.land_content(plan["manifest"], bad)
        with pytest.raises(InvalidArgument):
            client.rewitness(plan["manifest"], paths=["../outside/f"])
        # an absolute path is a path in the target, never the host's; and only the
        # manifest's own entries are read
        assert client.read_base(plan["manifest"], "/sub/f") == b"quality=80\n"
        for not_an_entry in ("/etc/hostname", "top"):
            with pytest.raises(InvalidArgument):
                client.read_base(plan["manifest"], not_an_entry)
    assert fingerprint(outside) == before


def test_a_symlinked_directory_in_the_target_fails_its_entry_and_writes_nothing_outside(
    service: Service, escape_project: tuple[Path, Path]
) -> None:
    project, outside = escape_project
    with Client(service.runtime) as client:
        green, work = green_and_work(client, project, "symdir")
        client.write(work, "/sub/f", b"quality=90\n", truncate=True)
        client.write(work, "/sub/new", b"new\n")
        client.write(work, "/top", b"top2\n", truncate=True)
        assert client.submit(work)["ok"]
        plan = client.land_plan(green, project)
        # someone replaces sub/ by a link out of the target, whose f even holds the witness
        (project / "sub").rename(project / "sub.moved")
        (project / "sub").symlink_to(outside)
        before = fingerprint(outside)
        with pytest.raises(AccessDenied):
            client.read_base(plan["manifest"], "sub/f")
        result = client.land_apply(
            plan["manifest"], approve(client, service.runtime, plan["manifest"])
        )
    found = outcomes(result)
    assert found["sub/f"] == "failed"
    failed = next(e for e in result["entries"] if e["path"] == "sub/f")
    assert "is a symlink" in failed["reason"]
    assert found["sub/new"] in ("failed", "not attempted")
    assert result["complete"] is False
    assert all(found[p] in ("applied", "not attempted") for p in found if not p.startswith("sub/"))
    assert fingerprint(outside) == before
    assert os.readlink(project / "sub") == str(outside)
    assert not (outside / "new").exists()


def test_a_symlink_at_an_entry_is_never_followed_and_replaced_only_after_review(
    service: Service, escape_project: tuple[Path, Path]
) -> None:
    project, outside = escape_project
    with Client(service.runtime) as client:
        green, work = green_and_work(client, project, "symentry")
        client.write(work, "/top", b"top2\n", truncate=True)
        client.write(work, "/fresh", b"fresh\n")
        assert client.submit(work)["ok"]
        m7 = client.land_plan(green, project)
        (project / "top").unlink()
        (project / "top").symlink_to(outside / "secret")  # planted at the entry itself
        (project / "fresh").symlink_to(outside / "fresh")  # dangling: following would create
        before = fingerprint(outside)
        assert client.read_base(m7["manifest"], "top") == str(outside / "secret").encode()
        result = client.land_apply(m7["manifest"], approve(client, service.runtime, m7["manifest"]))
        assert outcomes(result) == {"fresh": "conflict", "top": "conflict"}
        assert fingerprint(outside) == before
        assert os.readlink(project / "top") == str(outside / "secret")

        m8 = client.rewitness(m7["manifest"])  # reviewed: the links are to be replaced
        witnessed = {e["path"]: e["witnessed"] for e in m8["entries"]}
        assert witnessed["top"][0] == witnessed["fresh"][0] == "symlink"
        result = client.land_apply(m8["manifest"], approve(client, service.runtime, m8["manifest"]))
        assert outcomes(result) == {"fresh": "applied", "top": "applied"}
    assert fingerprint(outside) == before
    assert not (project / "top").is_symlink() and (project / "top").read_bytes() == b"top2\n"
    assert not (project / "fresh").is_symlink() and (project / "fresh").read_bytes() == b"fresh\n"


# -- a concurrent writer ------------------------------------------------------------------------


@dataclass
class Save:
    data: bytes
    started: int  # monotonic ns before open (or before writing the editor's temp file)
    finished: int  # monotonic ns after close (or after the rename)


@dataclass
class Writer:
    """A developer's editor saving target files while the landing applies.

    The landing writes entries in path order; the writer finds its frontier (the first
    file it has not touched that does not hold the proposal yet: sizes tell them apart)
    and saves that file for the first time whenever the landing has moved on, so first
    saves meet the landing's decisions and swaps; in between it saves again files it
    touched before.  Half the
    files are saved editor-style (write a temporary file, rename it over), half in place
    (open truncating, write, close).  Every save is recorded with its times.
    """

    root: Path
    order: list[str]  # the landing's order
    proposed_size: dict[str, int]
    saves: dict[str, list[Save]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)
    count: int = 0

    def editor_style(self, path: str) -> bool:
        return self.order.index(path) % 2 == 0

    def save(self, path: str) -> None:
        self.count += 1
        data = f"writer {path} save {self.count}\n".encode()
        full = self.root / path
        started = time.monotonic_ns()
        if self.editor_style(path):
            temp = full.with_name(f".{full.name}.swp")
            temp.write_bytes(data)
            os.rename(temp, full)
        else:
            fd = os.open(full, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        self.saves.setdefault(path, []).append(Save(data, started, time.monotonic_ns()))

    def frontier(self, fresh: list[str]) -> int:
        lo, hi = 0, len(fresh)
        while lo < hi:
            mid = (lo + hi) // 2
            landed = os.stat(self.root / fresh[mid]).st_size == self.proposed_size[fresh[mid]]
            lo, hi = (mid + 1, hi) if landed else (lo, mid)
        return lo

    def run(self) -> None:
        step, last = 0, -2
        try:
            while not self.stop.is_set():
                step += 1
                fresh = [p for p in self.order if p not in self.saves]
                at = self.frontier(fresh)
                # in step with the landing: a first save once it has passed the last one
                if at < len(fresh) and self.order.index(fresh[at]) >= last + 2:
                    last = self.order.index(fresh[at])
                    self.save(fresh[at])
                elif self.saves and step % 4 == 0:
                    touched = sorted(self.saves)
                    self.save(touched[(step * 7) % len(touched)])
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)


def test_a_concurrent_writer_never_loses_its_bytes(service: Service, tmp_path: Path) -> None:
    names = [f"d{d}/f{f:02}.txt" for d in range(10) for f in range(30)]
    project = make_tree(tmp_path / "project", {n: f"old {n}\n".encode() for n in names})
    proposal = {n: f"new {n}\n".encode() * 4 for n in names}
    early = names[::29]  # saved once before the landing starts
    with Client(service.runtime) as client:
        green, work = green_and_work(client, project, "race")
        for n in names:
            client.write(work, "/" + n, proposal[n], truncate=True)
        assert client.submit(work)["ok"]
        plan = client.land_plan(green, project)
        assert [e["path"] for e in plan["entries"]] == sorted(names)
        grant = approve(client, service.runtime, plan["manifest"])

        writer = Writer(project, sorted(names), {n: len(d) for n, d in proposal.items()})
        for n in early:
            writer.save(n)
        thread = threading.Thread(target=writer.run)
        t0 = time.monotonic_ns()
        thread.start()
        try:
            result = client.land_apply(plan["manifest"], grant)
            t1 = time.monotonic_ns()
        finally:
            writer.stop.set()
            thread.join()
    assert not writer.errors
    found = outcomes(result)
    assert set(found) == set(names)
    assert result["conflicts"] == sum(1 for o in found.values() if o == "conflict")
    during = [s for saves in writer.saves.values() for s in saves if t0 <= s.started <= t1]
    assert len(during) > 20, "the writer hardly wrote while the landing ran"
    witness = {n: ["file", digest(f"old {n}\n".encode()), 0o644] for n in names}
    by_path = {e["path"]: e for e in result["entries"]}
    for n in names:
        final = (project / n).read_bytes()
        if n not in writer.saves:
            assert found[n] == "applied" and final == proposal[n], n
            continue
        last = writer.saves[n][-1]
        assert found[n] in ("applied", "conflict"), (n, found[n])
        if found[n] == "conflict" or writer.editor_style(n):
            # Left alone, the disk holds the writer's last save, whole.  And a rename
            # replaces whatever is there: a save after our swap wins over the proposal.
            assert final == last.data, (n, found[n], final, [s.data for s in writer.saves[n]])
        else:
            # In place, a save whose file was opened before our swap can land in the
            # swapped-out file; that is the last save only if it overlapped the landing.
            assert final == last.data or (final == proposal[n] and last.started < t1), (n, final)
        if n in early:
            # saved before the landing began: the disk was not the witness when decided
            assert found[n] == "conflict", n
            assert by_path[n]["disk"] != witness[n]
    assert temp_names(project) == []


# -- a crash in the middle of a landing ----------------------------------------------------


@pytest.fixture(scope="module")
def crashing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Path]]:
    """An anchor whose shards SIGKILL themselves after a landed entry while `flag` exists."""
    base = tmp_path_factory.mktemp("crashing")
    flag = base / "crash-once"
    running = start_service(base / "run", env={"SLATES_LAND_CRASH_ONCE": str(flag)})
    try:
        yield running, flag
    finally:
        running.stop()


def restarts(running: Service) -> list[int]:
    shards = running.state()["shards"]
    assert isinstance(shards, list)
    return [int(s["restarts"]) for s in shards]


@dataclass
class Observer:
    """Reads every target file again and again: each must be old or new, whole."""

    root: Path
    allowed: dict[str, tuple[bytes, ...]]
    stop: threading.Event = field(default_factory=threading.Event)
    bad: list[tuple[str, bytes | None]] = field(default_factory=list)
    rounds: int = 0

    def run(self) -> None:
        while not self.stop.is_set():
            for path, allowed in self.allowed.items():
                try:
                    data: bytes | None = (self.root / path).read_bytes()
                except FileNotFoundError:
                    data = None
                if data not in allowed:
                    self.bad.append((path, data))
            self.rounds += 1


def test_a_crash_in_the_middle_of_a_landing_is_finished_by_the_retry(
    crashing: tuple[Service, Path], tmp_path: Path
) -> None:
    running, flag = crashing
    names = [f"f{i:02}.txt" for i in range(50)]
    old = {n: f"old {n}\n".encode() * 50 for n in names}
    new = {n: f"new {n}\n".encode() * 60 for n in names}
    project = make_tree(tmp_path / "project", old)
    with Client(running.runtime) as client:
        green, work = green_and_work(client, project, "crash")
        for n in names:
            client.write(work, "/" + n, new[n], truncate=True)
        assert client.submit(work)["ok"]
        plan = client.land_plan(green, project)
        grant = approve(client, running.runtime, plan["manifest"])
        # The first 20 are already on disk (identical), so the shard dies after f20.txt,
        # the first entry it writes, with 29 entries still to go.
        for n in names[:20]:
            (project / n).write_bytes(new[n])
        observer = Observer(project, {n: (old[n], new[n]) for n in names})
        thread = threading.Thread(target=observer.run)
        before = restarts(running)
        flag.write_bytes(b"")
        thread.start()
        try:
            # The SDK resends the same request to the restarted shard: the landing was not
            # committed, so its grant is unused and the request runs again (landing.py).
            result = client.land_apply(plan["manifest"], grant)
        finally:
            observer.stop.set()
            thread.join()
        assert not flag.exists(), "the shard did not reach the failpoint"
        assert sum(restarts(running)) == sum(before) + 1
        with pytest.raises(GrantInvalid):  # now it is committed: used
            client.land_apply(plan["manifest"], grant)
    assert observer.bad == [] and observer.rounds > 0
    found = outcomes(result)
    assert found == {n: ("identical" if i <= 20 else "applied") for i, n in enumerate(names)}
    assert result["complete"] is True
    assert {n: (project / n).read_bytes() for n in names} == new
    assert temp_names(project) == []


def test_a_crash_while_removing_a_directory_tree_is_finished_by_the_retry(
    crashing: tuple[Service, Path], tmp_path: Path
) -> None:
    running, flag = crashing
    project = make_tree(
        tmp_path / "project",
        BUILD_TREE,
    )
    with Client(running.runtime) as client:
        green, work = green_and_work(client, project, "crash-tree")
        remove_build_tree(client, work)
        assert client.submit(work)["ok"]
        plan = client.land_plan(green, project)
        grant = approve(client, running.runtime, plan["manifest"])
        # The developer emptied build/cache already, so the first entry the shard writes
        # is the removal of build/cache itself; it dies right after it.
        for name in ("x", "y"):
            (project / "build" / "cache" / name).unlink()
        before = restarts(running)
        flag.write_bytes(b"")
        result = client.land_apply(plan["manifest"], grant)
        assert not flag.exists(), "the shard did not reach the failpoint"
        assert sum(restarts(running)) == sum(before) + 1
    assert outcomes(result) == {
        "build": "applied",
        "build/cache": "identical",
        "build/cache/x": "identical",
        "build/cache/y": "identical",
        "build/out.o": "applied",
    }
    assert sorted(os.listdir(project)) == ["keep.txt"]
