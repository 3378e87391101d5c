"""Paths (issue 12): bases and landing targets are opened once and never left.

DESIGN.md section 6a, "Paths".  Each attack of the review is here as a
regression test:

- a base or target named through a symlink that is swapped after it was
  opened (to the runtime directory, which holds the approver credential,
  or to a directory nobody approved) is never followed: the reader keeps
  reading, and the landing keeps writing, the directory that was opened,
  and opening the swapped name again is refused;
- the runtime directory is refused by (dev, ino), also under another name
  (a symlink, a bind mount), when it is the directory, holds it or lies
  inside it;
- `open_beneath` never leaves its directory ("..", symlinks, mounts), with
  the kernel's openat2 and with the component walk used without it (a
  hypothesis property: both agree and neither escapes);
- a base or target on a FUSE mount (a real Slates mount served by the same
  shard), or named through one, is refused at once, without a request to
  the mount, and the shard keeps answering; a mount inside a base or a
  target is never entered;
- landing details: names that are not UTF-8 land, setuid/setgid/sticky
  bits only as the manifest's proposed mode carries them, a file is 0600
  until its bytes are durable, and an entry that fails leaves no
  temporary name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slates.land.disk as disk
from slates import Client
from slates.base import beneath
from slates.base.beneath import Anchored, open_beneath
from slates.base.capturing import capture_into
from slates.base.live import LiveDirectory
from slates.core.host import Host
from slates.core.volume import ROOT_INO, Volume
from slates.errors import AccessDenied, InvalidArgument, NotFound, SlatesError
from slates.land.disk import TEMP_PREFIX, Target, state_of_bytes
from slates.land.manifest import Decision, Entry, State, landed_mode, special_bits
from slates.node.runtime import Runtime
from slates.node.service import shard_of
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted

__all__ = ["service"]

SECRET = b"the approver credential\n"


def _file(data: bytes, mode: int = 0o644) -> State:
    return state_of_bytes("file", data, mode)


def _temp_names(root: Path) -> list[str]:
    return [
        os.path.join(d, n)
        for d, dirs, files in os.walk(root)
        for n in dirs + files
        if n.startswith(TEMP_PREFIX)
    ]


def _swap(link: Path, to: Path) -> None:
    """Point the symlink `link` at `to` in one rename (as an attacker would)."""
    fresh = link.with_name(link.name + ".new")
    fresh.symlink_to(to)
    os.rename(fresh, link)


@pytest.fixture
def scene(tmp_path: Path) -> dict[str, Path]:
    """A project, a runtime directory holding a credential, another directory, and a
    symlink `alias` to the project (to be swapped)."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "a.c").write_bytes(b"int a;\n")
    runtime = tmp_path / "fake-run"  # tmp_path / "run" is the service fixture's
    runtime.mkdir()
    (runtime / "approver.key").write_bytes(SECRET)
    (runtime / "src").mkdir()
    (runtime / "src" / "a.c").write_bytes(SECRET)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "src").mkdir(parents=True)
    (elsewhere / "src" / "a.c").write_bytes(b"int a;\n")
    alias = tmp_path / "alias"
    alias.symlink_to(project)
    return {
        "project": project,
        "runtime": runtime,
        "elsewhere": elsewhere,
        "alias": alias,
        "root": tmp_path,
    }


@contextlib.contextmanager
def _bind(source: Path, where: Path) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(source), str(where)], check=True)
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)  # a test left an fd


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the kernel's openat2 and with the walk used where it is missing."""
    if request.param == "walk":
        monkeypatch.setattr(beneath._Openat2, "available", False)
    else:
        assert beneath._Openat2.available, "openat2 is expected on this kernel"
    return str(request.param)


# -- open_beneath ------------------------------------------------------------------


