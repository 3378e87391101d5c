"""Properties of submit and rebase in the shard service, checked with hypothesis.

- Two or three agents make random byte edits (edit, pwrite-like write,
  truncate) to shared files of one green version and submit in every order.
  The expected verdicts and heads come from the pure range engine: each
  agent's operations composed relative to the base (slates.merge.ranges),
  a write over the volume's private pages recording only the bytes it
  changes (Volume.write: the one fact the model asks the volume is whether
  the pages are private);
  an agent conflicts iff one of its edits overlaps, with different bytes, an
  edit of an agent accepted before it (ranges.overlaps; identical edits are
  accepted); the head is every accepted edit applied to the base, the same
  for every order; a rejected submission changes nothing.
- A state machine over one green volume: work volumes from the head or older
  versions, random content and namespace changes, submits and rebases.  Its
  oracle is three-way: an object only one side changed ends as that side
  left it, untouched objects stay, new objects appear, and when the two
  sides touched disjoint objects and names the submission must be accepted
  with exactly that result.  Conflicts leave the head and the work alone.
  Each run ends with a replay and a checkpoint compared to the live state.

These greens keep rewrites exact (`rewrites="exact"`): the oracle is the
recorded ranges.  Refined rewrites have their own properties (test_refine,
test_agent_merge).
"""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from slates.merge.ranges import Replace, apply, compose, overlaps
from tests.test_merge_service import (
    Files,
    Service,
    assert_green_reads_its_head,
    assert_same_state,
)

FileOp = tuple[str, int, int, bytes]  # ("edit", start, end, data) | ("write", offset, 0, data)
#                                       | ("truncate", size, 0, b"")
AgentOps = dict[str, list[FileOp]]  # path -> operations, in order
Case = tuple[dict[str, bytes], list[AgentOps]]
RANGE_KINDS = {"overlap", "insertion point deleted"}

# -- agents editing shared files -------------------------------------------------


def as_replace(op: FileOp, size: int) -> Replace:
    """The operation as the recorded replacement of [start, end) of the file at that moment."""
    kind, a, b, data = op
    if kind == "edit":
        return Replace(a, b, data)
    if kind == "write":
        start = min(a, size)
        return Replace(start, min(a + len(data), size), bytes(a - start) + data)
    if a < size:
        return Replace(a, size, b"")
    return Replace(size, size, bytes(a - size))


def run_op(service: Service, work: str, path: str, op: FileOp) -> None:
    kind, a, b, data = op
    if kind == "edit":
        service.edit(work, path, a, b, data)
    elif kind == "write":
        service.call("write", volume=work, path=path, data=data, offset=a)
    else:
        service.call("truncate", volume=work, path=path, size=a)


def small_bytes(min_size: int = 0, max_size: int = 3) -> st.SearchStrategy[bytes]:
    # A two-letter alphabet makes identical edits by different agents likely.
    return st.lists(st.sampled_from(b"ab"), min_size=min_size, max_size=max_size).map(bytes)


@st.composite
def file_ops(draw: st.DrawFn, size: int) -> list[FileOp]:
    ops: list[FileOp] = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["edit", "edit", "edit", "write", "truncate"]))
        if kind == "edit":
            start = draw(st.integers(0, size))
            end = draw(st.integers(start, min(size, start + 4)))
            op: FileOp = ("edit", start, end, draw(small_bytes()))
        elif kind == "write":
            op = ("write", draw(st.integers(0, size + 2)), 0, draw(small_bytes(1)))
        else:
            op = ("truncate", draw(st.integers(max(0, size - 3), size + 2)), 0, b"")
        replace = as_replace(op, size)
        size += replace.delta
        ops.append(op)
    return ops


@st.composite
def agents_case(draw: st.DrawFn, agents: int) -> Case:
    paths = ["/f0", "/f1"][: draw(st.integers(1, 2))]
    base = {path: draw(small_bytes(0, 10)) for path in paths}
    plans = [{path: draw(file_ops(len(base[path]))) for path in paths} for _ in range(agents)]
    return base, plans


