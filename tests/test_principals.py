"""Principals (issue 12): agents cannot act for each other or beyond their rights.

The rule itself (slates.node.principals.authorize) is checked as a table;
then a real anchor: the operator makes a green volume, two agents get
credentials with `slates agent add`, and each agent's SDK client and MCP
session are refused every attempt on the other's work volume, on the green
volume's administration and on bases of its choosing, while its own work
goes on.  A client id first used by one principal gives nothing to another
(saved replies stay with their principal).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slates import Client
from slates.errors import AccessDenied, AlreadyExists, InvalidArgument, NotFound
from slates.mcp.server import SlatesTools
from slates.node.principals import OPERATOR, Agents, Principal, authorize
from tests.anchor_fixture import Service, service

__all__ = ["service"]

SLATES = str(Path(sys.executable).with_name("slates"))
ALICE, BOB = Principal("alice"), Principal("bob")
OWNERS = {"vol-0-5": "alice", "vol-0-6": "bob", "vol-0-1": ""}
GREENS = {"vol-0-1"}


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("write", {"volume": "vol-0-5", "path": "/f"}),
        ("submit", {"volume": "vol-0-5"}),
        ("volume.delete", {"volume": "vol-0-5"}),
        ("read", {"volume": "vol-0-1", "path": "/f"}),
        ("versions", {"green": "vol-0-1"}),
        ("work.create", {"green": "vol-0-1", "name": "w"}),
        ("land.plan", {"volume": "vol-0-1", "target": "/t"}),
        ("volume.create", {"name": "scratch"}),
        ("volume.list", {}),
        ("land.show", {"manifest": "man-0-x"}),
    ],
)
def test_what_an_agent_may_do(op: str, args: dict[str, object]) -> None:
    authorize(ALICE, op, args, OWNERS, GREENS)
    authorize(OPERATOR, op, args, OWNERS, GREENS)


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("write", {"volume": "vol-0-6", "path": "/f"}),  # bob's
        ("read", {"volume": "vol-0-6", "path": "/f"}),
        ("submit", {"volume": "vol-0-6"}),
        ("volume.delete", {"volume": "vol-0-6"}),
        ("volume.delete", {"volume": "vol-0-1"}),  # a green
        ("write", {"volume": "vol-0-1", "path": "/f"}),
        ("green.create", {"name": "g"}),
        ("volume.create", {"name": "x", "base": "/etc"}),
        ("volume.create", {"name": "x", "from": "snap-0-3"}),
        ("clone", {"snapshot": "snap-0-3", "name": "x"}),
        ("land.grant", {"manifest": "man-0-x"}),
        ("land.apply", {"manifest": "man-0-x", "grant": "g"}),
        ("fs.write", {"volume": "vol-0-1", "ino": 2}),
        ("unknown.op", {}),
    ],
)
def test_what_an_agent_may_not_do(op: str, args: dict[str, object]) -> None:
    with pytest.raises(AccessDenied):
        authorize(ALICE, op, args, OWNERS, GREENS)
    authorize(OPERATOR, op, args, OWNERS, GREENS)  # the operator may


def test_agent_credentials_are_kept_hashed(tmp_path: Path) -> None:
    agents = Agents(tmp_path)
    token = agents.add("alice")
    assert agents.authenticate(token) == ALICE
    assert token not in (tmp_path / "agents.json").read_text()
    assert (tmp_path / "agents.json").stat().st_mode & 0o777 == 0o600
    with pytest.raises(AlreadyExists):
        agents.add("alice")
    with pytest.raises(InvalidArgument):
        agents.add("../x")
    with pytest.raises(AccessDenied):
        agents.authenticate(token + "x")
    agents.remove("alice")
    with pytest.raises(AccessDenied):
        Agents(tmp_path).authenticate(token)
    with pytest.raises(NotFound):
        agents.remove("alice")


def add_agent(service: Service, name: str) -> str:
    done = subprocess.run(
        [SLATES, "agent", "add", name, "--runtime-dir", str(service.runtime)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_agents_cannot_act_for_each_other_through_the_sdk_or_mcp(
    service: Service, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "image.conf").write_bytes(b"quality=80\n")
    alice, bob = add_agent(service, "alice"), add_agent(service, "bob")
    listed = subprocess.run(
        [SLATES, "agent", "list", "--runtime-dir", str(service.runtime)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert listed.stdout.split() == ["alice", "bob"]
    with (
        Client(service.runtime) as operator,
        Client(service.runtime, token=alice) as as_alice,
        Client(service.runtime, token=bob) as as_bob,
    ):
        green = operator.create_green("main", base=project)
        mine = as_alice.create_work(green, "alice-work")
        as_alice.edit(mine["id"], "/image.conf", 8, 10, b"90")
        # Bob can neither read, write, submit nor delete Alice's work, nor the green.
        for attempt in (
            lambda: as_bob.read(mine["id"], "/image.conf"),
            lambda: as_bob.write(mine["id"], "/image.conf", b"60"),
            lambda: as_bob.submit(mine["id"]),
            lambda: as_bob.delete_volume(mine["id"]),
            lambda: as_bob.delete_volume(green),
            lambda: as_bob.create_green("mine"),
            lambda: as_bob.create_volume("etc", base="/etc"),
        ):
            with pytest.raises(AccessDenied):
                attempt()
        with pytest.raises(NotFound):
            as_bob.resolve("alice-work")  # not even listed
        assert {v["id"] for v in as_bob.list_volumes()} == {green}
        # Alice's work goes on: it submits, and Bob reads the green it changed.
        assert as_alice.submit(mine["id"])["ok"]
        assert as_bob.read(green, "/image.conf") == b"quality=90\n"
        assert operator.read(mine["id"], "/image.conf") == b"quality=90\n"  # the operator may

    # An MCP session started with Bob's token is Bob.
    tools = SlatesTools(service.runtime, token=bob)
    try:
        refused = tools.client
        with pytest.raises((AccessDenied, NotFound)):
            tools.write_file(mine["id"], "/image.conf", "60")
        with pytest.raises(AccessDenied):
            refused.submit(mine["id"])
        tools.create_work("main", "bob-work")
        assert [v["name"] for v in refused.list_volumes()] == ["main", "bob-work"]
    finally:
        tools.close()


def test_a_bad_token_is_refused_and_a_client_id_stays_with_its_principal(
    service: Service,
) -> None:
    add_agent(service, "alice")
    with pytest.raises(AccessDenied), Client(service.runtime, token="slates-nobody-x") as c:
        c.list_volumes()
    bob = add_agent(service, "bob")
    with Client(service.runtime, client_id="shared-id") as operator:
        operator.create_volume("ops")  # saved replies under this id, until its bye
        with (
            pytest.raises(AccessDenied),
            Client(service.runtime, client_id="shared-id", token=bob) as impostor,
        ):
            impostor.create_volume("ops")  # the shard that saved the operator's reply
        assert [v["name"] for v in operator.list_volumes()] == ["ops"]


def test_an_agent_names_bases_and_targets_only_under_allowed_roots() -> None:
    def allowed(path: object) -> bool:
        return isinstance(path, str) and path.startswith("/srv/projects/")

    create = {"name": "x", "base": "/srv/projects/app"}
    authorize(ALICE, "volume.create", create, OWNERS, GREENS, allowed)
    with pytest.raises(AccessDenied):
        authorize(ALICE, "volume.create", {"name": "x", "base": "/etc"}, OWNERS, GREENS, allowed)
    plan = {"volume": "vol-0-5", "target": "/srv/projects/app"}
    authorize(ALICE, "land.plan", plan, OWNERS, GREENS, allowed)
    with pytest.raises(AccessDenied):
        authorize(ALICE, "land.plan", {**plan, "target": "/home"}, OWNERS, GREENS, allowed)
    # A green lands only into the directory it captured, which the operator chose.
    authorize(ALICE, "land.plan", {"volume": "vol-0-1", "target": "/x"}, OWNERS, GREENS, allowed)