def test_open_beneath_never_leaves_its_directory(scene: dict[str, Path], resolver: str) -> None:
    project, runtime = scene["project"], scene["runtime"]
    (project / "out").symlink_to(runtime)
    (project / "up").symlink_to("..")
    (project / "key").symlink_to(runtime / "approver.key")
    with Anchored(str(project)) as anchor:
        for escape in ("../fake-run/approver.key", "src/../../fake-run/approver.key"):
            with pytest.raises(AccessDenied):
                anchor.open(escape, os.O_RDONLY)
        for through_link in ("out/approver.key", "up/fake-run/approver.key", "key"):
            with pytest.raises(OSError) as caught:
                anchor.open(through_link, os.O_RDONLY)
            assert caught.value.errno == errno.ELOOP
        with pytest.raises(InvalidArgument):
            anchor.open(str(runtime / "approver.key"), os.O_RDONLY)
        # O_PATH | O_NOFOLLOW opens a final link itself (to stat it), never its target.
        fd = anchor.open("key", os.O_PATH | os.O_NOFOLLOW)
        try:
            assert stat.S_ISLNK(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
        fd = anchor.open("src/a.c", os.O_RDONLY)
        try:
            assert os.read(fd, 100) == b"int a;\n"
        finally:
            os.close(fd)


def test_open_beneath_never_crosses_a_mount(scene: dict[str, Path], resolver: str) -> None:
    project, runtime = scene["project"], scene["runtime"]
    with _bind(runtime, project / "mounted"), Anchored(str(project)) as anchor:
        with pytest.raises(AccessDenied):
            anchor.open("mounted/approver.key", os.O_RDONLY)
        with pytest.raises(AccessDenied):
            anchor.lstat("mounted")
        live = LiveDirectory(anchor)
        assert dict(live.list("/"))["mounted"].name == "DIR"  # listed, never entered
        with pytest.raises(AccessDenied):
            live.stat("/mounted")
        with pytest.raises(AccessDenied):
            live.list("/mounted")


_NAMES = st.sampled_from(["a", "b", "in", "out", "abs", "up", "..", ".", "f", "mnt"])


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=st.lists(_NAMES, min_size=1, max_size=5), o_path=st.booleans())
def test_openat2_and_the_walk_agree_and_never_escape(
    scene: dict[str, Path], path: list[str], o_path: bool
) -> None:
    project = scene["project"]
    if not (project / "a").exists():
        (project / "a" / "b").mkdir(parents=True)
        (project / "a" / "f").write_bytes(b"f")
        (project / "in").symlink_to("a")
        (project / "a" / "out").symlink_to("../..")
        (project / "abs").symlink_to(scene["runtime"])
        (project / "a" / "up").symlink_to("..")
    relative = "/".join(path)
    flags = os.O_PATH | os.O_NOFOLLOW if o_path else os.O_RDONLY
    outcomes: list[tuple[str, object]] = []
    with Anchored(str(project)) as anchor:
        for available in (True, False):
            beneath._Openat2.available = available
            try:
                fd = open_beneath(anchor.fd, relative, flags)
            except (SlatesError, OSError) as exc:
                code = exc.errno if isinstance(exc, OSError) else type(exc).__name__
                outcomes.append(("refused", code))
                continue
            finally:
                beneath._Openat2.available = True
            try:
                where = os.readlink(f"/proc/self/fd/{fd}")
                assert where == str(project) or where.startswith(str(project) + "/"), where
                st_ = os.fstat(fd)
                outcomes.append(("opened", (st_.st_dev, st_.st_ino)))
            finally:
                os.close(fd)
    assert outcomes[0] == outcomes[1], (relative, outcomes)


# -- protected directories, by identity ---------------------------------------------