def changed_part(current: bytes, data: bytes) -> tuple[int, int]:
    """The part [lo, hi) of `data` written over `current` (the file's bytes where it
    starts) that differs: the leading and trailing bytes equal to what the file holds are
    left out, and a write of nothing new still writes its first byte."""
    n, lo = len(current), 0
    while lo < min(n, len(data)) and data[lo] == current[lo]:
        lo += 1
    if len(data) > n:
        return lo, len(data)
    if lo == n:
        return 0, min(1, len(data))
    shared = 0
    while shared < n - lo and data[n - 1 - shared] == current[n - 1 - shared]:
        shared += 1
    return lo, n - shared


def recorded(service: Service, work: str, path: str, op: FileOp, content: bytes) -> Replace:
    """The operation as the work volume records it (DESIGN.md section 4, crash safety): a
    write that lands on the volume's private pages leaves out the bytes it rewrites
    unchanged.  Whether the pages are private is the volume's fact; the rest is the model."""
    kind, a, _b, data = op
    size = len(content)
    if kind == "write" and a < size:
        end = min(a + len(data), size)
        volume = service.svc.volumes[work]
        if volume.is_private(volume.resolve(path), a, end):
            lo, hi = changed_part(content[a:end], data)
            return as_replace(("write", a + lo, 0, data[lo:hi]), size)
    return as_replace(op, size)


def run_agent(
    service: Service, work: str, base: dict[str, bytes], plan: AgentOps
) -> dict[str, tuple[Replace, ...]]:
    """Run an agent's operations; each file's edit list relative to the base: what its
    submission amounts to."""
    out: dict[str, tuple[Replace, ...]] = {}
    for path, ops in plan.items():
        content, replaces = base[path], []
        for op in ops:
            replace = recorded(service, work, path, op, content)
            run_op(service, work, path, op)
            content = apply(content, [replace])
            replaces.append(replace)
        out[path] = compose(len(base[path]), replaces)
        assert service.read(work, path) == apply(base[path], out[path])
    return out


def clash(a: dict[str, tuple[Replace, ...]], b: dict[str, tuple[Replace, ...]]) -> bool:
    return any(overlaps(x, y) and x != y for path in a for x in a[path] for y in b.get(path, ()))


def run_in_order(case: Case, order: tuple[int, ...]) -> None:
    """Every agent edits, then they submit in `order`; checks verdicts, heads, rejections."""
    base, plans = case
    service = Service()
    green = service.green(base, rewrites="exact")
    works = [service.work(green) for _ in plans]
    edits = [run_agent(service, work, base, plan) for work, plan in zip(works, plans, strict=True)]
    accepted: list[int] = []
    for agent in order:
        work = works[agent]
        version, head, work_tree = service.head(green), service.tree(green), service.tree(work)
        result = service.submit(work)
        expect_conflict = any(clash(edits[agent], edits[other]) for other in accepted)
        note = f"agent {agent} in order {order}, accepted before it {accepted}: {result}"
        if not result["ok"]:
            assert expect_conflict, note
            assert result["conflicts"] and result["version"] is None, note
            assert {c["kind"] for c in result["conflicts"]} <= RANGE_KINDS, note
            # A rejected submission changes nothing: head, its version, the work volume.
            assert service.head(green) == version and service.tree(green) == head, note
            assert service.tree(work) == work_tree, note
            continue
        assert not expect_conflict, note
        accepted.append(agent)
        now = service.tree(green)
        if now != head:
            assert result["version"] == version + 1 == service.head(green), note
        assert result["version"] == service.head(green), note
        for path in base:
            union = {edit for agent_ in accepted for edit in edits[agent_][path]}
            merged = apply(base[path], sorted(union, key=lambda e: (e.start, e.end)))
            assert now[path] == merged, f"{path}: {note}"


