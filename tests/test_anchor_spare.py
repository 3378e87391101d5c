"""The anchor's spare bridge (slates.node.mounts, issue 14 lever 5), as a user meets it.

Theory of operation: a real anchor keeps one spare bridge started; a mount
(through the CLI, as a user asks for one) is served by that spare, and the
anchor starts the next one.  The tests find the spare the way an operator
would, in /proc (a child of the anchor running `slates.fuse.bridge --spare`
for this runtime directory), and check what matters around it: two mounts
in a row are each served by the spare waiting before them; a spare killed
with SIGKILL before a mount, or while it holds its job unread, does not
fail the mount; a spare's own refusal is the mount's error; `gc` never reaps the
spare and the state file never lists it; stopping the anchor with a spare
alive leaves no bridge process and no mount behind.  The job line the anchor
writes is checked against the bridge's own parser, for every job.  A spare
starts deferred (SCHED_IDLE) where the anchor may raise it again: it is
raised when its deadline passes (`resume` is told the time, so no clock is
raced) or when it gets its job, and every thread of the bridge it becomes
serves at normal priority.  No timing is asserted.
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slates.fuse.bridge import MountJob, parse_mount_job
from slates.node.anchor import is_mounted
from slates.node.mounts import BridgeJob, _can_resume, give_job, let_go, resume, start_spare
from slates.sdk.client import Client
from tests.anchor_fixture import Service, service
from tests.test_bridge_unit import needs_fuse

__all__ = ["service"]  # the anchor fixture, shared

WAIT_SECONDS = 30.0

_texts = st.text(max_size=40)


@given(
    volume=_texts,
    mountpoint=_texts,
    counters=st.sampled_from(["c", "/run/slates/counters-v-1", "rel/c"]),
    writeback=st.booleans(),
    allow_other=st.booleans(),
    token=st.none() | _texts,
)
def test_the_anchors_job_is_the_bridges_job(
    volume: str,
    mountpoint: str,
    counters: str,
    writeback: bool,
    allow_other: bool,
    token: str | None,
) -> None:
    """A spare given the anchor's line serves the mount a fresh bridge would."""
    job = BridgeJob(volume, mountpoint, Path(counters), writeback, allow_other, token)
    line = job.line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert parse_mount_job(line[:-1]) == MountJob(
        volume,
        mountpoint,
        counters=counters,
        allow_other=allow_other,
        writeback=writeback,
        token=token,
    )
    # A fresh bridge gets the same mount from its argv, and the token never goes there.
    arguments = job.arguments()
    named, flags = arguments[:6], arguments[6:]
    assert named == ["--volume", volume, "--mountpoint", mountpoint, "--counters", counters]
    assert sorted(flags) == sorted(
        [
            *([] if writeback else ["--no-writeback-cache"]),
            *(["--allow-other"] if allow_other else []),
        ]
    )


# -- a real anchor ---------------------------------------------------------------------


def _wait_for(what: Callable[[], Any], message: str) -> Any:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError(message)


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _bridges(runtime: Path) -> list[int]:
    """Every live bridge process of this runtime directory (spare or serving)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        argv = _argv(int(entry.name))
        if b"slates.fuse.bridge" in argv and os.fsencode(str(runtime)) in argv:
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                found.append(int(entry.name))
    return found


def _spares(service: Service) -> list[int]:
    """The anchor's bridges started as spares that serve no mount yet (a spare given its
    job keeps its argv, so the state file's mounts tell the two apart)."""
    with Client(service.runtime) as client:
        serving = {int(m["pid"]) for m in client.mounts()}
    return [
        pid
        for pid in _bridges(service.runtime)
        if b"--spare" in _argv(pid) and _parent(pid) == service.process.pid and pid not in serving
    ]


def _the_spare(service: Service) -> int:
    spares: list[int] = _wait_for(lambda: _spares(service), "the anchor keeps no spare")
    assert len(spares) == 1, spares  # one, not one per mount or per loop
    return spares[0]


def _cli(*args: str | Path) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "slates_cli.main", *map(str, args), "--json"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (args, done.stderr.decode())
    return json.loads(done.stdout)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    root = tmp_path / "base"
    root.mkdir()
    (root / "hello.txt").write_text("from the base\n")
    return root


