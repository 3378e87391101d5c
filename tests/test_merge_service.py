"""Green and work volumes in the shard service: submit, rebase, conflicts, replay.

Drives slates.node.service.ShardService in-process (no daemon).  The first
sections follow the product description ("Recording File Operations",
"Adjusting Edit Positions", "Accepting or Rejecting a Merge", "Resolving
Overlapping Agent Edits") and DESIGN.md section 5; then the namespace
conflict kinds of slates.merge.changes, a cross-check of merged heads with
`git merge-file`, and replay/checkpoint of the ledger.

`Service` and the tree readers are shared with tests/test_merge_properties.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from slates.base.live import LiveDirectory
from slates.core.host import Host
from slates.core.records import DirItem, Kind
from slates.core.volume import ROOT_INO, Volume
from slates.merge.changes import Edit
from slates.merge.ranges import Replace
from slates.merge.ranges import apply as apply_edits
from slates.node.protocol import Request
from slates.node.service import Event, ShardService
from tests.jobs_inline import finish
from tests.test_merge_ranges import draw_line_edits, git_merge

CONF = b"quality=80\ncache=off\n"
QUALITY = (8, 10)  # the 80
CACHE = (17, 20)  # the off

Tree = dict[str, bytes | str]  # path -> file bytes, "dir", or "link:<target>"
Files = dict[int, tuple[str, bytes]]  # ino -> (path, bytes) of the regular files


# -- helpers ---------------------------------------------------------------------


def _walk(volume: Volume) -> Iterator[tuple[str, DirItem]]:
    """Every visible entry of a volume with its path, through the Volume API."""
    stack = [("", ROOT_INO)]
    while stack:
        prefix, ino = stack.pop()
        for item in volume.readdir(ino):
            path = f"{prefix}/{item.name}"
            if item.kind == Kind.DIR:
                stack.append((path, item.ino))
            yield path, item


def _content(volume: Volume, ino: int) -> bytes:
    return volume.read(ino, 0, volume.getattr(ino).size)


def volume_tree(volume: Volume) -> Tree:
    """Everything in a volume, read through the Volume API (no requests, no events)."""
    out: Tree = {}
    for path, item in _walk(volume):
        if item.kind == Kind.DIR:
            out[path] = "dir"
        elif item.kind == Kind.FILE:
            out[path] = _content(volume, item.ino)
        elif item.kind == Kind.SYMLINK:
            out[path] = "link:" + volume.readlink(item.ino)
        else:
            out[path] = item.kind.name
    return out


def volume_files(volume: Volume) -> Files:
    """The regular files of a volume by inode number."""
    return {
        item.ino: (path, _content(volume, item.ino))
        for path, item in _walk(volume)
        if item.kind == Kind.FILE
    }


class Service:
    """One ShardService driven in-process; every committed event is kept for replay."""

    def __init__(self) -> None:
        self.svc = ShardService(0, Host(), LiveDirectory)
        self.events: list[Event] = []
        self.seq = 0
        self.now = 1_000_000_000
        self.names = 0

    def raw(self, op: str, **args: Any) -> dict[str, Any]:
        self.seq += 1
        self.now += 1_000
        reply, events = finish(
            self.svc,
            *self.svc.handle("agent", Request(self.seq, self.seq - 1, op, args), self.now),
        )
        self.events += events
        return reply

    def call(self, op: str, **args: Any) -> Any:
        reply = self.raw(op, **args)
        if not reply["ok"]:
            raise AssertionError(f"{op} {args!r} failed: {reply['error']!r}")
        return reply["result"]

    def green(
        self, files: dict[str, bytes] | None = None, dirs: Iterable[str] = (), **policy: Any
    ) -> str:
        """A green volume; with files or dirs, version 1 holds them (submitted by a setup work)."""
        green = str(self.call("green.create", name="green", **policy)["id"])
        dirs = list(dirs)
        if files or dirs:
            setup = self.work(green)
            for path in dirs:
                self.call("mkdir", volume=setup, path=path)
            for path, data in (files or {}).items():
                self.call("write", volume=setup, path=path, data=data)
            result = self.submit(setup)
            assert verdict(result) == (True, 1, []), result
        return green

    def work(self, green: str, version: int | None = None) -> str:
        self.names += 1
        args: dict[str, Any] = {"green": green, "name": f"work{self.names}"}
        if version is not None:
            args["version"] = version
        info = self.call("work.create", **args)
        assert info["role"] == "work" and info["green"] == green
        return str(info["id"])

    def submit(self, work: str) -> dict[str, Any]:
        result: dict[str, Any] = self.call("submit", volume=work)
        return result

    def rebase(self, work: str) -> dict[str, Any]:
        result: dict[str, Any] = self.call("rebase", volume=work)
        return result

    def edit(self, volume: str, path: str, start: int, end: int, data: bytes) -> None:
        self.call("edit", volume=volume, path=path, start=start, end=end, data=data)

    def read(self, volume: str, path: str) -> bytes:
        data: bytes = self.call("read", volume=volume, path=path)
        return data

    def tree(self, volume: str) -> Tree:
        return volume_tree(self.svc.volumes[volume])

    def files(self, volume: str) -> Files:
        return volume_files(self.svc.volumes[volume])

    def head(self, green: str) -> int:
        return int(self.call("versions", green=green, limit=0)["head"])

    def green_of(self, work: str) -> str:
        return str(self.call("volume.show", volume=work)["green"])

    def base_of(self, work: str) -> int:
        return int(self.call("volume.show", volume=work)["version"])

    def replayed(self) -> ShardService:
        """A fresh service that replayed every committed event."""
        other = ShardService(0, Host(chunks=dict(self.svc.host._chunks)), LiveDirectory)
        other.replay(self.events)
        return other

    def restored(self) -> ShardService:
        """A fresh service restored from a checkpoint of this one."""
        blob = self.svc.checkpoint()
        other = ShardService(0, Host(chunks=dict(self.svc.host._chunks)), LiveDirectory)
        other.restore(blob)
        return other


def snapshot_tree(service: ShardService, snapshot_id: str) -> Tree:
    reader = Volume.clone(service.snapshots[snapshot_id], service.host)
    try:
        return volume_tree(reader)
    finally:
        reader.close()


def assert_green_reads_its_head(service: ShardService, green: str) -> None:
    """The green volume holds exactly its ledger's head version."""
    head = service.greens[green][-1]
    assert volume_tree(service.volumes[green]) == snapshot_tree(service, head.snapshot_id)