ADJACENT_AFTER_MAPPING: Case = (
    {"/f0": b"abc"},
    [
        {"/f0": [("edit", 1, 2, b"")]},  # deletes "b"
        {"/f0": [("edit", 2, 2, b"x"), ("edit", 0, 1, b"")]},  # "x" before "c", deletes "a"
    ],
)


@settings(max_examples=100, deadline=None)
@given(agents_case(2))
@example(ADJACENT_AFTER_MAPPING)
def test_two_agents_in_either_order(case: Case) -> None:
    for order in itertools.permutations(range(2)):
        run_in_order(case, order)


COLLAPSED_INSERTS: Case = (
    {"/f0": b"abcdef"},
    [
        {"/f0": [("edit", 2, 4, b"")]},  # deletes "cd"
        {"/f0": [("edit", 4, 4, b"Q")]},  # inserts after "cd"
        {"/f0": [("edit", 2, 2, b"Q")]},  # inserts the same bytes before "cd"
    ],
)
COLLAPSED_DIFFERENT_INSERTS: Case = (
    {"/f0": b"abcdef"},
    [
        {"/f0": [("edit", 2, 4, b"")]},
        {"/f0": [("edit", 4, 4, b"B")]},
        {"/f0": [("edit", 2, 2, b"C")]},
    ],
)


# Found by the property: a write of bytes the file already holds, over pages an earlier
# write made private, records only what differs (or its first byte), so it can meet
# another agent's insert at one point, or an identical edit, or miss a deleted range.
UNCHANGED_REWRITE_BESIDE_AN_INSERT: Case = (
    {"/f0": b"aa", "/f1": b""},
    [
        {"/f0": [("edit", 2, 2, b"a")], "/f1": []},
        {"/f0": [], "/f1": []},
        {"/f0": [("write", 2, 0, b"b"), ("write", 0, 0, b"aa")], "/f1": []},
    ],
)
UNCHANGED_REWRITE_OF_AN_IDENTICAL_INSERT: Case = (
    {"/f0": b"aa", "/f1": b""},
    [
        {"/f0": [("edit", 2, 2, b"a")], "/f1": []},
        {"/f0": [], "/f1": []},
        {"/f0": [("write", 2, 0, b"a"), ("write", 0, 0, b"aa")], "/f1": []},
    ],
)
UNCHANGED_REWRITE_OVER_A_DELETE: Case = (
    {"/f0": b"aa", "/f1": b""},
    [
        {"/f0": [("edit", 1, 2, b"")], "/f1": []},
        {"/f0": [], "/f1": []},
        {"/f0": [("write", 0, 0, b"a"), ("write", 0, 0, b"aa")], "/f1": []},
    ],
)


@settings(max_examples=40, deadline=None)
@given(agents_case(3))
@example(COLLAPSED_INSERTS)
@example(COLLAPSED_DIFFERENT_INSERTS)
@example(UNCHANGED_REWRITE_BESIDE_AN_INSERT)
@example(UNCHANGED_REWRITE_OF_AN_IDENTICAL_INSERT)
@example(UNCHANGED_REWRITE_OVER_A_DELETE)
def test_three_agents_in_every_order(case: Case) -> None:
    for order in itertools.permutations(range(3)):
        run_in_order(case, order)


def test_inserts_on_both_sides_of_a_deleted_range_are_not_lost() -> None:
    """Bug: position mapping collapses two insertion points, and one insert is dropped.

    Base "abcdef".  Agent 1 deletes [2, 4) ("cd"); agent 2 inserts "Q" at 4;
    agent 3 inserts "Q" at 2.  No two edits overlap.  Submitted 1, 2, 3 every
    submission is accepted but the head is "abQef": agent 3's insert, mapped
    to 2 like agent 2's, is taken as "the same bytes accepted already".  In
    the orders starting with agent 2 or 3 the head is "abQQef".
    """
    base, plans = COLLAPSED_INSERTS
    heads = set()
    for order in itertools.permutations(range(3)):
        service = Service()
        green = service.green(base, rewrites="exact")
        works = [service.work(green) for _ in plans]
        for work, plan in zip(works, plans, strict=True):
            for op in plan["/f0"]:
                run_op(service, work, "/f0", op)
        results = [service.submit(works[agent])["ok"] for agent in order]
        assert results == [True, True, True], order
        heads.add(service.read(green, "/f0"))
    assert heads == {b"abQQef"}