def _mount_new(service: Service, base: Path, tmp_path: Path, name: str) -> dict[str, Any]:
    """`slates volume create NAME --base B` then `slates mount ID DIR`, as a user would."""
    where = tmp_path / f"mnt-{name}"
    where.mkdir()
    runtime = ("--runtime-dir", service.runtime)
    created = _cli("volume", "create", name, "--base", base, *runtime)
    mounted: dict[str, Any] = _cli("mount", created["id"], where, *runtime)
    assert mounted["directory"] == str(where)
    assert (where / "hello.txt").read_text() == "from the base\n"
    (where / "made.txt").write_text(name)
    with Client(service.runtime) as client:
        assert client.read(created["id"], "/made.txt") == name.encode()
    return mounted


@needs_fuse
def test_two_mounts_in_a_row_are_each_served_by_a_spare(
    service: Service, base: Path, tmp_path: Path
) -> None:
    first_spare = _the_spare(service)
    first = _mount_new(service, base, tmp_path, "one")
    assert first["pid"] == first_spare
    second_spare = _the_spare(service)  # made again once the first was taken
    assert second_spare != first_spare
    second = _mount_new(service, base, tmp_path, "two")
    assert second["pid"] == second_spare
    with Client(service.runtime) as client:
        served = {m["directory"]: m["pid"] for m in client.mounts()}
    assert served == {first["directory"]: first_spare, second["directory"]: second_spare}
    assert _the_spare(service) not in served.values()  # and the state file has no spare


@needs_fuse
def test_a_mount_works_when_its_spare_was_killed(
    service: Service, base: Path, tmp_path: Path
) -> None:
    for round_ in range(3):  # killed, then the mount asked at once: either path serves it
        killed = _the_spare(service)
        os.kill(killed, signal.SIGKILL)
        mounted = _mount_new(service, base, tmp_path, f"after-kill-{round_}")
        assert mounted["pid"] != killed
    log = (service.runtime.parent / f"{service.runtime.name}.log").read_text()
    assert "the spare bridge" in log  # the anchor saw it die (not a silent swap)


@needs_fuse
def test_gc_never_reaps_the_spare(service: Service, base: Path, tmp_path: Path) -> None:
    spare = _the_spare(service)
    reaped = _cli("gc", "--runtime-dir", service.runtime)["reaped"]
    assert reaped == {"bridges": [], "mounts": []}
    assert _spares(service) == [spare]
    with Client(service.runtime) as client:
        assert client.mounts() == []  # a spare is no mount
    assert not list(service.runtime.glob("bridge-*"))  # nor has it a mount's files
    assert _mount_new(service, base, tmp_path, "after-gc")["pid"] == spare  # still usable


@needs_fuse
def test_stopping_the_anchor_leaves_no_spare_and_no_mount(
    service: Service, base: Path, tmp_path: Path
) -> None:
    mounted = _mount_new(service, base, tmp_path, "left")
    spare = _the_spare(service)
    service.stop()
    assert service.process.returncode == 0
    assert not is_mounted(mounted["directory"])
    _wait_for(lambda: not _bridges(service.runtime), "a bridge outlived its anchor")
    assert not Path(f"/proc/{spare}").exists() or _parent(spare) != service.process.pid
    assert not list(service.runtime.glob("bridge-*.log"))  # the spare said nothing, and went


@needs_fuse
def test_a_mount_the_spare_refuses_fails_with_its_error(
    service: Service, base: Path, tmp_path: Path
) -> None:
    """The spare's own error reaches the user as a fresh bridge's would, is not tried
    again on a fresh bridge, and leaves nothing behind; the next spare serves."""
    spare = _the_spare(service)
    where = tmp_path / "nowhere"
    where.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "slates_cli.main", "mount", "vol-0-999", where,
         "--runtime-dir", service.runtime],
        capture_output=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode != 0 and b"NotFound" in done.stderr, done.stderr
    assert not is_mounted(str(where))
    assert not list(service.runtime.glob("bridge-*")) and not list(
        service.runtime.glob("counters-vol-0-999-*")
    )
    log = (service.runtime.parent / f"{service.runtime.name}.log").read_text()
    assert "died with its job" not in log
    assert not Path(f"/proc/{spare}").exists() or spare not in _spares(service)
    assert _mount_new(service, base, tmp_path, "after-refusal")["pid"] != spare


def _pending_job_bytes(pid: int) -> int:
    """Bytes waiting in the spare's job pipe (its stdin, opened again through /proc)."""
    fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        pending = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, pending)
        return pending[0]
    finally:
        os.close(fd)