def test_the_runtime_directory_is_refused_under_any_name(
    scene: dict[str, Path], resolver: str
) -> None:
    runtime, root = scene["runtime"], scene["root"]
    protected = [str(runtime)]
    (root / "to-run").symlink_to(runtime)
    (root / "to-root").symlink_to(".")
    with _bind(runtime, root / "bound"):
        for name in (
            runtime,  # is it
            runtime / "src",  # lies inside it
            root,  # holds it
            root / "to-run",  # a symlink to it
            root / "to-root" / "fake-run" / "src",  # through a symlink, inside it
            root / "bound",  # a bind mount of it: another path, the same (dev, ino)
            root / "bound" / "src",
        ):
            with pytest.raises(AccessDenied):
                Anchored(str(name), protected=protected)
            with pytest.raises(AccessDenied):
                LiveDirectory(str(name), protected=protected)
            with pytest.raises(AccessDenied):
                Target(str(name), protected=protected)
    with Anchored(str(scene["project"]), protected=protected) as anchor:
        assert anchor.identity == (
            os.stat(scene["project"]).st_dev,
            os.stat(scene["project"]).st_ino,
        )
    with Anchored(str(scene["alias"])) as anchor:  # allowed roots, by identity as well
        assert anchor.lies_within([str(root)]) and anchor.lies_within([str(root / "to-root")])
        assert anchor.lies_within([str(scene["project"])])
        assert not anchor.lies_within([str(runtime), str(scene["elsewhere"]), str(root / "no")])
    with pytest.raises(NotFound):
        Anchored(str(root / "missing"), protected=protected)
    with pytest.raises(InvalidArgument):
        Anchored(str(runtime / "approver.key"))
    with pytest.raises(InvalidArgument):
        Anchored("relative/path")


# -- the symlink swap -----------------------------------------------------------------


def test_a_base_swapped_after_it_was_opened_keeps_reading_the_opened_directory(
    scene: dict[str, Path],
) -> None:
    alias, runtime = scene["alias"], scene["runtime"]
    live = LiveDirectory(str(alias), protected=[str(runtime)])
    try:
        entry = live.stat("/src/a.c")
        assert entry is not None
        _swap(alias, runtime)
        assert sorted(name for name, _ in live.list("/")) == ["src"]  # not approver.key
        assert live.stat("/approver.key") is None
        assert live.read("/src/a.c", entry.fingerprint, 0, 100) == b"int a;\n"
        with pytest.raises(AccessDenied):  # the swapped name, opened again, is refused
            LiveDirectory(str(alias), protected=[str(runtime)])
    finally:
        live.close()


def test_a_capture_reads_only_the_directory_it_opened(scene: dict[str, Path]) -> None:
    alias, runtime = scene["alias"], scene["runtime"]
    anchor = Anchored(str(alias), protected=[str(runtime)], what="base")
    _swap(alias, runtime)  # between the check and the capture's reads
    volume = Volume.new(Host(capacity=1 << 24))
    try:
        capture_into(anchor, volume, snapshot_id="snap-1")
        names = sorted(item.name for item in volume.readdir(ROOT_INO))
        assert names == ["src"], names
        ino = volume.resolve("/src/a.c")
        assert volume.read(ino, 0, 100) == b"int a;\n"
    finally:
        volume.close()
        anchor.close()


def test_a_landing_target_swapped_after_the_plan_is_never_written(
    scene: dict[str, Path],
) -> None:
    alias, project, elsewhere, runtime = (
        scene["alias"],
        scene["project"],
        scene["elsewhere"],
        scene["runtime"],
    )
    protected = [str(runtime)]
    entry = Entry("src/a.c", _file(b"int a;\n"), _file(b"int b;\n"))
    with Target(str(alias), lease=False, protected=protected) as planned:
        identity = planned.identity
    _swap(alias, elsewhere)  # the human saw `alias` -> project
    with pytest.raises(AccessDenied):
        Target(str(alias), protected=protected, identity=identity)
    _swap(alias, runtime)
    with pytest.raises(AccessDenied):  # even without the plan's identity
        Target(str(alias), protected=protected)
    # A target opened before the swap keeps writing where it was opened.
    _swap(alias, project)
    with Target(str(alias), protected=protected, identity=identity) as target:
        _swap(alias, elsewhere)
        assert target.apply(entry, b"int b;\n")[0] is Decision.APPLY
        assert target.read("src/a.c") == b"int b;\n"
    assert (project / "src" / "a.c").read_bytes() == b"int b;\n"
    assert (elsewhere / "src" / "a.c").read_bytes() == b"int a;\n"
    assert (runtime / "src" / "a.c").read_bytes() == SECRET


