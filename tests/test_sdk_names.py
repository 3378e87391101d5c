"""The shared volume-reference rule (slates.sdk.names) and AsyncClient.resolve.

Theory of operation: `pick_volume` is pure, so hypothesis draws listings of
volumes (names from a tiny alphabet so that names collide, every role) and
checks the rule against a model written from the spec: an id is taken as is;
a name resolves when exactly one volume (of the role) bears it, is NotFound
when none does and InvalidArgument when several do, and each error names
its candidates.  A few examples pin the messages a person reads.  The
client's `resolve` is checked for its one piece of wiring: an id asks the
service nothing, a name lists the volumes once.  Beside it, two checks of
the client's surface: optional flags (submit's dry_run, rewitness's merge)
are sent only when set, and the blocking Client wraps every AsyncClient
method with its types.

The client's path resolution (no pathlib) is checked against `Path.resolve` on real
files, symlinks and a symlink loop.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from slates.errors import InvalidArgument, NotFound, VerificationFailed
from slates.sdk import AsyncClient, Client
from slates.sdk.client import _Blocking, _resolved
from slates.sdk.names import MAX_CANDIDATES, Role, is_volume_id, pick_volume

ROLE_LIST: list[Role] = ["green", "work", "volume"]
names = st.sampled_from(["main", "agent", "x", "vol-0", "vol-0-1a"])
roles = st.sampled_from(ROLE_LIST)
asked_roles = st.none() | roles
ids = st.builds(lambda shard, n: f"vol-{shard}-{n}", st.integers(0, 99), st.integers(0, 10**6))


@st.composite
def listings(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Volumes with distinct ids and colliding names, of every role."""
    count = draw(st.integers(0, 8))
    numbers = draw(st.lists(st.integers(0, 10**6), min_size=count, max_size=count, unique=True))
    return [{"id": f"vol-{n % 3}-{n}", "name": draw(names), "role": draw(roles)} for n in numbers]


@given(ids, listings(), asked_roles)
def test_an_id_is_taken_as_is(ref: str, volumes: list[dict[str, Any]], role: Role | None) -> None:
    assert is_volume_id(ref)
    assert pick_volume(ref, volumes, role) == ref


@given(names, listings(), asked_roles)
def test_a_name_names_exactly_one_volume(
    ref: str, volumes: list[dict[str, Any]], role: Role | None
) -> None:
    assert not is_volume_id(ref)
    bearers = [v["id"] for v in volumes if v["name"] == ref]
    of_role = [v["id"] for v in volumes if v["name"] == ref and role in (None, v["role"])]
    if len(of_role) == 1:
        assert pick_volume(ref, volumes, role) == of_role[0]
        return
    with pytest.raises(InvalidArgument) as raised:
        pick_volume(ref, volumes, role)
    error = raised.value
    if of_role:  # several: ambiguous, and every candidate id is named
        assert type(error) is InvalidArgument
        assert error.details["ids"] == sorted(of_role)
        assert all(vid in error.message for vid in of_role)
        assert "use an id" in error.message
    else:
        assert isinstance(error, NotFound)
        if bearers:  # the name exists, for volumes of another role: say which
            assert error.details["candidates"] == bearers[:MAX_CANDIDATES]
            assert all(vid in error.message for vid in bearers)
        else:  # the names that do exist (of the role) are offered instead
            offered = sorted({v["name"] for v in volumes if role in (None, v["role"])})
            assert error.details["names"] == offered


def test_the_messages_a_person_reads() -> None:
    volumes = [
        {"id": "vol-0-1", "name": "main", "role": "green"},
        {"id": "vol-1-2", "name": "main", "role": "work"},
        {"id": "vol-1-3", "name": "agent", "role": "work"},
    ]
    assert pick_volume("main", volumes, "green") == "vol-0-1"
    assert pick_volume("main", volumes, "work") == "vol-1-2"
    assert pick_volume("agent", volumes) == "vol-1-3"
    with pytest.raises(InvalidArgument, match=r"2 volumes are named 'main' \(vol-0-1, vol-1-2\)"):
        pick_volume("main", volumes)
    with pytest.raises(
        NotFound, match=r"no green volume is named 'agent'; it names vol-1-3 \(work\)"
    ):
        pick_volume("agent", volumes, "green")
    with pytest.raises(
        NotFound,
        match=r"no volume has the id or name 'nosuch'; the volumes here are named agent, main",
    ):
        pick_volume("nosuch", volumes)
    with pytest.raises(NotFound, match=r"^no volume has the id or name 'nosuch'$"):
        pick_volume("nosuch", [])