def verdict(result: dict[str, Any]) -> tuple[bool, int | None, list[dict[str, Any]]]:
    """The part of a submit or rebase result every caller relies on."""
    return result["ok"], result["version"], result["conflicts"]


def assert_same_state(expected: ShardService, actual: ShardService) -> None:
    """Same ledgers, same work volumes, and every green head and work volume reads the same."""
    assert actual.greens == expected.greens
    assert actual.works == expected.works
    assert actual.snapshots.keys() == expected.snapshots.keys()
    for vid in [*expected.greens, *expected.works]:
        assert volume_tree(actual.volumes[vid]) == volume_tree(expected.volumes[vid]), vid
    for green, ledger in expected.greens.items():
        for version in ledger:  # every version, read through a throwaway clone
            assert snapshot_tree(actual, version.snapshot_id) == snapshot_tree(
                expected, version.snapshot_id
            ), (green, version.number)
        assert_green_reads_its_head(actual, green)


def two_agents(
    service: Service,
    green: str,
    first: Callable[[str], object],
    second: Callable[[str], object],
) -> tuple[str, str]:
    """Two work volumes on the head; `first` and `second` make their changes."""
    one, two = service.work(green), service.work(green)
    first(one)
    second(two)
    return one, two


def agents_editing_conf(
    first: tuple[int, int, bytes], second: tuple[int, int, bytes]
) -> tuple[Service, str, str, str]:
    """A green volume holding CONF and two agents, each making one edit of it."""
    service = Service()
    green = service.green({"/image.conf": CONF})
    one, two = two_agents(
        service,
        green,
        lambda w: service.edit(w, "/image.conf", *first),
        lambda w: service.edit(w, "/image.conf", *second),
    )
    return service, green, one, two


def assert_rejected(
    service: Service, green: str, work: str, kinds: Iterable[str] | None = None
) -> list[dict[str, Any]]:
    """Submit `work` expecting a conflict: the head and the work volume stay as they were."""
    version, head_tree, work_tree = service.head(green), service.tree(green), service.tree(work)
    base = service.base_of(work)
    result = service.submit(work)
    assert result["ok"] is False and result["version"] is None, result
    assert result["conflicts"], result
    if kinds is not None:
        assert [c["kind"] for c in result["conflicts"]] == list(kinds), result
    assert service.head(green) == version
    assert service.tree(green) == head_tree
    assert service.tree(work) == work_tree
    assert service.base_of(work) == base
    conflicts: list[dict[str, Any]] = result["conflicts"]
    return conflicts


def assert_accepted(service: Service, work: str) -> int:
    """Submit `work` expecting acceptance; returns the head version it reports."""
    result = service.submit(work)
    assert result["ok"] is True and result["conflicts"] == [], result
    version = int(result["version"])
    assert version == service.head(service.green_of(work)), result
    if result.get("rebased"):  # the work moved onto the version it made
        assert service.base_of(work) == version, result
        assert service.tree(work) == service.tree(service.green_of(work)), result
    return version


# -- the product description's examples ------------------------------------------


def test_a_format_line_insert_moves_the_quality_range() -> None:
    service, green, agent1, agent2 = agents_editing_conf(
        (0, 0, b"format=webp\n"), (*QUALITY, b"90")
    )
    assert assert_accepted(service, agent1) == 2
    assert service.read(green, "/image.conf") == b"format=webp\nquality=80\ncache=off\n"
    assert service.read(green, "/image.conf")[20:22] == b"80"  # where [8, 10) now is
    assert assert_accepted(service, agent2) == 3
    assert service.read(green, "/image.conf") == b"format=webp\nquality=90\ncache=off\n"
    ledger = service.call("versions", green=green, limit=10)
    assert ledger["head"] == 3
    assert [(v["version"], v["base"], v["work"]) for v in ledger["versions"][-2:]] == [
        (2, 1, agent1),
        (3, 1, agent2),
    ]
    assert service.call("changed_since", green=green, version=1) == ["/image.conf"]


@pytest.mark.parametrize("order", ["quality first", "cache first"])
def test_quality_and_cache_both_accepted(order: str) -> None:
    service, green, quality, cache = agents_editing_conf((*QUALITY, b"90"), (*CACHE, b"on"))
    works = [quality, cache] if order == "quality first" else [cache, quality]
    assert [assert_accepted(service, w) for w in works] == [2, 3]
    assert service.read(green, "/image.conf") == b"quality=90\ncache=on\n"


def test_90_against_60_is_a_conflict_with_its_three_values() -> None:
    service, green, agent1, agent2 = agents_editing_conf((*QUALITY, b"90"), (*QUALITY, b"60"))
    assert assert_accepted(service, agent1) == 2
    (conflict,) = assert_rejected(service, green, agent2, ["overlap"])
    assert conflict["path"] == "/image.conf"
    assert conflict["base"] == [8, 10]
    assert conflict["base_bytes"] == b"80"
    assert conflict["accepted"] == b"90"
    assert conflict["proposed"] == b"60"
    assert conflict["version"] == 2
    start, end = conflict["head"]
    assert service.read(green, "/image.conf")[start:end] == b"90"
    # The shared file keeps 90; the private work keeps 60.  Neither disappears.
    assert service.read(green, "/image.conf") == b"quality=90\ncache=off\n"
    assert service.read(agent2, "/image.conf") == b"quality=60\ncache=off\n"


def test_both_writing_90_is_accepted_as_identical() -> None:
    service, green, agent1, agent2 = agents_editing_conf((*QUALITY, b"90"), (*QUALITY, b"90"))
    assert assert_accepted(service, agent1) == 2
    assert assert_accepted(service, agent2) == service.head(green)
    assert service.read(green, "/image.conf") == b"quality=90\ncache=off\n"


def test_identical_bytes_match_despite_an_unrelated_edit_elsewhere() -> None:
    service = Service()
    green = service.green({"/image.conf": CONF})

    def both(w: str) -> None:
        service.edit(w, "/image.conf", *CACHE, b"on")
        service.edit(w, "/image.conf", *QUALITY, b"90")

    agent1, agent2 = two_agents(
        service, green, both, lambda w: service.edit(w, "/image.conf", *QUALITY, b"90")
    )
    assert_accepted(service, agent1)
    assert_accepted(service, agent2)
    assert service.read(green, "/image.conf") == b"quality=90\ncache=on\n"


