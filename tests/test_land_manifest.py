"""Landing manifests (slates.land.manifest): ids, canonical encoding, the three-way rule.

Pure tests, no I/O (plans are made from in-memory volumes).  They follow
DESIGN.md section 6 and the product description's "Writing Approved Changes
to Disk": a manifest lists each entry (path, witnessed state or absent,
proposed state or delete), its id is the BLAKE3 of its canonical encoding,
so any change of selection, witness or proposal changes the id; paths never
leave the target; private paths are never planned.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import blake3
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slates.core import ROOT_INO, Host, Volume
from slates.core.volume import Root
from slates.errors import InvalidArgument, NotFound
from slates.land.manifest import (
    Decision,
    Entry,
    Manifest,
    State,
    check_relative,
    decide,
    manifest_from_wire,
    order_for_apply,
)
from slates.merge.private import PrivateMatcher, PrivatePolicy
from slates.node.landing import LandingDesk

TARGET = "/home/dev/project"


def file_state(data: bytes, mode: int = 0o644) -> State:
    return State("file", blake3.blake3(data).hexdigest(), mode)


def link_state(target: str) -> State:
    return State("symlink", blake3.blake3(target.encode()).hexdigest(), 0o777)


def dir_state(mode: int = 0o755) -> State:
    return State("dir", None, mode)


def decode(data: bytes) -> Manifest:
    return manifest_from_wire(msgpack.unpackb(data, raw=False))


def sample() -> Manifest:
    return Manifest(
        "snap-0-7",
        TARGET,
        (
            Entry("README.md", file_state(b"old readme\n"), None),
            Entry("conf", None, dir_state(0o750)),
            Entry("conf/settings.conf", None, file_state(b"quality=90\n")),
            Entry("latest", link_state("conf"), link_state("conf/settings.conf")),
            Entry("run.sh", file_state(b"#!/bin/sh\n"), file_state(b"#!/bin/sh\n", 0o755)),
            Entry("src/app.py", file_state(b"quality=80\n"), file_state(b"quality=90\n")),
        ),
    )


# -- ids and the canonical encoding ---------------------------------------------------


def test_the_id_is_the_blake3_of_the_canonical_encoding() -> None:
    manifest = sample()
    encoded = manifest.encode()
    assert manifest.manifest_id == blake3.blake3(encoded).hexdigest()
    assert len(manifest.manifest_id) == 64
    assert encoded == msgpack.packb(manifest.to_wire(), use_bin_type=True)
    assert decode(encoded) == manifest
    assert sample().encode() == encoded  # the same plan twice: the same bytes and id
    assert sample().manifest_id == manifest.manifest_id


def test_entries_list_path_witness_and_proposal_on_the_wire() -> None:
    wire = sample().to_wire()
    assert wire[:3] == [1, "snap-0-7", TARGET]
    by_path = {item[0]: item for item in wire[3]}
    old = blake3.blake3(b"old readme\n").hexdigest()
    assert by_path["README.md"] == ["README.md", ["file", old, 0o644], None]  # a delete
    assert by_path["conf"] == ["conf", None, ["dir", None, 0o750]]  # absent -> new dir
    link = by_path["latest"]
    assert link[1][0] == link[2][0] == "symlink" and link[1][2] == link[2][2] == 0o777
    mode_only = by_path["run.sh"]
    assert mode_only[1][1] == mode_only[2][1] and (mode_only[1][2], mode_only[2][2]) == (
        0o644,
        0o755,
    )
    assert [item[0] for item in wire[3]] == sorted(by_path)


def test_selecting_a_path_inside_a_new_directory_brings_the_directory() -> None:
    chosen = sample().select(["conf/settings.conf"])
    assert [e.path for e in chosen.entries] == ["conf", "conf/settings.conf"]
    assert sample().select(["/"]) == sample()


def test_changing_the_selection_changes_the_id() -> None:
    whole = sample()
    ids = {whole.manifest_id}
    for paths in (["src"], ["conf"], ["latest"], ["README.md", "src/app.py"]):
        chosen = whole.select(paths)
        assert 0 < len(chosen.entries) < len(whole.entries)
        ids.add(chosen.manifest_id)
    assert len(ids) == 5
    # "conf" selects the directory and what is below it; a leading slash is a volume path
    assert [e.path for e in whole.select(["/conf"]).entries] == ["conf", "conf/settings.conf"]
    assert whole.select(["conf"]).manifest_id == whole.select(["/conf/"]).manifest_id
    # a prefix of a name is not its parent
    assert whole.select(["con"]).entries == ()


def test_changing_a_witness_changes_the_id() -> None:
    m7 = sample()
    m8 = m7.rewitnessed({"src/app.py": file_state(b"quality=60\n")})
    assert m8.manifest_id != m7.manifest_id
    assert m8.source == m7.source and m8.target == m7.target
    changed = {e.path: e for e in m8.entries}["src/app.py"]
    assert changed.witnessed == file_state(b"quality=60\n")
    assert changed.proposed == file_state(b"quality=90\n")  # the proposal is untouched
    # rewitnessing with what was already witnessed is the same manifest
    same = m7.rewitnessed({"src/app.py": file_state(b"quality=80\n")})
    assert same == m7 and same.manifest_id == m7.manifest_id
    # the disk now absent where the plan witnessed a file: still a different manifest
    gone = m7.rewitnessed({"README.md": None})
    assert "README.md" not in {e.path for e in gone.entries}  # nothing left to change
    assert gone.manifest_id != m7.manifest_id


def test_changing_a_proposal_source_or_target_changes_the_id() -> None:
    m = sample()
    entries = list(m.entries)
    entries[-1] = dataclasses.replace(entries[-1], proposed=file_state(b"quality=95\n"))
    variants = [
        dataclasses.replace(m, entries=tuple(entries)),
        dataclasses.replace(m, source="snap-0-8"),
        dataclasses.replace(m, target="/home/dev/other"),
        dataclasses.replace(
            m, entries=(*m.entries[:4], Entry("run.sh", file_state(b"#!/bin/sh\n"), None))
        ),
    ]
    ids = {m.manifest_id} | {v.manifest_id for v in variants}
    assert len(ids) == 1 + len(variants)


# -- validation: no path leaves the target --------------------------------------------


BAD_PATHS = [
    "",
    "/etc/passwd",
    "..",
    "../outside",
    "a/../../b",
    "a/..",
    ".",
    "./a",
    "a/./b",
    "a//b",
    "a/",
    "//a",
    "a\0b",
]


@pytest.mark.parametrize("path", BAD_PATHS)
def test_a_path_leaving_the_target_is_refused(path: str) -> None:
    with pytest.raises(InvalidArgument):
        check_relative(path)
    with pytest.raises(InvalidArgument):
        Manifest("snap-0-1", TARGET, (Entry(path, None, file_state(b"x")),))
    with pytest.raises(InvalidArgument):
        manifest_from_wire([1, "snap-0-1", TARGET, [[path, None, ["file", "0" * 64, 0o644]]]])


@pytest.mark.parametrize("path", ["..", "../x", "a/../../x", "a//b", "./a"])
def test_a_selection_leaving_the_target_is_refused(path: str) -> None:
    with pytest.raises(InvalidArgument):
        sample().select([path])


@pytest.mark.parametrize("path", ["a", "a/b/c", ".hidden", "a..b", "...", "a b/ü"])
def test_plain_relative_paths_are_accepted(path: str) -> None:
    assert check_relative(path) == path


def test_a_manifest_needs_an_absolute_target_and_sorted_unique_real_changes() -> None:
    entry = Entry("a", None, file_state(b"x"))
    with pytest.raises(InvalidArgument):
        Manifest("snap-0-1", "relative/target", (entry,))
    with pytest.raises(InvalidArgument):
        Manifest("snap-0-1", TARGET, (Entry("b", None, file_state(b"x")), entry))
    with pytest.raises(InvalidArgument):
        Manifest("snap-0-1", TARGET, (entry, entry))
    with pytest.raises(InvalidArgument):
        Manifest("snap-0-1", TARGET, (Entry("a", None, None),))


@pytest.mark.parametrize(
    "raw",
    [
        ["fifo", "0" * 64, 0o644],
        ["dir", "0" * 64, 0o755],  # a directory has no content hash
        ["file", None, 0o644],
        ["file", "abc", 0o644],
        ["file", "0" * 64, True],
        ["file", "0" * 64, 0o10000],
        ["file", "0" * 64, -1],
        ["file", "0" * 64],
        "file",
    ],
)
def test_malformed_states_are_refused(raw: Any) -> None:
    with pytest.raises(InvalidArgument):
        manifest_from_wire([1, "snap-0-1", TARGET, [["a", None, raw]]])


@pytest.mark.parametrize(
    "raw",
    [
        [2, "snap-0-1", TARGET, []],
        [1, "snap-0-1", TARGET],
        [1, 7, TARGET, []],
        [1, "snap-0-1", TARGET, [["a", None]]],
        {"source": "snap-0-1"},
    ],
)
def test_malformed_manifests_are_refused(raw: Any) -> None:
    with pytest.raises(InvalidArgument):
        manifest_from_wire(raw)


# -- the three-way rule ---------------------------------------------------------------

OLD, NEW, OTHER = file_state(b"quality=80\n"), file_state(b"quality=90\n"), file_state(b"60\n")


@pytest.mark.parametrize(
    ("witnessed", "disk", "proposed", "expected"),
    [
        (OLD, OLD, NEW, Decision.APPLY),  # witnessed old, disk old: apply
        (OLD, NEW, NEW, Decision.IDENTICAL),  # the disk already holds the proposal
        (OLD, OTHER, NEW, Decision.CONFLICT),  # an outside edit
        (None, None, NEW, Decision.APPLY),  # a new file
        (None, OTHER, NEW, Decision.CONFLICT),  # something appeared meanwhile
        (None, NEW, NEW, Decision.IDENTICAL),
        (OLD, OLD, None, Decision.APPLY),  # a deletion
        (OLD, None, None, Decision.IDENTICAL),  # already deleted
        (OLD, OTHER, None, Decision.CONFLICT),  # edited meanwhile: not deleted
        (OLD, None, NEW, Decision.CONFLICT),  # deleted meanwhile: not recreated
        (OLD, file_state(b"quality=80\n", 0o600), NEW, Decision.CONFLICT),  # a mode change
        (OLD, dir_state(), NEW, Decision.CONFLICT),  # a type change
        (dir_state(), dir_state(), OLD, Decision.APPLY),  # a directory becomes a file
        (dir_state(), dir_state(0o700), OLD, Decision.CONFLICT),
        (link_state("a"), link_state("a"), link_state("b"), Decision.APPLY),
        (link_state("a"), link_state("c"), link_state("b"), Decision.CONFLICT),
        (State("file", NEW.digest, 0o644), State("other", "", 0o644), NEW, Decision.CONFLICT),
    ],
)
def test_the_product_table(
    witnessed: State | None, disk: State | None, proposed: State | None, expected: Decision
) -> None:
    assert decide(witnessed, disk, proposed) is expected


def test_apply_order_parents_first_removals_deepest_first_dir_to_file_last() -> None:
    entries = [
        Entry("a", dir_state(), file_state(b"a is a file now")),  # its contents go first
        Entry("a/x", file_state(b"x"), None),
        Entry("a/y", dir_state(), None),
        Entry("a/y/z", file_state(b"z"), None),
        Entry("b", file_state(b"b"), dir_state()),  # a file becomes a directory
        Entry("b/c", None, file_state(b"c")),
        Entry("n", None, dir_state()),
        Entry("n/m", None, dir_state()),
        Entry("n/m/f", None, file_state(b"f")),
        Entry("q", file_state(b"q"), file_state(b"q2")),
    ]
    order = [e.path for e in order_for_apply(entries)]
    assert sorted(order) == sorted(e.path for e in entries)
    position = {path: i for i, path in enumerate(order)}
    for parent, child in (("b", "b/c"), ("n", "n/m"), ("n/m", "n/m/f")):
        assert position[parent] < position[child]  # created before what they hold
    for child, parent in (("a/y/z", "a/y"), ("a/y", "a"), ("a/x", "a")):
        assert position[child] < position[parent]  # emptied before they go
    assert order[-1] == "a"


# -- properties -----------------------------------------------------------------------

_names = st.sampled_from(["a", "b", "c", "src", "README.md", ".env", "ü"])
_paths = st.lists(_names, min_size=1, max_size=3).map("/".join)
_digests = st.binary(max_size=8).map(lambda data: blake3.blake3(data).hexdigest())
_modes = st.sampled_from([0o644, 0o600, 0o755, 0o700, 0o4755, 0o1777])
_states: st.SearchStrategy[State | None] = st.one_of(
    st.none(),
    st.builds(State, st.just("file"), _digests, _modes),
    st.builds(State, st.just("symlink"), _digests, st.just(0o777)),
    st.builds(State, st.just("dir"), st.none(), _modes),
)


def _present(state: State | None) -> bool:
    return state is not None


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    entries = []
    for path in sorted(draw(st.sets(_paths, max_size=6))):
        witnessed = draw(_states)
        proposed = draw(_states if witnessed is not None else _states.filter(_present))
        entries.append(Entry(path, witnessed, proposed))
    source = draw(st.sampled_from(["snap-0-1", "snap-1-2", "snap-0-12"]))
    target = draw(st.sampled_from([TARGET, "/tmp/t", "/"]))
    return Manifest(source, target, tuple(entries))


@settings(max_examples=150, deadline=None)
@given(manifests())
def test_decode_of_encode_is_the_manifest(manifest: Manifest) -> None:
    encoded = manifest.encode()
    assert decode(encoded) == manifest
    assert decode(encoded).manifest_id == manifest.manifest_id
    assert manifest_from_wire(manifest.to_wire()) == manifest
    assert manifest.manifest_id == blake3.blake3(encoded).hexdigest()


@settings(max_examples=150, deadline=None)
@given(manifests(), manifests())
def test_different_manifests_have_different_ids(first: Manifest, second: Manifest) -> None:
    if first == second:
        assert first.manifest_id == second.manifest_id
    else:
        assert first.manifest_id != second.manifest_id
        assert first.encode() != second.encode()


@settings(max_examples=100, deadline=None)
@given(manifests(), st.data())
def test_a_rewitness_that_changes_a_witness_changes_the_id(
    manifest: Manifest, data: st.DataObject
) -> None:
    if not manifest.entries:
        return
    entry = data.draw(st.sampled_from(manifest.entries))
    observed = data.draw(_states.filter(lambda s: s != entry.witnessed))
    renewed = manifest.rewitnessed({entry.path: observed})
    assert renewed != manifest
    assert renewed.manifest_id != manifest.manifest_id


# -- plans leave private paths out ------------------------------------------------------


def _tree(host: Host, files: dict[str, bytes]) -> Root:
    volume = Volume.new(host)
    for path, data in files.items():
        parent = ROOT_INO
        parts = path.split("/")
        for part in parts[:-1]:
            try:
                parent = volume.lookup(parent, part).ino
            except NotFound:
                parent = volume.mkdir(parent, part).ino
        ino = volume.create(parent, parts[-1]).ino
        volume.write(ino, 0, data)
    return volume.snapshot("snap-0-1").root


def test_a_plan_leaves_private_paths_out() -> None:
    """`.git/` and what the repository ignores are private to work volumes: a plan never
    lands them (the matcher is the one submissions use, asked with volume paths)."""
    host = Host()
    ignore = b"*.o\nbuild/\n"
    witness = _tree(host, {".gitignore": ignore, "src/a.c": b"a1\n", ".git/HEAD": b"ref: main\n"})
    proposal = _tree(
        host,
        {
            ".gitignore": ignore,
            "src/a.c": b"a2\n",
            "src/a.o": b"\x7fELF",
            "build/out/x": b"x",
            ".git/HEAD": b"ref: other\n",
            ".git/objects/ab": b"blob",
        },
    )

    def read(root: Root, ino: int) -> bytes:
        reader = Volume(host, root)
        try:
            return reader.read(ino, 0, reader.getattr(ino).size)
        finally:
            reader.close()

    def gitignore(path: str) -> bytes | None:
        return ignore if path == "/.gitignore" else None

    matcher = PrivateMatcher(PrivatePolicy(), gitignore)
    asked: list[tuple[str, bool]] = []

    def private(path: str, is_dir: bool) -> bool:
        asked.append((path, is_dir))
        return matcher.is_private("/" + path, is_dir)

    everything = LandingDesk.plan(witness, proposal, "snap-0-1", TARGET, read, None)
    assert {e.path for e in everything.entries} >= {"src/a.o", ".git/HEAD", "build/out/x"}
    plan = LandingDesk.plan(witness, proposal, "snap-0-1", TARGET, read, None, private)
    assert [e.path for e in plan.entries] == ["src/a.c"]
    assert (".git", True) in asked and ("build", True) in asked
    assert not any(path.startswith(".git/") for path, _ in asked)  # nothing below is walked