def test_candidates_are_bounded() -> None:
    many = [{"id": f"vol-0-{n}", "name": "same", "role": "work"} for n in range(3 * MAX_CANDIDATES)]
    with pytest.raises(InvalidArgument) as raised:
        pick_volume("same", many)
    assert len(raised.value.details["ids"]) == MAX_CANDIDATES
    assert f"and {2 * MAX_CANDIDATES} more" in raised.value.message


@pytest.mark.parametrize(
    ("ref", "role"), [("", None), (None, None), (7, None), ("main", "red"), ("vol-0-1", "Green")]
)
def test_bad_references_and_roles_are_refused(ref: Any, role: Any) -> None:
    with pytest.raises(InvalidArgument) as raised:
        pick_volume(ref, [], role)
    assert type(raised.value) is InvalidArgument  # refused as malformed, not "not found"


def test_the_client_lists_volumes_only_for_names(tmp_path: Path) -> None:
    listed: list[int] = []
    volumes = [{"id": "vol-1-4", "name": "main", "role": "green"}]

    class Listing(AsyncClient):
        async def list_volumes(self) -> list[dict[str, Any]]:
            listed.append(1)
            return volumes

    async def main() -> tuple[str, str]:
        client = Listing(tmp_path)  # never opened: resolving needs only the listing
        by_id = await client.resolve("vol-0-9", "work")
        assert listed == []
        by_name = await client.resolve("main", "green")
        return by_id, by_name

    assert trio.run(main) == ("vol-0-9", "vol-1-4")
    assert listed == [1]


def test_optional_flags_travel_only_when_set(tmp_path: Path) -> None:
    """submit's dry_run and rewitness's merge reach the service only when true, so an
    ordinary call sends what it always sent; a dry run the reply does not confirm is
    VerificationFailed (an older service would have submitted for real)."""
    sent: list[tuple[str, dict[str, Any]]] = []

    class Recording(AsyncClient):
        async def _barrier(self, volume: str) -> None:
            pass

        async def _on(self, object_id: str, op: str, **args: Any) -> Any:
            sent.append((op, args))
            return {"ok": True, "dry_run": bool(args.get("dry_run"))}

    async def main() -> None:
        client = Recording(tmp_path)
        await client.submit("vol-0-1")
        await client.submit("vol-0-1", dry_run=True)
        await client.rewitness("man-0-x")
        await client.rewitness("man-0-x", ["a"], merge=True)

    trio.run(main)
    assert sent == [
        ("submit", {"volume": "vol-0-1"}),
        ("submit", {"volume": "vol-0-1", "dry_run": True}),
        ("land.rewitness", {"manifest": "man-0-x"}),
        ("land.rewitness", {"manifest": "man-0-x", "paths": ["a"], "merge": True}),
    ]

    class Unaware(Recording):
        async def _on(self, object_id: str, op: str, **args: Any) -> Any:
            return {"ok": True, "version": 4}

    with pytest.raises(VerificationFailed):
        trio.run(lambda: Unaware(tmp_path).submit("vol-0-1", dry_run=True))


def test_the_blocking_client_wraps_every_async_method() -> None:
    """Each public AsyncClient coroutine has a typed Client method of the same name."""
    public = {
        name
        for name, member in inspect.getmembers(AsyncClient, inspect.iscoroutinefunction)
        if not name.startswith("_")
    }
    wrapped = {name for name in vars(Client) if isinstance(vars(Client)[name], _Blocking)}
    assert wrapped == public - {"aclose"}  # Client.close closes it


def test_the_client_resolves_paths_as_pathlib_does(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    monkeypatch.chdir(tmp_path)
    for path in ["dir", "link", "link/", "./link/../dir", "missing/x", "", str(tmp_path), "//tmp"]:
        assert _resolved(path) == str(Path(path).resolve()), path
    assert _resolved(tmp_path / "link") == str(tmp_path / "dir")
    with pytest.raises(RuntimeError) as ours:
        _resolved("loop")
    with pytest.raises(RuntimeError) as theirs:
        Path("loop").resolve()
    assert str(ours.value) == str(theirs.value)