@pytest.mark.parametrize(
    ("first", "kind"), [("delete", "modify vs delete"), ("modify", "delete vs modify")]
)
def test_delete_against_modify_is_a_conflict_in_either_order(first: str, kind: str) -> None:
    service = Service()
    green = service.green({"/image.conf": CONF, "/other": b"x"})
    deleter, modifier = two_agents(
        service,
        green,
        lambda w: service.call("unlink", volume=w, path="/image.conf"),
        lambda w: service.edit(w, "/image.conf", *QUALITY, b"60"),
    )
    winner, loser = (deleter, modifier) if first == "delete" else (modifier, deleter)
    assert_accepted(service, winner)
    (conflict,) = assert_rejected(service, green, loser, [kind])
    assert conflict["path"] == "/image.conf"


def test_resolving_the_60_conflict_with_85() -> None:
    service, green, agent1, agent2 = agents_editing_conf((*QUALITY, b"90"), (*QUALITY, b"60"))
    assert_accepted(service, agent1)
    assert_rejected(service, green, agent2, ["overlap"])
    # Agent 2 reads the accepted version and starts fresh work from that head.
    fresh = service.work(green)
    assert service.base_of(fresh) == 2
    assert service.read(fresh, "/image.conf")[8:10] == b"90"
    service.edit(fresh, "/image.conf", *QUALITY, b"85")
    assert assert_accepted(service, fresh) == 3
    assert service.read(green, "/image.conf") == b"quality=85\ncache=off\n"
    # The rejected 60 is not reapplied: resubmitting the old work still conflicts.
    assert_rejected(service, green, agent2, ["overlap"])
    assert service.read(agent2, "/image.conf") == b"quality=60\ncache=off\n"


def test_an_intervening_edit_of_the_same_bytes_gives_another_conflict() -> None:
    service = Service()
    green = service.green({"/image.conf": b"quality=90\ncache=off\n"})
    agent2, other = two_agents(
        service,
        green,
        lambda w: service.edit(w, "/image.conf", *QUALITY, b"85"),
        lambda w: service.edit(w, "/image.conf", *QUALITY, b"95"),
    )
    assert_accepted(service, other)
    (conflict,) = assert_rejected(service, green, agent2, ["overlap"])
    assert (conflict["base_bytes"], conflict["accepted"], conflict["proposed"]) == (
        b"90",
        b"95",
        b"85",
    )


def test_a_conflict_names_its_range_in_the_submissions_base_after_mapping() -> None:
    """Bug: across several versions, `base`/`base_bytes` come out in a later version's coordinates.

    The work starts from v1 (quality=80); v2 inserts a format line; v3 changes
    the 80 (now at [20, 22)) to 90.  The work's 60 conflicts with v3.  The
    conflict must name the original 80 at [8, 10) of its base (DESIGN.md
    section 5, changes.Conflict: "`base` ... byte ranges in the submission's
    base version").
    """
    service = Service()
    green = service.green({"/image.conf": CONF})
    agent2 = service.work(green)
    service.edit(agent2, "/image.conf", *QUALITY, b"60")
    inserter = service.work(green)
    service.edit(inserter, "/image.conf", 0, 0, b"format=webp\n")
    assert assert_accepted(service, inserter) == 2
    raiser = service.work(green)
    service.edit(raiser, "/image.conf", 20, 22, b"90")
    assert assert_accepted(service, raiser) == 3
    (conflict,) = assert_rejected(service, green, agent2, ["overlap"])
    assert (conflict["accepted"], conflict["proposed"], conflict["version"]) == (b"90", b"60", 3)
    start, end = conflict["head"]
    assert service.read(green, "/image.conf")[start:end] == b"90"
    assert conflict["base"] == [8, 10]
    assert conflict["base_bytes"] == b"80"


# -- recording and composition ---------------------------------------------------


def test_temporary_content_leaves_no_change() -> None:
    service = Service()
    green = service.green({"/image.conf": CONF})

    def temporary(w: str) -> None:
        service.edit(w, "/image.conf", 3, 3, b"TEMPORARY")
        service.edit(w, "/image.conf", 3, 12, b"")
        service.call("write", volume=w, path="/image.conf", data=b"# appended\n", offset=len(CONF))
        service.call("truncate", volume=w, path="/image.conf", size=len(CONF))

    def rewrite_the_first_line_and_append(w: str) -> None:
        service.edit(w, "/image.conf", 0, 10, b"q=60")
        size = len(CONF) - 6  # after the 10-byte "quality=80" became "q=60"
        service.call("write", volume=w, path="/image.conf", data=b"x=1\n", offset=size)

    temp, other = two_agents(service, green, temporary, rewrite_the_first_line_and_append)
    assert service.read(temp, "/image.conf") == CONF
    version, head = service.head(green), service.tree(green)
    result = service.submit(temp)
    assert result["ok"] is True and result["conflicts"] == []
    assert service.head(green) == version  # nothing remained to submit
    assert service.tree(green) == head
    # The temporary insertion point and the temporary append clash with nothing.
    assert_accepted(service, other)
    assert service.read(green, "/image.conf") == b"q=60\ncache=off\nx=1\n"


@pytest.mark.parametrize("first", ["rewrite", "edit"])
def test_a_truncate_and_rewrite_is_a_whole_replacement_when_rewrites_are_exact(first: str) -> None:
    service = Service()
    green = service.green({"/image.conf": CONF}, rewrites="exact")
    rewriter, editor = two_agents(
        service,
        green,
        lambda w: service.call(
            "write", volume=w, path="/image.conf", data=b"quality=80\ncache=on\n", truncate=True
        ),
        lambda w: service.edit(w, "/image.conf", *QUALITY, b"60"),
    )
    winner, loser = (rewriter, editor) if first == "rewrite" else (editor, rewriter)
    assert_accepted(service, winner)
    (conflict,) = assert_rejected(service, green, loser, ["overlap"])
    assert conflict["base"] == [0, len(CONF)]