def test_the_verdict_on_inserts_beside_a_deleted_range_does_not_depend_on_order() -> None:
    """Bug: the same three submissions conflict in some orders and merge in others.

    As above with different inserted bytes ("B" at 4, "C" at 2): submitted
    1, 2, 3 or 1, 3, 2 the last one conflicts ("overlap" at one point); in the
    other four orders all are accepted and the head is "abCBef".
    """
    base, plans = COLLAPSED_DIFFERENT_INSERTS
    verdicts = {}
    for order in itertools.permutations(range(3)):
        service = Service()
        green = service.green(base, rewrites="exact")
        works = [service.work(green) for _ in plans]
        for work, plan in zip(works, plans, strict=True):
            for op in plan["/f0"]:
                run_op(service, work, "/f0", op)
        oks = tuple(service.submit(works[agent])["ok"] for agent in order)
        verdicts[order] = (oks, service.read(green, "/f0"))
    assert set(verdicts.values()) == {((True, True, True), b"abCBef")}, verdicts


# -- a state machine over one green volume ---------------------------------------

NAMES = ["/a", "/b", "/c", "/d/a", "/d/b"]
KNOWN_KINDS = RANGE_KINDS | {
    "modify vs delete",
    "delete vs modify",
    "type replaced",
    "object replaced",
    "rename vs rename",
    "rename vs delete",
    "add vs add",
}


@dataclasses.dataclass
class WorkModel:
    base: int  # the green version it is based on
    files: dict[str, bytes]  # what it should read
    touched: set[int]  # objects of its base it changed (content, name, removal): a superset


@dataclasses.dataclass
class Expectation:
    """What a merge of work onto head (both from base) must hold, as far as it is determined."""

    needs: list[tuple[str, bytes, int | None]]  # path, bytes, and the object when it is old
    absent: set[int]  # objects of the base removed by exactly one side
    complete: bool  # disjoint changes: the merge must be accepted and hold nothing else

    def check(self, result: Files, note: str) -> None:
        at = {path: (ino, data) for ino, (path, data) in result.items()}
        for path, data, ino in self.needs:
            assert path in at, f"{path} missing: {note}"
            assert at[path][1] == data, f"{path} holds {at[path][1]!r}, not {data!r}: {note}"
            if ino is not None:
                assert at[path][0] == ino, f"{path} is not object {ino}: {note}"
        assert not self.absent & result.keys(), note
        if self.complete:
            assert set(at) == {path for path, _data, _ino in self.needs}, note


def introduced(before: Files, after: Files) -> set[str]:
    """Names `after` holds with a different object than `before` (or none there before)."""
    was = {path: ino for ino, (path, _data) in before.items()}
    return {path for ino, (path, _data) in after.items() if was.get(path) != ino}