@needs_fuse
def test_a_spare_killed_holding_its_job_is_replaced_by_a_fresh_bridge(
    service: Service, base: Path, tmp_path: Path
) -> None:
    """The spare is stopped, handed a job it cannot read yet, then killed: the mount
    still serves, from a fresh bridge the anchor starts for it."""
    spare = _the_spare(service)
    runtime = ("--runtime-dir", service.runtime)
    created = _cli("volume", "create", "held", "--base", base, *runtime)
    where = tmp_path / "held"
    where.mkdir()
    os.kill(spare, signal.SIGSTOP)
    try:
        mounting = subprocess.Popen(
            [sys.executable, "-m", "slates_cli.main", "mount", created["id"], where, *runtime,
             "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        _wait_for(lambda: _pending_job_bytes(spare) > 0, "the anchor never gave the job")
    finally:
        os.kill(spare, signal.SIGKILL)
    out, err = mounting.communicate(timeout=60)
    assert mounting.returncode == 0, err.decode()
    mounted = json.loads(out)
    assert mounted["pid"] != spare
    assert (where / "hello.txt").read_text() == "from the base\n"
    log = (service.runtime.parent / f"{service.runtime.name}.log").read_text()
    assert f"the spare bridge (pid {spare}) died with its job" in log


needs_sys_nice = pytest.mark.skipif(
    not _can_resume(),
    reason="raising a thread out of SCHED_IDLE needs CAP_SYS_NICE; without it an anchor "
    "starts its spares at normal priority (nothing is deferred to test)",
)


def _policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of process `pid`."""
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@needs_sys_nice
def test_a_spare_yields_until_its_deadline(service: Service, tmp_path: Path) -> None:
    spare = start_spare(service.runtime, tmp_path / "spare.log")
    try:
        assert spare.deferred_until > 0.0
        assert _policies(spare.process.pid) == {os.SCHED_IDLE}
        early = resume(spare, now=spare.deferred_until - 0.001)
        assert early == spare and _policies(spare.process.pid) == {os.SCHED_IDLE}
        due = resume(spare, now=spare.deferred_until)
        assert due.deferred_until == 0.0 and _policies(spare.process.pid) == {os.SCHED_OTHER}
        assert resume(due) == due  # once raised, nothing more to do
    finally:
        let_go(spare)  # its exit code says only how far its start-up had come


@needs_fuse
@needs_sys_nice
def test_a_deferred_spare_given_its_job_serves_at_normal_priority(
    service: Service, base: Path, tmp_path: Path
) -> None:
    with Client(service.runtime) as client:
        volume = str(client.create_volume("deferred", base=str(base))["id"])
    where = tmp_path / "deferred"
    where.mkdir()
    spare = start_spare(service.runtime, tmp_path / "spare.log")
    assert _policies(spare.process.pid) == {os.SCHED_IDLE}
    job = BridgeJob(volume, str(where), counters=tmp_path / "counters")
    bridge = give_job(spare, job)  # well before its deadline
    assert bridge is not None
    try:
        readable, _, _ = select.select([bridge.ready], [], [], WAIT_SECONDS)
        assert readable and os.read(bridge.ready, 1) == b"1", bridge.log.read_text()
        assert (where / "hello.txt").read_text() == "from the base\n"
        assert _policies(bridge.process.pid) == {os.SCHED_OTHER}  # loop threads included
    finally:
        bridge.process.terminate()  # it unmounts on SIGTERM
        assert bridge.process.wait(timeout=WAIT_SECONDS) == 0
        os.close(bridge.ready)
    assert not is_mounted(str(where))


@needs_fuse
@needs_sys_nice
def test_the_anchor_raises_its_spare_and_serves_mounts_at_normal_priority(
    service: Service, base: Path, tmp_path: Path
) -> None:
    """Through the CLI: the spare the anchor keeps is raised once its deadline passes
    (no job came), and the bridges serving mounts run at normal priority."""
    first = _mount_new(service, base, tmp_path, "first")
    _wait_for(
        lambda: _policies(_the_spare(service)) == {os.SCHED_OTHER},
        "the anchor never raised its spare",
    )
    second = _mount_new(service, base, tmp_path, "second")
    for mounted in (first, second):
        assert _policies(mounted["pid"]) == {os.SCHED_OTHER}