@pytest.mark.parametrize("first", ["rewrite", "edit"])
def test_a_truncate_and_rewrite_is_refined_into_the_edits_that_remain(first: str) -> None:
    service = Service()
    green = service.green({"/image.conf": CONF})
    rewriter, editor = two_agents(
        service,
        green,
        lambda w: service.call(
            "write", volume=w, path="/image.conf", data=b"quality=80\ncache=on\n", truncate=True
        ),
        lambda w: service.edit(w, "/image.conf", *QUALITY, b"60"),
    )
    for work in (rewriter, editor) if first == "rewrite" else (editor, rewriter):
        assert_accepted(service, work)
    assert service.read(green, "/image.conf") == b"quality=60\ncache=on\n"
    version = service.svc.greens[green][-1 if first == "edit" else -2]
    (edit,) = [c for c in version.originals if isinstance(c, Edit)]
    # Only "off" -> "on" remains of the rewrite: nothing of "quality=80".
    assert edit.rewrite and all(17 <= e.start <= e.end <= 20 for e in edit.edits), edit
    assert apply_edits(CONF, edit.edits) == b"quality=80\ncache=on\n"


def test_a_truncate_op_then_a_write_is_a_whole_replacement_too() -> None:
    service = Service()
    green = service.green({"/image.conf": CONF}, rewrites="exact")

    def rewrite(w: str) -> None:
        service.call("truncate", volume=w, path="/image.conf", size=0)
        service.call("write", volume=w, path="/image.conf", data=b"quality=80\ncache=on\n")

    rewriter, editor = two_agents(
        service, green, rewrite, lambda w: service.edit(w, "/image.conf", 11, 11, b"# mid\n")
    )
    assert_accepted(service, editor)
    assert_rejected(service, green, rewriter, ["overlap"])


def test_a_precise_edit_of_the_same_change_does_not_conflict() -> None:
    service, green, precise, editor = agents_editing_conf((*CACHE, b"on"), (*QUALITY, b"60"))
    assert_accepted(service, editor)
    assert_accepted(service, precise)
    assert service.read(green, "/image.conf") == b"quality=60\ncache=on\n"


WRITES: list[tuple[str, dict[str, Any], bytes]] = [
    ("pwrite inside", {"op": "write", "data": b"AB", "offset": 3}, b"xx012AB56789"),
    ("pwrite extending", {"op": "write", "data": b"WXYZ", "offset": 8}, b"xx01234567WXYZ"),
    ("sparse write", {"op": "write", "data": b"Z", "offset": 14}, b"xx0123456789\0\0\0\0Z"),
    ("append", {"op": "write", "data": b"!", "offset": 10}, b"xx0123456789!"),
    ("truncate shorter", {"op": "truncate", "size": 5}, b"xx01234"),
    ("truncate longer", {"op": "truncate", "size": 12}, b"xx0123456789\0\0"),
    ("edit delete", {"op": "edit", "start": 4, "end": 7, "data": b""}, b"xx0123789"),
    ("edit insert", {"op": "edit", "start": 10, "end": 10, "data": b"++"}, b"xx0123456789++"),
]


@pytest.mark.parametrize(("name", "op", "expected"), WRITES, ids=[w[0] for w in WRITES])
@pytest.mark.parametrize("order", ["write first", "insert first"])
def test_every_content_operation_is_recorded_as_a_range(
    name: str, op: dict[str, Any], expected: bytes, order: str
) -> None:
    service = Service()
    green = service.green({"/f": b"0123456789"})
    args = {k: v for k, v in op.items() if k != "op"}
    writer, inserter = two_agents(
        service,
        green,
        lambda w: service.call(op["op"], volume=w, path="/f", **args),
        lambda w: service.edit(w, "/f", 0, 0, b"xx"),
    )
    for w in [writer, inserter] if order == "write first" else [inserter, writer]:
        assert_accepted(service, w)
    assert service.read(green, "/f") == expected


def test_two_different_appends_conflict_and_identical_appends_do_not() -> None:
    service = Service()
    green = service.green({"/log": b"one\n"})
    a, b = two_agents(
        service,
        green,
        lambda w: service.call("write", volume=w, path="/log", data=b"two\n", offset=4),
        lambda w: service.call("write", volume=w, path="/log", data=b"three\n", offset=4),
    )
    assert_accepted(service, a)
    assert_rejected(service, green, b, ["overlap"])
    c = service.work(green, version=1)
    service.call("write", volume=c, path="/log", data=b"two\n", offset=4)
    assert_accepted(service, c)
    assert service.read(green, "/log") == b"one\ntwo\n"


def test_inserting_where_the_other_deleted_is_insertion_point_deleted() -> None:
    service, green, deleter, inserter = agents_editing_conf((0, 11, b""), (9, 9, b"5"))
    assert_accepted(service, deleter)
    assert_rejected(service, green, inserter, ["insertion point deleted"])


def test_a_new_file_edited_many_times_is_submitted_whole() -> None:
    service = Service()
    green = service.green({"/keep": b"k"})
    work = service.work(green)
    service.call("write", volume=work, path="/new", data=b"hello world")
    service.edit(work, "/new", 5, 6, b", ")
    service.call("truncate", volume=work, path="/new", size=8)
    assert_accepted(service, work)
    assert service.tree(green) == {"/keep": b"k", "/new": b"hello, w"}


# -- namespace operations --------------------------------------------------------

BASE_TREE = {"/d/f": b"inside\n", "/x": b"x\n", "/y": b"y\n"}
BASE_DIRS = ["/d", "/e"]


def namespace_case(
    first: Callable[[Service, str], object],
    second: Callable[[Service, str], object],
    order: str,
) -> tuple[Service, str, str, str]:
    """Agents make `first` and `second`; returns (service, green, winner, loser) by `order`."""
    service = Service()
    green = service.green(BASE_TREE, BASE_DIRS)
    one, two = service.work(green), service.work(green)
    first(service, one)
    second(service, two)
    if order == "ab":
        return service, green, one, two
    return service, green, two, one


def rename(src: str, dst: str) -> Callable[[Service, str], object]:
    return lambda s, w: s.call("rename", volume=w, src=src, dst=dst)


def unlink(path: str) -> Callable[[Service, str], object]:
    return lambda s, w: s.call("unlink", volume=w, path=path)


def write(path: str, data: bytes) -> Callable[[Service, str], object]:
    return lambda s, w: s.call("write", volume=w, path=path, data=data)