def expect_merge(
    base: Files,
    head: Files,
    work: Files,
    w_touched: set[int],
    h_touched: set[int],
    h_names: set[str],
) -> Expectation:
    """The three-way expectation; `h_touched` and `h_names` cover every version since base.

    A name some version in between introduced is not checked for the work's
    new object there: an identical add is the same object (then later
    versions may have changed or removed it), a different one a conflict.
    """
    needs: list[tuple[str, bytes, int | None]] = []
    absent: set[int] = set()
    for ino, state in base.items():
        in_work, in_head = ino in w_touched, ino in h_touched
        if in_work and in_head:
            continue  # both sides changed it: a merge or a conflict, not checked here
        if in_work:
            now = work.get(ino)
        elif in_head:
            now = head.get(ino)
        else:  # nobody touched it: both sides still hold it as it was
            assert head.get(ino) == state and work.get(ino) == state, ino
            now = state
        if now is None:
            absent.add(ino)
        else:
            needs.append((now[0], now[1], ino))
    needs += [(path, data, None) for ino, (path, data) in head.items() if ino not in base]
    needs += [
        (path, data, None)
        for ino, (path, data) in work.items()
        if ino not in base and path not in h_names
    ]
    complete = not (w_touched & h_touched) and not (introduced(base, work) & h_names)
    return Expectation(needs, absent, complete)


contents = small_bytes(0, 8)