# -- FUSE: a base or target in a Slates mount -------------------------------------------


def test_a_base_or_target_in_a_slates_mount_is_refused_and_the_shard_answers(
    service: Service, scene: dict[str, Path]
) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("work")
        with mounted(client, volume["id"], scene["root"] / "mnt") as mnt:
            (mnt / "sub").mkdir()
            (mnt / "sub" / "f").write_bytes(b"x")
            (mnt / "link").symlink_to(scene["project"])
            for where in (mnt, mnt / "sub"):  # the SDK resolves a symlink itself
                with pytest.raises(AccessDenied, match="FUSE"):
                    client.create_volume("inside", base=where)
                with pytest.raises(AccessDenied, match="FUSE"):
                    client.create_green("inside", base=where)
            for where in (mnt, mnt / "sub", mnt / "link"):  # in it, or named through it
                with pytest.raises(AccessDenied, match="FUSE"):
                    LiveDirectory(str(where))
                with pytest.raises(AccessDenied, match="FUSE"):
                    Target(str(where))
            assert client.status()["shards"]  # the shard still answers
            assert (mnt / "sub" / "f").read_bytes() == b"x"  # and so does the mount
            # A mount inside a base or a target (tmp_path holds mnt) is never entered.
            live = LiveDirectory(str(scene["root"]))
            try:
                assert dict(live.list("/"))["mnt"].name == "DIR"
                with pytest.raises(AccessDenied):
                    live.stat("/mnt")
            finally:
                live.close()
            with Target(str(scene["root"])) as target, pytest.raises(AccessDenied):
                target.apply(Entry("mnt/new", None, _file(b"n")), b"n")
            assert not (mnt / "new").exists()


# -- landing details --------------------------------------------------------------------

_NON_UTF8 = os.fsdecode(b"caf\xe9-\xff.txt")  # Latin-1 bytes: surrogateescape in Python


def test_names_that_are_not_utf8_land(tmp_path: Path) -> None:
    root = tmp_path / "t"
    root.mkdir()
    link_target = os.fsdecode(b"target-\xfe")
    entries = [
        (Entry(_NON_UTF8, None, _file(b"data\n")), b"data\n"),
        (Entry(os.fsdecode(b"dir-\xe9"), None, State("dir", None, 0o755)), None),
        (
            Entry(
                os.fsdecode(b"link-\xe9"),
                None,
                state_of_bytes("symlink", os.fsencode(link_target), 0o777),
            ),
            os.fsencode(link_target),
        ),
    ]
    with Target(str(root)) as target:
        for entry, content in entries:
            assert target.land_entry(entry, content).decision is Decision.APPLY
            assert target.state(entry.path) == entry.proposed
        assert target.read(_NON_UTF8) == b"data\n"
        changed = Entry(_NON_UTF8, _file(b"data\n"), _file(b"new\n"))
        assert target.land_entry(changed, b"new\n").decision is Decision.APPLY
        target.finish()
    assert (root / os.fsdecode(b"caf\xe9-\xff.txt")).read_bytes() == b"new\n"
    assert os.readlink(root / os.fsdecode(b"link-\xe9")) == link_target
    assert os.path.isdir(os.path.join(os.fsencode(root), b"dir-\xe9"))
    assert _temp_names(root) == []