def edit(path: str, start: int, end: int, data: bytes) -> Callable[[Service, str], object]:
    return lambda s, w: s.edit(w, path, start, end, data)


def steps(*actions: Callable[[Service, str], object]) -> Callable[[Service, str], object]:
    def run(s: Service, w: str) -> None:
        for action in actions:
            action(s, w)

    return run


CONFLICTS: list[tuple[str, Callable[[Service, str], object], Callable[[Service, str], object], str]]
CONFLICTS = [
    ("rename vs rename", rename("/x", "/x1"), rename("/x", "/x2"), "rename vs rename"),
    ("rename into another dir", rename("/x", "/d/x"), rename("/x", "/e/x"), "rename vs rename"),
    ("rename vs delete", rename("/x", "/x1"), unlink("/x"), "rename vs delete"),
    ("add vs add", write("/n", b"one"), write("/n", b"two"), "add vs add"),
    ("file vs dir added", write("/n", b"one"), lambda s, w: s.call("mkdir", volume=w, path="/n"),
     "add vs add"),
    ("file vs symlink added", write("/n", b"t"),
     lambda s, w: s.call("symlink", volume=w, path="/n", target="t"), "add vs add"),
    ("rename onto an added name", write("/n", b"one"), rename("/x", "/n"), "add vs add"),
    ("dir removed while adding inside", lambda s, w: s.call("rmdir", volume=w, path="/e"),
     write("/e/n", b"new"), "directory removed while adding inside"),
    ("dir removed while moving inside", lambda s, w: s.call("rmdir", volume=w, path="/e"),
     rename("/x", "/e/x"), "directory removed while adding inside"),
    ("modify vs delete", unlink("/d/f"), edit("/d/f", 0, 1, b"I"), "modify vs delete"),
    ("type replaced", steps(unlink("/x"), lambda s, w: s.call("mkdir", volume=w, path="/x")),
     edit("/x", 0, 1, b"X"), "type replaced"),
    ("object replaced", rename("/d/f", "/x"), edit("/x", 0, 1, b"X"), "object replaced"),
]  # fmt: skip

# In the reverse order the proposal is the removal: kinds as seen from that side.
REVERSE_KINDS = {
    "rename vs rename": {"rename vs rename"},
    "rename vs delete": {"rename vs delete"},
    "add vs add": {"add vs add", "rename vs rename"},
    "directory removed while adding inside": {"directory removed while adding inside"},
    "modify vs delete": {"delete vs modify"},
    "type replaced": {"type replaced", "delete vs modify"},
    "object replaced": {"object replaced", "delete vs modify"},
}


@pytest.mark.parametrize(
    ("name", "first", "second", "kind"), CONFLICTS, ids=[c[0] for c in CONFLICTS]
)
@pytest.mark.parametrize("order", ["ab", "ba"])
def test_namespace_conflicts(
    name: str,
    first: Callable[[Service, str], object],
    second: Callable[[Service, str], object],
    kind: str,
    order: str,
) -> None:
    service, green, winner, loser = namespace_case(first, second, order)
    assert_accepted(service, winner)
    conflicts = assert_rejected(service, green, loser)
    kinds = {c["kind"] for c in conflicts}
    assert kinds <= ({kind} if order == "ab" else REVERSE_KINDS[kind]), conflicts


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_a_file_removed_and_written_again_at_its_name_is_new_content(order: str) -> None:
    """How `sed -i` and editors save: a new file at the old name.  It is the old object
    with new content, so it merges with another agent's edit elsewhere in the file."""
    service, green, winner, loser = namespace_case(
        steps(unlink("/x"), write("/x", b"x\nadded\n")), edit("/x", 0, 0, b"top\n"), order
    )
    ino = service.svc.volumes[green].resolve("/x")
    assert_accepted(service, winner)
    assert_accepted(service, loser)
    assert service.read(green, "/x") == b"top\nx\nadded\n"
    assert service.svc.volumes[green].resolve("/x") == ino  # the same object


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_add_vs_add_reports_both_contents(order: str) -> None:
    service, green, winner, loser = namespace_case(write("/n", b"one"), write("/n", b"two"), order)
    assert_accepted(service, winner)
    (conflict,) = assert_rejected(service, green, loser, ["add vs add"])
    assert conflict["path"] == "/n"
    assert {conflict["accepted"], conflict["proposed"]} == {b"one", b"two"}
    assert conflict["proposed"] == service.read(loser, "/n")


NON_CONFLICTS: list[tuple[str, Callable[[Service, str], object], Callable[[Service, str], object]]]
NON_CONFLICTS = [
    ("same rename", rename("/x", "/x1"), rename("/x", "/x1")),
    ("same add", write("/n", b"same"), write("/n", b"same")),
    ("same unlink", unlink("/x"), unlink("/x")),
    ("same mkdir", lambda s, w: s.call("mkdir", volume=w, path="/n"),
     lambda s, w: s.call("mkdir", volume=w, path="/n")),
    ("same mkdir, different files inside",
     steps(lambda s, w: s.call("mkdir", volume=w, path="/n"), write("/n/a", b"a")),
     steps(lambda s, w: s.call("mkdir", volume=w, path="/n"), write("/n/b", b"b"))),
    ("dir rename vs edit inside", rename("/d", "/d2"), edit("/d/f", 0, 1, b"I")),
    ("dir rename vs add inside", rename("/d", "/d2"), write("/d/g", b"g")),
    ("creates in different dirs", write("/d/n", b"1"), write("/e/n", b"2")),
    ("swap vs edit", steps(rename("/x", "/t"), rename("/y", "/x"), rename("/t", "/y")),
     edit("/x", 0, 1, b"X")),
    ("swap vs add", steps(rename("/x", "/t"), rename("/y", "/x"), rename("/t", "/y")),
     write("/d/new", b"n")),
    ("rename vs edit", rename("/x", "/d/moved"), edit("/x", 2, 2, b"more\n")),
    ("rmdir vs add elsewhere", lambda s, w: s.call("rmdir", volume=w, path="/e"),
     write("/d/n", b"n")),
    ("rename over vs edit elsewhere", rename("/x", "/y"), edit("/d/f", 0, 0, b">")),
    ("rename into a new dir", steps(lambda s, w: s.call("mkdir", volume=w, path="/n"),
     rename("/x", "/n/x")), write("/e/n", b"n")),
]  # fmt: skip

