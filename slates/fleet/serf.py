"""Membership and failure detection through Debian's serf agent (SWIM with Lifeguard).

Theory of operation (DESIGN.md section 7, "Failover").  Each host runs one
serf agent; we write no SWIM of our own.  This module owns three things:

- `SerfAgent`: starts the agent as a child process from a JSON config file
  in its data directory (node name, bind and RPC addresses, tags such as
  the host's boot id, initial joins, timing profile, snapshot), waits
  until its RPC answers, and stops it by pid (`stop`: SIGTERM, which does
  not leave the cluster, so peers see a failure; `kill`: SIGKILL, a crash;
  `leave`: a graceful leave, after which the agent exits).
- `SerfClient`: the agent's RPC through the `serf` command
  (`members -format=json`, `join`, `leave`), each call with a timeout.
- `MembershipWatch`: a member-event source that polls the member list and
  reports transitions as typed `MemberEvent(kind, member)` with kind
  alive, failed or left (`member_transitions`, pure).

Why a poll and not `-event-handler`: a poll is level-triggered.  A fleet
link that starts or restarts reads the current verdicts on its first poll,
and nothing is lost while no reader runs; an event handler is
edge-triggered (one process per event, whose output needs a socket or a
file that must itself be read, bounded and secured) and its events are
gone if the reader was down.  The cost is one short `serf members`
process per poll interval; the latency it adds (the interval) is small
beside serf's own suspicion timeout (seconds).

Verdicts.  `member_transitions` compares the verdict last reported per
member (alive, failed or left; serf's transient "leaving" is never one)
with the current list, so each change of verdict is reported once, and a
member that vanished from the list (reaped, force-left) is reported left.
A member whose address or tags change while alive (a host restarted with
a new boot id before it was suspected) is reported alive again.

Timing.  serf exposes memberlist's timing only as a profile: "lan"
(probe every 1 s, probe timeout 500 ms, suspicion multiplier 4, gossip
every 200 ms) is the default and suits the namespace testbed even under
tc netem delays of ~100 ms; "local" (probe timeout 200 ms, suspicion
multiplier 3) detects sooner on a quiet loopback and is what the tests
use.  Lifeguard (local health awareness, dynamic suspicion timeouts,
buddy system) is built into serf 0.8's memberlist and always on.
`reconnect_interval` is lowered from serf's 30 s to 5 s so a healed
partition merges back quickly.

Invariant: a failed verdict is only reported.  Nothing here writes,
fences or takes over; the fleet link answers a failed owner by starting
an etcd-committed takeover (slates/fleet/etcd.py).  The serf RPC is
unauthenticated on its loopback address: bind it to 127.0.0.1 only.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final, Literal, cast

from slates.errors import CapacityExhausted, InvalidArgument, SlatesError, VerificationFailed

__all__ = [
    "EventKind",
    "Member",
    "MemberEvent",
    "MemberStatus",
    "MembershipWatch",
    "SerfAgent",
    "SerfClient",
    "member_transitions",
    "parse_members",
]

SERF_BINARY: Final = "/usr/bin/serf"
MAX_MEMBERS: Final = 4096
MAX_OUTPUT_BYTES: Final = 4 << 20

MemberStatus = Literal["alive", "leaving", "left", "failed"]
EventKind = Literal["alive", "failed", "left"]
_STATUSES: Final[frozenset[str]] = frozenset({"alive", "leaving", "left", "failed"})


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    name: str
    addr: str  # host:port of its gossip listener
    status: MemberStatus
    tags: tuple[tuple[str, str], ...]  # sorted by key

    def tag(self, key: str) -> str | None:
        return dict(self.tags).get(key)


@dataclasses.dataclass(frozen=True, slots=True)
class MemberEvent:
    kind: EventKind
    member: Member


# -- pure --------------------------------------------------------------------------------------


def parse_members(output: bytes, *, max_members: int = MAX_MEMBERS) -> list[Member]:
    """The members in `serf members -format=json` output."""
    try:
        document = json.loads(output)
        raw_members = document["members"]
        if not isinstance(raw_members, list):
            raise TypeError("members is a list")
        if len(raw_members) > max_members:
            raise CapacityExhausted(
                "more serf members than the bound", count=len(raw_members), bound=max_members
            )
        members = [_parse_member(raw) for raw in raw_members]
    except (ValueError, KeyError, TypeError) as exc:
        raise VerificationFailed("serf's member list does not parse", error=str(exc)) from exc
    return members


def _parse_member(raw: dict[str, object]) -> Member:
    name, addr, status, tags = raw["name"], raw["addr"], raw["status"], raw.get("tags") or {}
    if not isinstance(name, str) or not isinstance(addr, str) or not isinstance(tags, dict):
        raise TypeError("a member has a name, an address and tags")
    if status not in _STATUSES:
        raise ValueError(f"unknown serf member status {status!r}")
    pairs = tuple(sorted((str(k), str(v)) for k, v in tags.items()))
    return Member(name, addr, cast(MemberStatus, status), pairs)


def _transition(
    reported: Member | None, listed: Member | None
) -> tuple[EventKind | None, Member | None]:
    """One member's (event, new reported verdict) from its last reported verdict and its
    current listing (None: not reported yet / not listed)."""
    match (reported, listed):
        case (_, Member(status="leaving")):
            return None, reported  # a graceful leave in progress: "left" follows
        case (Member(status="left"), None):
            return None, reported  # reaped after its leave was reported
        case (Member(status="alive" | "failed") as gone, None):
            # Removed from the list (reaped or force-left) without a reported leave.
            return "left", dataclasses.replace(gone, status="left")
        case (Member(status="alive") as old, Member(status="alive") as new):
            # Same description: nothing.  New address or tags: a restarted host, announce it.
            anew = (old.addr, old.tags) != (new.addr, new.tags)
            return ("alive" if anew else None), new
        case (Member(status="failed"), Member(status="failed") as new) | (
            Member(status="left"),
            Member(status="left") as new,
        ):
            return None, new
        case (None | Member(status="failed" | "left"), Member(status="alive") as new):
            return "alive", new
        case (None | Member(status="alive" | "left"), Member(status="failed") as new):
            return "failed", new
        case (None | Member(status="alive" | "failed"), Member(status="left") as new):
            return "left", new
        case _:
            raise InvalidArgument(
                "no member transition",
                reported=None if reported is None else reported.status,
                listed=None if listed is None else listed.status,
            )


def member_transitions(
    reported: Mapping[str, Member],
    current: Iterable[Member],
    *,
    max_reported: int = 2 * MAX_MEMBERS,
) -> tuple[dict[str, Member], list[MemberEvent]]:
    """Events that bring a consumer from the verdicts `reported` so far to the current
    member list; returns (the new reported verdicts, the events).

    `reported` keeps the members reported left after serf forgets them, so a
    name that comes back leaving and is reaped again is not reported left
    twice.  Past `max_reported` entries those tombstones are dropped (the
    cost: one repeated "left" for such a name).
    """
    listed: dict[str, Member] = {}
    for member in current:
        if member.name in listed:
            raise VerificationFailed("serf listed a member twice", name=member.name)
        listed[member.name] = member
    verdicts: dict[str, Member] = {}
    events: list[MemberEvent] = []
    for name in sorted(reported.keys() | listed.keys()):
        kind, verdict = _transition(reported.get(name), listed.get(name))
        if verdict is not None:
            verdicts[name] = verdict
        if kind is not None and verdict is not None:
            events.append(MemberEvent(kind, verdict))
    if len(verdicts) > max_reported:
        verdicts = {n: m for n, m in verdicts.items() if n in listed or m.status != "left"}
    return verdicts, events


# -- I/O ---------------------------------------------------------------------------------------


class SerfClient:
    """One agent's RPC, through the `serf` command with a timeout per call."""

    def __init__(self, rpc_addr: str, *, binary: str = SERF_BINARY, timeout: float = 5.0) -> None:
        if timeout <= 0:
            raise InvalidArgument("the serf RPC timeout is positive", timeout=timeout)
        self.rpc_addr = rpc_addr
        self.binary = binary
        self.timeout = timeout

    def _run(self, command: str, *args: str) -> bytes:
        argv = [self.binary, command, f"-rpc-addr={self.rpc_addr}", *args]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=self.timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise SlatesError(
                "the serf agent did not answer", command=command, rpc_addr=self.rpc_addr
            ) from exc
        if done.returncode != 0:
            raise SlatesError(
                "the serf agent refused a command",
                command=command,
                rpc_addr=self.rpc_addr,
                output=(done.stdout + done.stderr).decode(errors="replace")[-2000:],
            )
        if len(done.stdout) > MAX_OUTPUT_BYTES:
            raise CapacityExhausted("serf's answer is larger than the bound", command=command)
        return done.stdout

    def members(self) -> list[Member]:
        return parse_members(self._run("members", "-format=json"))

    def join(self, addrs: Sequence[str]) -> None:
        if not addrs:
            raise InvalidArgument("join needs at least one address")
        self._run("join", *addrs)

    def leave(self) -> None:
        """Leave the cluster gracefully; the agent then shuts down."""
        self._run("leave")