@pytest.mark.parametrize(
    ("witnessed_mode", "proposed_mode"),
    [(0o644, 0o4755), (0o4755, 0o755), (0o644, 0o2750), (0o2755, 0o755), (0o755, 0o1755)],
)
def test_special_bits_land_only_as_the_proposed_mode_carries_them(
    tmp_path: Path, witnessed_mode: int, proposed_mode: int
) -> None:
    root = tmp_path / "t"
    root.mkdir()
    for name, new_content in (("content", b"new\n"), ("mode-only", b"old\n")):
        path = root / name
        path.write_bytes(b"old\n")
        os.chmod(path, witnessed_mode)
        entry = Entry(name, _file(b"old\n", witnessed_mode), _file(new_content, proposed_mode))
        with Target(str(root)) as target:
            assert target.land_entry(entry, new_content).decision is Decision.APPLY
        assert stat.S_IMODE(os.lstat(path).st_mode) == proposed_mode
    assert special_bits(_file(b"", proposed_mode)) == [
        name
        for bit, name in ((0o4000, "setuid"), (0o2000, "setgid"), (0o1000, "sticky"))
        if proposed_mode & bit
    ]
    assert landed_mode(_file(b"", proposed_mode)) == proposed_mode
    assert _temp_names(root) == []


def test_a_new_directory_in_a_setgid_directory_gets_exactly_its_proposed_mode(
    tmp_path: Path,
) -> None:
    root = tmp_path / "t"
    root.mkdir()
    os.chmod(root, 0o2775)  # the kernel would give new directories setgid
    with Target(str(root)) as target:
        entry = Entry("d", None, State("dir", None, 0o755))
        assert target.land_entry(entry, None).decision is Decision.APPLY
        target.finish()
    assert stat.S_IMODE(os.lstat(root / "d").st_mode) == 0o755


def test_a_file_is_0600_until_its_bytes_are_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "t"
    root.mkdir()
    seen: list[int] = []
    real_write = os.write

    class _Watching:
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        @staticmethod
        def write(fd: int, data: Any) -> int:
            seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
            return real_write(fd, data)

    monkeypatch.setattr(disk, "os", _Watching())
    with Target(str(root)) as target:
        entry = Entry("tool", None, _file(b"#!/bin/sh\n", 0o4755))
        assert target.land_entry(entry, b"#!/bin/sh\n").decision is Decision.APPLY
    assert seen and set(seen) == {0o600}
    assert stat.S_IMODE(os.lstat(root / "tool").st_mode) == 0o4755


# The system calls each kind of entry makes while it is built or swapped in.
_USES = {
    "new file": ("write", "fsync", "fchmod", "rename"),
    "changed file": ("write", "fsync", "fchmod", "rename"),
    "new dir": ("chmod", "rename"),
    "symlink": ("symlink", "rename"),
}


@pytest.mark.parametrize(
    ("kind", "failing"), [(kind, call) for kind, calls in _USES.items() for call in calls]
)
def test_a_failed_entry_leaves_no_temporary_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, failing: str
) -> None:
    root = tmp_path / "t"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "x").write_bytes(b"old\n")
    entry, content = {
        "new file": (Entry("sub/n", None, _file(b"new\n", 0o4755)), b"new\n"),
        "changed file": (Entry("sub/x", _file(b"old\n"), _file(b"new\n")), b"new\n"),
        "new dir": (Entry("sub/d", None, State("dir", None, 0o755)), None),
        "symlink": (Entry("sub/l", None, state_of_bytes("symlink", b"x", 0o777)), b"x"),
    }[kind]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EIO, "injected failure")

    class _Failing:
        def __getattr__(self, name: str) -> Any:
            return broken if name == failing else getattr(os, name)

    with Target(str(root), lease=False) as target:
        monkeypatch.setattr(disk, "os", _Failing())
        if failing == "rename":
            monkeypatch.setattr(disk, "_renameat2", broken)
        with pytest.raises(OSError) as caught:
            target.land_entry(entry, content)
        monkeypatch.undo()
        assert caught.value.errno == errno.EIO
        assert _temp_names(root) == []
        assert target.state(entry.path) == entry.witnessed  # the entry is as it was
        assert target.land_entry(entry, content).decision is Decision.APPLY  # and lands next
        assert target.state(entry.path) == entry.proposed