NON_CONFLICT_HEADS: dict[str, Tree] = {
    "same rename": {"/d": "dir", "/e": "dir", "/d/f": b"inside\n", "/x1": b"x\n", "/y": b"y\n"},
    "same add": {**BASE_TREE, "/d": "dir", "/e": "dir", "/n": b"same"},
    "same unlink": {"/d": "dir", "/e": "dir", "/d/f": b"inside\n", "/y": b"y\n"},
    "same mkdir": {**BASE_TREE, "/d": "dir", "/e": "dir", "/n": "dir"},
    "same mkdir, different files inside": {
        **BASE_TREE,
        "/d": "dir",
        "/e": "dir",
        "/n": "dir",
        "/n/a": b"a",
        "/n/b": b"b",
    },
    "dir rename vs edit inside": {"/d2": "dir", "/e": "dir", "/d2/f": b"Inside\n", "/x": b"x\n",
                                  "/y": b"y\n"},
    "dir rename vs add inside": {"/d2": "dir", "/e": "dir", "/d2/f": b"inside\n", "/d2/g": b"g",
                                 "/x": b"x\n", "/y": b"y\n"},
    "creates in different dirs": {**BASE_TREE, "/d": "dir", "/e": "dir", "/d/n": b"1",
                                  "/e/n": b"2"},
    "swap vs edit": {"/d": "dir", "/e": "dir", "/d/f": b"inside\n", "/x": b"y\n", "/y": b"X\n"},
    "swap vs add": {"/d": "dir", "/e": "dir", "/d/f": b"inside\n", "/x": b"y\n", "/y": b"x\n",
                    "/d/new": b"n"},
    "rename vs edit": {"/d": "dir", "/e": "dir", "/d/f": b"inside\n", "/d/moved": b"x\nmore\n",
                       "/y": b"y\n"},
    "rmdir vs add elsewhere": {**BASE_TREE, "/d": "dir", "/d/n": b"n"},
    "rename over vs edit elsewhere": {"/d": "dir", "/e": "dir", "/d/f": b">inside\n",
                                      "/y": b"x\n"},
    "rename into a new dir": {"/d": "dir", "/e": "dir", "/d/f": b"inside\n", "/n": "dir",
                              "/n/x": b"x\n", "/y": b"y\n", "/e/n": b"n"},
}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "first", "second"), NON_CONFLICTS, ids=[c[0] for c in NON_CONFLICTS]
)
@pytest.mark.parametrize("order", ["ab", "ba"])
def test_namespace_merges_without_conflict(
    name: str,
    first: Callable[[Service, str], object],
    second: Callable[[Service, str], object],
    order: str,
) -> None:
    service, green, winner, loser = namespace_case(first, second, order)
    assert_accepted(service, winner)
    assert_accepted(service, loser)
    assert service.tree(green) == NON_CONFLICT_HEADS[name]
    assert_same_state(service.svc, service.replayed())


def test_an_edit_follows_its_file_into_a_renamed_directory_on_rebase_too() -> None:
    service = Service()
    green = service.green(BASE_TREE, BASE_DIRS)
    mover, editor = service.work(green), service.work(green)
    service.call("rename", volume=mover, src="/d", dst="/d2")
    service.edit(editor, "/d/f", 0, 1, b"I")
    assert_accepted(service, mover)
    assert verdict(service.rebase(editor)) == (True, 2, [])
    assert service.read(editor, "/d2/f") == b"Inside\n"
    assert "/d" not in service.tree(editor)
    assert service.head(green) == 2  # rebase publishes nothing
    assert assert_accepted(service, editor) == 3
    assert service.read(green, "/d2/f") == b"Inside\n"


@pytest.mark.parametrize("order", ["mkdir first", "move first"])
def test_moving_into_a_directory_the_other_agent_also_created(order: str) -> None:
    """Bug: identical directory adds merge, but a move into that directory crashes submit.

    Both agents `mkdir /n` (identical adds are accepted); agent B also moves
    /x into /n.  Accepting A first, B's submit answers "internal error"
    (KeyError) instead of accepting or reporting a conflict.
    """
    service, green, winner, loser = namespace_case(
        lambda s, w: s.call("mkdir", volume=w, path="/n"),
        steps(lambda s, w: s.call("mkdir", volume=w, path="/n"), rename("/x", "/n/x")),
        "ab" if order == "mkdir first" else "ba",
    )
    assert_accepted(service, winner)
    reply = service.raw("submit", volume=loser)
    assert reply["ok"], reply
    assert reply["result"]["ok"], reply
    assert service.tree(green) == {
        "/d": "dir",
        "/e": "dir",
        "/d/f": b"inside\n",
        "/n": "dir",
        "/n/x": b"x\n",
        "/y": b"y\n",
    }


def test_moving_into_an_identically_created_directory_on_rebase() -> None:
    """The same bug through rebase: the rebase answers "internal error"."""
    service = Service()
    green = service.green(BASE_TREE, BASE_DIRS)
    a, b = service.work(green), service.work(green)
    service.call("mkdir", volume=a, path="/n")
    service.call("mkdir", volume=b, path="/n")
    service.call("rename", volume=b, src="/x", dst="/n/x")
    assert_accepted(service, a)
    reply = service.raw("rebase", volume=b)
    assert reply["ok"] and reply["result"]["ok"], reply
    assert service.read(b, "/n/x") == b"x\n"


def test_changed_paths_after_a_swap_name_where_the_edited_file_is() -> None:
    """Bug: the reported path of a change follows every rename of the increment in turn.

    Agent A swaps /x and /y; agent B edits /x (the object now at /y).  B's
    version must report /y as changed; it reports /x.
    """
    service = Service()
    green = service.green(BASE_TREE, BASE_DIRS)
    swapper, editor = service.work(green), service.work(green)
    for src, dst in (("/x", "/t"), ("/y", "/x"), ("/t", "/y")):
        service.call("rename", volume=swapper, src=src, dst=dst)
    service.edit(editor, "/x", 0, 1, b"X")
    assert assert_accepted(service, swapper) == 2
    assert assert_accepted(service, editor) == 3
    assert service.read(green, "/y") == b"X\n"
    assert service.call("changed_since", green=green, version=2) == ["/y"]