@settings(max_examples=60, stateful_step_count=30, deadline=None)
class GreenMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.service = Service()
        self.green = ""
        self.versions: list[Files] = []  # what each version holds, as read after it was made
        self.touched: list[set[int]] = []  # objects of older versions each version changed
        self.works: dict[str, WorkModel] = {}

    @initialize(files=st.dictionaries(st.sampled_from(NAMES), contents, max_size=4))
    def start(self, files: dict[str, bytes]) -> None:
        self.green = self.service.green(files, ["/d"], rewrites="exact")
        self.versions = [{}, self.service.files(self.green)]
        self.touched = [set(), set()]

    # -- helpers

    def head(self) -> int:
        return len(self.versions) - 1

    def pick(self, data: st.DataObject) -> tuple[str, WorkModel]:
        work = data.draw(st.sampled_from(sorted(self.works)), label="work")
        return work, self.works[work]

    def touch(self, work: str, model: WorkModel, path: str) -> None:
        ino = int(self.service.call("stat", volume=work, path=path)["ino"])
        if ino in self.versions[model.base]:
            model.touched.add(ino)

    def expectation(self, model: WorkModel, work: str) -> Expectation:
        base = self.versions[model.base]
        h_touched = set().union(*self.touched[model.base + 1 :])
        h_names = set().union(
            *(
                introduced(self.versions[v - 1], self.versions[v])
                for v in range(model.base + 1, len(self.versions))
            )
        )
        work_files = self.service.files(work)
        return expect_merge(base, self.versions[-1], work_files, model.touched, h_touched, h_names)

    # -- rules

    @precondition(lambda self: len(self.works) < 4)
    @rule(data=st.data())
    def new_work(self, data: st.DataObject) -> None:
        head = self.head()
        version = data.draw(st.one_of(st.just(head), st.integers(1, head)), label="version")
        work = self.service.work(self.green, version)
        files = dict(self.versions[version].values())
        self.works[work] = WorkModel(version, files, set())

    @precondition(lambda self: bool(self.works))
    @rule(data=st.data())
    def change(self, data: st.DataObject) -> None:
        work, model = self.pick(data)
        for _ in range(data.draw(st.integers(1, 3), label="changes")):
            self.change_one(data, work, model)

    def change_one(self, data: st.DataObject, work: str, model: WorkModel) -> None:
        existing = sorted(model.files)
        kinds = ["write", "write"] + (
            ["edit", "edit", "truncate", "unlink", "rename"] * bool(existing)
        )
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind == "write":
            path = data.draw(st.sampled_from(NAMES), label="path")
            old = model.files.get(path, b"")
            offset = data.draw(st.integers(0, len(old) + 2), label="offset")
            payload = data.draw(small_bytes(1, 4), label="data")
            if path in model.files:
                self.touch(work, model, path)
            self.service.call("write", volume=work, path=path, data=payload, offset=offset)
            grown = old + bytes(max(0, offset - len(old)))
            model.files[path] = grown[:offset] + payload + grown[offset + len(payload) :]
            return
        path = data.draw(st.sampled_from(existing), label="path")
        old = model.files[path]
        self.touch(work, model, path)
        if kind == "edit":
            start = data.draw(st.integers(0, len(old)), label="start")
            end = data.draw(st.integers(start, len(old)), label="end")
            payload = data.draw(small_bytes(0, 4), label="data")
            self.service.edit(work, path, start, end, payload)
            model.files[path] = old[:start] + payload + old[end:]
        elif kind == "truncate":
            size = data.draw(st.integers(0, len(old) + 2), label="size")
            self.service.call("truncate", volume=work, path=path, size=size)
            model.files[path] = old[:size] + bytes(max(0, size - len(old)))
        elif kind == "unlink":
            self.service.call("unlink", volume=work, path=path)
            del model.files[path]
        else:
            target = data.draw(st.sampled_from([n for n in NAMES if n != path]), label="to")
            if target in model.files:
                self.touch(work, model, target)
            self.service.call("rename", volume=work, src=path, dst=target)
            model.files[target] = model.files.pop(path)

    @precondition(lambda self: bool(self.works))
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        work, model = self.pick(data)
        head, head_files = self.head(), self.versions[-1]
        before = self.service.files(work)
        expect = self.expectation(model, work)
        result = self.service.submit(work)
        note = f"submit of {work} (base v{model.base}) onto v{head}: {result}"
        if not result["ok"]:
            assert not expect.complete, f"disjoint changes must be accepted: {note}"
            assert {c["kind"] for c in result["conflicts"]} <= KNOWN_KINDS, note
            assert self.service.head(self.green) == head, note
            assert self.service.files(self.green) == head_files, note
            assert self.service.files(work) == before, note
            return
        now = self.service.files(self.green)
        expect.check(now, note)
        if result["version"] == head:
            assert now == head_files, note
        else:
            assert result["version"] == head + 1 == self.service.head(self.green), note
            self.versions.append(now)
            self.touched.append(set(model.touched))
        if result.get("rebased"):  # the work moved onto the version it made
            assert result["version"] == head + 1, note
            assert self.service.files(work) == now, note
            model.base, model.files, model.touched = head + 1, dict(now.values()), set()
        else:
            assert self.service.files(work) == before, note

    @precondition(lambda self: bool(self.works))
    @rule(data=st.data())
    def rebase(self, data: st.DataObject) -> None:
        work, model = self.pick(data)
        head, head_files = self.head(), self.versions[-1]
        before = self.service.files(work)
        expect = self.expectation(model, work)
        result = self.service.rebase(work)
        note = f"rebase of {work} (base v{model.base}) onto v{head}: {result}"
        assert self.service.head(self.green) == head, note  # rebase publishes nothing
        assert self.service.files(self.green) == head_files, note
        if not result["ok"]:
            assert not expect.complete, f"disjoint changes must rebase: {note}"
            assert result["version"] == model.base, note
            assert self.service.files(work) == before, note
            return
        assert result["version"] == head, note
        now = self.service.files(work)
        expect.check(now, note)
        model.base = head
        model.files = dict(now.values())
        model.touched = {ino for ino in model.touched if ino in head_files}

    @invariant()
    def works_read_as_modelled(self) -> None:
        for work, model in self.works.items():
            tree = self.service.tree(work)
            files = {path: data for path, data in tree.items() if isinstance(data, bytes)}
            assert files == model.files, work
            assert self.service.base_of(work) == model.base, work

    @invariant()
    def the_head_is_the_last_version(self) -> None:
        if self.green:
            assert self.service.head(self.green) == self.head()
            assert self.service.files(self.green) == self.versions[-1]
            assert_green_reads_its_head(self.service.svc, self.green)

    def teardown(self) -> None:
        if self.green:
            assert_same_state(self.service.svc, self.service.replayed())
            assert_same_state(self.service.svc, self.service.restored())


TestGreenVolumeStateMachine = GreenMachine.TestCase