class MembershipWatch:
    """A member-event source: each `poll` reports the transitions since the last one."""

    def __init__(self, client: SerfClient) -> None:
        self.client = client
        self._known: dict[str, Member] = {}

    @property
    def known(self) -> Mapping[str, Member]:
        """The verdict last reported per member (alive, failed or left)."""
        return self._known

    def poll(self) -> list[MemberEvent]:
        self._known, events = member_transitions(self._known, self.client.members())
        return events


class SerfAgent:
    """A serf agent child process, stopped by its pid."""

    def __init__(
        self, process: subprocess.Popen[bytes], node_name: str, data_dir: Path, client: SerfClient
    ) -> None:
        self.process = process
        self.node_name = node_name
        self.data_dir = data_dir
        self.client = client

    @classmethod
    def start(
        cls,
        node_name: str,
        bind: str,
        rpc_addr: str,
        tags: Mapping[str, str],
        join: Sequence[str] = (),
        *,
        data_dir: Path,
        profile: Literal["lan", "local", "wan"] = "lan",
        reconnect_interval: str = "5s",
        binary: str = SERF_BINARY,
        start_timeout: float = 10.0,
    ) -> SerfAgent:
        """Write `data_dir/serf.json`, start the agent, return once its RPC answers.

        The agent logs to `data_dir/serf.log` and keeps its snapshot (known
        members, for a rejoin after a restart) in `data_dir/serf.snapshot`.
        A failed initial join makes the agent exit: that raises SlatesError.
        """
        if not node_name:
            raise InvalidArgument("a serf node needs a name")
        data_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "node_name": node_name,
            "bind": bind,
            "rpc_addr": rpc_addr,
            "tags": dict(tags),
            "start_join": list(join),
            "profile": profile,
            "reconnect_interval": reconnect_interval,
            "snapshot_path": str(data_dir / "serf.snapshot"),
            "log_level": "info",
        }
        config_file = data_dir / "serf.json"
        config_file.write_text(json.dumps(config))
        log_path = data_dir / "serf.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [binary, "agent", f"-config-file={config_file}"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        agent = cls(process, node_name, data_dir, SerfClient(rpc_addr, binary=binary))
        agent._wait_serving(start_timeout, log_path)
        return agent

    def _wait_serving(self, timeout: float, log_path: Path) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise SlatesError(
                    "the serf agent exited while starting",
                    node=self.node_name,
                    returncode=self.process.returncode,
                    log=log_path.read_text(errors="replace")[-2000:],
                )
            try:
                if any(m.name == self.node_name for m in self.client.members()):
                    return
            except SlatesError:
                pass  # the RPC listener is not up yet
            if time.monotonic() > deadline:
                self.kill()
                raise SlatesError("the serf agent did not start in time", node=self.node_name)
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.process.pid

    def members(self) -> list[Member]:
        return self.client.members()

    def join(self, addrs: Sequence[str]) -> None:
        self.client.join(addrs)

    def leave(self, timeout: float = 10.0) -> None:
        """Leave gracefully (peers see "left") and wait for the agent to exit."""
        self.client.leave()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (serf does not leave on it: peers see a failure), SIGKILL after `timeout`."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