@pytest.mark.parametrize("operation", ["submit", "rebase"])
def test_crossing_directory_moves_are_a_conflict_not_an_error(operation: str) -> None:
    """Bug: moving /a into /b while another agent moves /b into /a makes a cycle.

    Each move is fine alone and they touch different objects and names, so
    map_through passes both; applying the second fails inside
    merge_tree.apply ("cannot move a directory inside itself", naming the
    internal ".slates-merge-N" name) and submit or rebase answers
    InvalidArgument instead of a conflict.
    """
    service = Service()
    green = service.green({"/a/f": b"1", "/b/g": b"2"}, ["/a", "/b"])
    one, two = service.work(green), service.work(green)
    service.call("rename", volume=one, src="/a", dst="/b/a")
    service.call("rename", volume=two, src="/b", dst="/a/b")
    assert_accepted(service, one)
    head, work_tree = service.tree(green), service.tree(two)
    reply = service.raw(operation, volume=two)
    assert service.tree(green) == head and service.tree(two) == work_tree
    assert_green_reads_its_head(service.svc, green)
    assert reply["ok"], reply
    assert reply["result"]["ok"] is False and reply["result"]["conflicts"], reply


def test_a_rejected_namespace_submission_keeps_the_work_volume() -> None:
    service = Service()
    green = service.green(BASE_TREE, BASE_DIRS)
    a, b = service.work(green), service.work(green)
    service.call("rename", volume=a, src="/d", dst="/renamed")
    service.call("rename", volume=b, src="/d", dst="/other")
    service.call("write", volume=b, path="/other/new", data=b"n")
    service.call("unlink", volume=b, path="/y")
    assert_accepted(service, a)
    assert_rejected(service, green, b, ["rename vs rename"])
    assert service.tree(b) == {
        "/other": "dir",
        "/other/f": b"inside\n",
        "/other/new": b"n",
        "/e": "dir",
        "/x": b"x\n",
    }


def test_a_delete_beside_an_accepted_delete_with_an_insert_after_it() -> None:
    """Bug: a mapped edit list can be invalid, and the submit then fails half-done.

    Base "abc".  Agent A deletes the "b" ([1, 2), accepted as v2).  Agent B
    deletes the "a" ([0, 1)) and inserts "x" before the "c" ([2, 2)): no
    overlap, the merge is "xc".  Mapped through v2, B's edits become
    [0, 1) -> "" and [1, 1) -> "x", adjacent, which check_edits refuses when
    the "version" event is decoded.  The submit answers InvalidArgument after
    the green volume was already restarted with B's changes: the green reads
    "xc" while its ledger's head is still v2 ("ac"), and those records are
    journaled without a version.
    """
    service = Service()
    green = service.green({"/f": b"abc"})
    a, b = service.work(green), service.work(green)
    service.edit(a, "/f", 1, 2, b"")
    service.edit(b, "/f", 2, 2, b"x")
    service.edit(b, "/f", 0, 1, b"")
    assert assert_accepted(service, a) == 2
    reply = service.raw("submit", volume=b)
    assert_green_reads_its_head(service.svc, green)  # whatever the verdict
    assert reply["ok"], reply
    assert verdict(reply["result"]) == (True, 3, []), reply
    assert service.read(green, "/f") == b"xc"
    assert_same_state(service.svc, service.replayed())


def test_a_work_volume_from_an_older_version_maps_through_every_later_one() -> None:
    service = Service()
    green = service.green({"/f": b"0123456789"})
    old = service.work(green)
    for offset, data in ((0, b"A"), (5, b"B"), (12, b"C")):  # three inserts, each on the head
        w = service.work(green)
        service.edit(w, "/f", offset, offset, data)
        assert_accepted(service, w)
    assert service.read(green, "/f") == b"A0123B456789C"
    service.edit(old, "/f", 9, 10, b"nine")  # the 9 of v1, at [11, 12) of the head
    assert assert_accepted(service, old) == 5
    assert service.read(green, "/f") == b"A0123B45678nineC"
    older = service.work(green, version=2)
    assert service.read(older, "/f") == b"A0123456789"
    service.edit(older, "/f", 5, 6, b"")  # the 4: B went in at its start, v3 [5, 5)
    assert_accepted(service, older)
    assert service.read(green, "/f") == b"A0123B5678nineC"


# -- rebase ----------------------------------------------------------------------


def test_rebase_maps_the_work_onto_the_head_and_publishes_nothing() -> None:
    service = Service()
    green = service.green({"/image.conf": CONF, "/d/x": b"x"}, ["/d"])
    quality, cache = service.work(green), service.work(green)
    service.edit(quality, "/image.conf", *QUALITY, b"90")
    service.edit(cache, "/image.conf", *CACHE, b"on")
    service.call("write", volume=cache, path="/d/new", data=b"new")
    assert_accepted(service, quality)
    head = service.tree(green)
    assert verdict(service.rebase(cache)) == (True, 2, [])
    assert service.tree(green) == head and service.head(green) == 2
    assert service.base_of(cache) == 2
    assert service.read(cache, "/image.conf") == b"quality=90\ncache=on\n"
    assert service.read(cache, "/d/new") == b"new"
    # The rebased work's changes are now relative to v2: more edits, then submit.
    service.edit(cache, "/image.conf", 0, 0, b"# conf\n")
    assert assert_accepted(service, cache) == 3
    assert service.tree(green) == {
        "/image.conf": b"# conf\nquality=90\ncache=on\n",
        "/d": "dir",
        "/d/x": b"x",
        "/d/new": b"new",
    }
    assert service.svc.greens[green][3].base == 2


def test_a_rebase_conflict_changes_nothing() -> None:
    service = Service()
    green = service.green({"/image.conf": CONF})
    agent1, agent2 = service.work(green), service.work(green)
    service.edit(agent1, "/image.conf", *QUALITY, b"90")
    service.edit(agent2, "/image.conf", *QUALITY, b"60")
    assert_accepted(service, agent1)
    before = service.tree(agent2)
    result = service.rebase(agent2)
    assert result["ok"] is False and result["version"] == 1
    assert [c["kind"] for c in result["conflicts"]] == ["overlap"]
    assert result["conflicts"][0]["base_bytes"] == b"80"
    assert service.tree(agent2) == before and service.base_of(agent2) == 1