def test_the_manifest_digest_of_a_non_utf8_path_is_stable() -> None:
    from slates.land.manifest import Manifest, manifest_from_wire

    manifest = Manifest("snap-1", "/t", (Entry(_NON_UTF8, None, _file(b"x")),))
    again = manifest_from_wire(manifest.to_wire())
    assert again == manifest and again.manifest_id == manifest.manifest_id
    assert blake3.blake3(manifest.encode()).hexdigest() == manifest.manifest_id


# -- through the service: the attacks of the review, end to end ---------------------------


def _replace_by_symlink(directory: Path, to: Path) -> Path:
    """Move `directory` aside and put a symlink to `to` at its name; returns where it went."""
    aside = directory.with_name(directory.name + ".moved")
    os.rename(directory, aside)
    directory.symlink_to(to)
    return aside


def _grant(client: Client, runtime: Path, manifest: str) -> str:
    grant = client.call(
        shard_of(manifest),
        "land.grant",
        manifest=manifest,
        credential=Runtime(str(runtime)).approver_key_file.read_bytes().strip(),
        nonce=secrets.token_hex(16),
    )
    return str(grant["grant"])


def test_a_base_swapped_after_the_volume_was_made_is_never_followed(
    service: Service, scene: dict[str, Path]
) -> None:
    project = scene["project"]
    with Client(service.runtime) as client:
        live = str(client.create_volume("live", base=project)["id"])
        _replace_by_symlink(project, service.runtime)
        names = sorted(entry["name"] for entry in client.list(live, "/"))
        assert names == ["src"], names  # the directory opened, not the runtime directory
        assert client.read(live, "/src/a.c") == b"int a;\n"
        for base in (project, service.runtime):  # named again: refused
            with pytest.raises(AccessDenied):
                client.create_volume("spy", base=base)
        assert client.status()["shards"]


def test_a_landing_target_swapped_after_the_plan_is_never_read_nor_written(
    service: Service, scene: dict[str, Path]
) -> None:
    project, elsewhere, runtime = scene["project"], scene["elsewhere"], service.runtime
    key = Runtime(str(runtime)).approver_key_file.read_bytes()
    with Client(runtime) as client:
        green = client.create_green("main", base=project)
        work = str(client.create_work(green, "w")["id"])
        client.write(work, "/approver.key", b"mine")
        client.write(work, "/src/a.c", b"int b;\n", truncate=True)
        plan = client.land_plan(work, project)
        manifest = plan["manifest"]
        grant = _grant(client, runtime, manifest)
        aside = _replace_by_symlink(project, runtime)
        with pytest.raises(AccessDenied):  # read_base of the plan: never the credential
            client.read_base(manifest, "approver.key")
        with pytest.raises(AccessDenied):  # with the key, a grant lands nothing there
            client.land_apply(manifest, grant)
        assert client.status()["shards"]  # the shard still answers
        assert Runtime(str(runtime)).approver_key_file.read_bytes() == key
        project.unlink()
        project.symlink_to(elsewhere)  # an ordinary directory nobody approved
        with pytest.raises(AccessDenied):
            client.read_base(manifest, "src/a.c")
        with pytest.raises(AccessDenied):
            client.land_apply(manifest, grant)
        assert (elsewhere / "src" / "a.c").read_bytes() == b"int a;\n"
        assert not (elsewhere / "approver.key").exists()
        project.unlink()
        os.rename(aside, project)  # the directory the plan opened, back at its name
        assert client.read_base(manifest, "src/a.c") == b"int a;\n"
        result = client.land_apply(manifest, grant)
        assert result["complete"], result
    assert (project / "src" / "a.c").read_bytes() == b"int b;\n"
    assert (project / "approver.key").read_bytes() == b"mine"
    assert Runtime(str(runtime)).approver_key_file.read_bytes() == key


