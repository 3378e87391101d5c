"""Merging work done through real mounts: what the kernel writes is recorded as byte ranges.

An agent edits its work volume through a FUSE mount with ordinary system
calls (pwrite into the middle of a file, a new file, a rename, an unlink),
without fsync; another agent edits the same file elsewhere through the SDK.
Both submit, and the green head holds both.  The submit runs the
attachment barrier, so bytes still in the kernel's cache are part of it.
Needs root and /dev/fuse (CI has both).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slates import Client
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)

CONF = b"quality=80\ncache=off\n" + b"".join(b"line %04d\n" % i for i in range(2000))


@pytest.fixture
def project(tmp_path: Path) -> Path:
    base = tmp_path / "project"
    (base / "src").mkdir(parents=True)
    (base / "image.conf").write_bytes(CONF)
    (base / "src" / "old.c").write_text("int old;\n")
    (base / "src" / "gone.c").write_text("int gone;\n")
    return base


@pytest.mark.parametrize("writeback", [False, True], ids=["write-through", "writeback"])
def test_edits_through_a_mount_merge_with_sdk_edits(
    service: Service, project: Path, tmp_path: Path, writeback: bool
) -> None:
    with Client(service.runtime) as client:
        green = client.create_green("main", base=project)
        mine = client.create_work(green, "mounted")
        theirs = client.create_work(green, "sdk")
        with mounted(client, mine["id"], tmp_path / "mnt", writeback=writeback) as where:
            fd = os.open(where / "image.conf", os.O_WRONLY)
            try:
                os.pwrite(fd, b"90", 8)  # quality=80 -> quality=90, nothing else
            finally:
                os.close(fd)
            (where / "src" / "new.c").write_bytes(b"int new;\n")
            os.rename(where / "src" / "old.c", where / "src" / "renamed.c")
            os.unlink(where / "src" / "gone.c")
            # Another agent, meanwhile, changes the end of the same file.
            tail = CONF.index(b"line 1999")
            client.edit(theirs["id"], "/image.conf", tail, tail + 9, b"line LAST, longer")
            assert client.submit(theirs["id"])["ok"]
            result = client.submit(mine["id"])  # runs the barrier: no fsync was needed
            assert result["ok"], result["conflicts"]
            assert result["version"] == 2
            expected = CONF.replace(b"quality=80", b"quality=90").replace(
                b"line 1999", b"line LAST, longer"
            )
            # The mount moved onto version 2: it shows the other agent's work too.
            names = sorted(p.name for p in (where / "src").iterdir())
            assert names == ["new.c", "renamed.c"]
            assert (where / "image.conf").read_bytes() == expected
            assert (where / "image.conf").stat().st_size == len(expected)
        check_the_head(client, green, project, expected)


def check_the_head(client: Client, green: str, project: Path, expected: bytes) -> None:
    assert client.read(green, "/image.conf") == expected
    names = {entry["name"] for entry in client.list(green, "/src")}
    assert names == {"new.c", "renamed.c"}
    assert client.read(green, "/src/renamed.c") == b"int old;\n"
    changed = client.changed_since(green, 1)
    assert set(changed) >= {"/image.conf", "/src/new.c", "/src/renamed.c", "/src/gone.c"}
    # The base directory is never written.
    assert (project / "image.conf").read_bytes() == CONF
    assert sorted(p.name for p in (project / "src").iterdir()) == ["gone.c", "old.c"]


@pytest.mark.parametrize("rewrites", ["refine", "exact"])
def test_a_mount_rewriting_a_whole_file_merges_unless_rewrites_are_exact(
    service: Service, project: Path, tmp_path: Path, rewrites: str
) -> None:
    """Truncate-and-rewrite is recorded as one replacement; at submit it is refined into
    the one line that changed (or, with --rewrites exact, kept whole: a conflict)."""
    with Client(service.runtime) as client:
        green = client.create_green("main", base=project, rewrites=rewrites)
        mine = client.create_work(green, "mounted")
        theirs = client.create_work(green, "sdk")
        with mounted(client, mine["id"], tmp_path / "mnt") as where:
            (where / "image.conf").write_bytes(CONF.replace(b"line 1000", b"line XXXX"))
            client.edit(theirs["id"], "/image.conf", 8, 10, b"90")
            assert client.submit(theirs["id"])["ok"]
            result = client.submit(mine["id"])
            both = CONF.replace(b"quality=80", b"quality=90").replace(b"line 1000", b"line XXXX")
            if rewrites == "refine":
                assert result["ok"] and result["refined"] == ["/image.conf"], result
                assert client.read(green, "/image.conf") == both
                # The mounted work volume moved onto the version it made: the kernel
                # was told, so the mount reads the other agent's edit too.
                assert (where / "image.conf").read_bytes() == both
                return
        assert not result["ok"]
        (conflict,) = result["conflicts"]
        assert conflict["path"] == "/image.conf" and conflict["kind"] == "overlap"
        assert conflict["accepted"] == b"90" and conflict["base_bytes"] == CONF
        # The head keeps the accepted edit; the mounted work keeps its rewrite.
        assert client.read(green, "/image.conf") == CONF.replace(b"quality=80", b"quality=90")
        assert client.read(mine["id"], "/image.conf") == CONF.replace(b"line 1000", b"line XXXX")