def test_rebasing_an_unchanged_work_volume_brings_it_to_the_head() -> None:
    service = Service()
    green = service.green({"/f": b"v1"})
    idle, busy = service.work(green), service.work(green)
    service.call("write", volume=busy, path="/f", data=b"v2", truncate=True)
    assert_accepted(service, busy)
    assert verdict(service.rebase(idle)) == (True, 2, [])
    assert service.tree(idle) == service.tree(green)
    assert verdict(service.submit(idle)) == (True, 2, [])


def test_green_volumes_refuse_direct_changes() -> None:
    service = Service()
    green = service.green({"/f": b"v1"})
    for op, args in (
        ("write", {"path": "/f", "data": b"x"}),
        ("edit", {"path": "/f", "start": 0, "end": 0, "data": b"x"}),
        ("unlink", {"path": "/f"}),
        ("mkdir", {"path": "/d"}),
        ("rename", {"src": "/f", "dst": "/g"}),
    ):
        reply = service.raw(op, volume=green, **args)
        assert not reply["ok"] and reply["error"]["code"] == "NotPermitted", reply
    assert service.tree(green) == {"/f": b"v1"}
    assert not service.raw("submit", volume=green)["ok"]
    assert not service.raw("work.create", green="vol-0-999", name="w")["ok"]
    assert not service.raw("work.create", green=green, name="w", version=9)["ok"]


# -- git merge-file, at the service level ----------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_disjoint_line_edits_merge_like_git_merge_file(data: st.DataObject) -> None:
    base, edits = draw_line_edits(data, max_lines=24)
    service = Service()
    green = service.green({"/f": base})
    ours, theirs = service.work(green), service.work(green)
    expected_files = {ours: base, theirs: base}
    # Each agent edits its line ranges from the end of the file backwards, so the
    # base offsets stay valid; an edit is a delete, insert or replace of lines.
    for number, edit in reversed(list(enumerate(edits))):
        work = ours if number % 2 else theirs
        service.edit(work, "/f", edit.start, edit.end, edit.data)
        old = expected_files[work]
        expected_files[work] = old[: edit.start] + edit.data + old[edit.end :]
    assert service.read(ours, "/f") == expected_files[ours]
    expected = git_merge(base, expected_files[ours], expected_files[theirs])
    assume(expected is not None)
    first_work, second_work = data.draw(st.permutations([ours, theirs]), label="order")
    assert_accepted(service, first_work)
    assert_accepted(service, second_work)
    assert service.read(green, "/f") == expected


# -- replay and checkpoints ------------------------------------------------------


def test_replay_and_checkpoint_reproduce_the_ledger_works_and_heads() -> None:
    service = Service()
    green = service.green({"/image.conf": CONF, "/d/f": b"inside\n"}, ["/d"])
    a, b, c, d = (service.work(green) for _ in range(4))
    service.edit(a, "/image.conf", *QUALITY, b"90")
    service.edit(b, "/image.conf", *QUALITY, b"60")  # will conflict
    service.edit(c, "/image.conf", *CACHE, b"on")
    service.call("rename", volume=c, src="/d", dst="/dir")
    service.call("write", volume=d, path="/d/g", data=b"new")
    service.edit(d, "/d/f", 0, 0, b"# ")
    assert_accepted(service, a)
    assert_rejected(service, green, b, ["overlap"])  # a failed submit
    assert not service.rebase(b)["ok"]  # a failed rebase
    assert service.rebase(c)["ok"]
    assert_accepted(service, c)
    assert service.rebase(d)["ok"]
    assert service.read(d, "/dir/f") == b"# inside\n"
    service.call("write", volume=d, path="/dir/h", data=b"after the rebase")
    assert_accepted(service, d)
    old = service.work(green, version=1)
    service.call("unlink", volume=old, path="/d/f")
    assert_rejected(service, green, old, ["delete vs modify"])
    assert service.head(green) == 4

    for other in (service.replayed(), service.restored()):
        assert_same_state(service.svc, other)
    # A checkpoint of the replayed service restores to the same state again.
    replayed = service.replayed()
    again = ShardService(0, Host(chunks=dict(replayed.host._chunks)), LiveDirectory)
    again.restore(replayed.checkpoint())
    assert_same_state(service.svc, again)


def test_a_restored_service_continues_the_ledger_like_the_original() -> None:
    service = Service()
    green = service.green({"/image.conf": CONF})
    a, b = service.work(green), service.work(green)
    service.edit(a, "/image.conf", *QUALITY, b"90")
    service.edit(b, "/image.conf", *CACHE, b"on")
    assert_accepted(service, a)
    # Work in progress (b is unsubmitted) survives replay and checkpoints.
    for other in (service.replayed(), service.restored()):
        reply, _events = finish(
            other, *other.handle("late", Request(1, 0, "submit", {"volume": b}), 10**12)
        )
        assert reply["ok"] and verdict(reply["result"]) == (True, 3, []), reply
        head = volume_tree(other.volumes[green])
        assert head == {"/image.conf": b"quality=90\ncache=on\n"}


def test_a_rewrite_too_large_to_refine_is_submitted_whole_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import slates.merge.refine as refining

    monkeypatch.setattr(refining, "REFINE_LIMIT", 16)  # 64 MiB in the product
    service = Service()
    green = service.green({"/image.conf": CONF, "/small": b"a b\n"})
    work = service.work(green)
    service.call("write", volume=work, path="/image.conf", data=CONF + b"x=1\n", truncate=True)
    service.call("write", volume=work, path="/small", data=b"a c\n", truncate=True)
    result = service.submit(work)
    assert result["ok"] and result["literal"] == ["/image.conf"], result
    assert result["refined"] == ["/small"], result
    (edit,) = [
        c
        for c in service.svc.greens[green][-1].originals
        if isinstance(c, Edit) and c.path == "/image.conf"
    ]
    assert edit.edits == (Replace(0, len(CONF), CONF + b"x=1\n"),) and not edit.rewrite


@pytest.mark.parametrize("pattern", ["!", "", "a\nb", "#comment", "x/../y"])
def test_a_private_pattern_that_is_not_gitignore_syntax_is_refused(pattern: str) -> None:
    service = Service()
    reply = service.raw("green.create", name="g", private=[pattern])
    assert reply["ok"] is False and reply["error"]["code"] == "InvalidArgument", reply
    assert service.svc.greens == {} and service.svc.volumes == {}  # nothing was made