def test_a_name_that_is_not_utf8_lands_through_the_service(
    service: Service, scene: dict[str, Path]
) -> None:
    project = scene["project"]
    name = os.fsencode(project) + b"/src/caf\xe9.c"
    with open(name, "wb") as f:
        f.write(b"old\n")
    path = "/src/" + os.fsdecode(b"caf\xe9.c")
    with Client(service.runtime) as client:
        green = client.create_green("main", base=project)
        work = str(client.create_work(green, "w")["id"])
        client.write(work, path, b"new\n", truncate=True)
        client.write(work, "/src/" + os.fsdecode(b"n\xff.c"), b"made\n")
        plan = client.land_plan(work, project)
        assert sorted(e["path"] for e in plan["entries"]) == sorted(
            [path.lstrip("/"), "src/" + os.fsdecode(b"n\xff.c")]
        )
        result = client.land_apply(
            plan["manifest"], _grant(client, service.runtime, plan["manifest"])
        )
        assert result["complete"], result
    with open(name, "rb") as f:
        assert f.read() == b"new\n"
    with open(os.fsencode(project) + b"/src/n\xff.c", "rb") as f:
        assert f.read() == b"made\n"
    assert _temp_names(project) == []


def test_the_target_identity_is_part_of_the_manifest_and_its_id() -> None:
    from slates.land.manifest import Manifest, manifest_from_wire

    entries = (Entry("a", None, _file(b"x")),)
    plain = Manifest("snap-1", "/t", entries)
    pinned = Manifest("snap-1", "/t", entries, (64769, 1234))
    other = Manifest("snap-1", "/t", entries, (64769, 1235))
    assert len({plain.manifest_id, pinned.manifest_id, other.manifest_id}) == 3
    for manifest in (plain, pinned):
        assert manifest_from_wire(manifest.to_wire()) == manifest
    assert pinned.select(["a"]).target_identity == (64769, 1234)
    assert pinned.rewitnessed({"a": _file(b"y")}).target_identity == (64769, 1234)
    for bad in ([2, "snap-1", "/t", [], [1]], [2, "snap-1", "/t", [], [-1, 2]]):
        with pytest.raises(InvalidArgument):
            manifest_from_wire(bad)


def test_a_base_swapped_after_its_volume_was_made_is_refused_at_replay(tmp_path: Path) -> None:
    """The base is opened once when the volume is made and read through that open
    directory; its (dev, ino) is journaled, so a restart that reopens the path refuses a
    directory put there since instead of serving it."""
    from slates.node.protocol import Request
    from slates.node.service import ShardService
    from tests.jobs_inline import finish

    base = tmp_path / "project"
    base.mkdir()
    (base / "f").write_bytes(b"the project")
    service = ShardService(0, Host(), LiveDirectory)
    reply, events = finish(
        service,
        *service.handle("c", Request(1, 0, "volume.create", {"name": "v", "base": str(base)}), 1),
    )
    vid = reply["result"]["id"]
    base.rename(tmp_path / "moved")
    swapped = tmp_path / "project"
    swapped.mkdir()
    (swapped / "f").write_bytes(b"a secret")
    # The running volume still reads the directory it was made over.
    assert service._run("read", {"volume": vid, "path": "/f"}, 2) == b"the project"
    restarted = ShardService(0, Host(chunks=dict(service.host._chunks)), LiveDirectory)
    restarted.replay(events)
    assert isinstance(restarted.failed[vid], AccessDenied)
    with pytest.raises(SlatesError):
        restarted._run("read", {"volume": vid, "path": "/f"}, 3)
