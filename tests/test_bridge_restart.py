"""A mount's bridge killed with SIGKILL is restarted by the anchor (README: "bridges
restarted"), as a user meets it.

Theory of operation: a real anchor (tests.anchor_fixture), a volume over a small
base, a mount written through, and then its bridge killed the way an operator or
the OOM killer would (SIGKILL, pid from the anchor's state file).  The tests
check what a user relies on: the same directory serves the same volume again
with everything written before the kill (tests.test_mount.wait_for_restart
also checks that the mount stays listed, "restarting", until then); a second
kill is survived like the first; a spare killed at the same moment, or killed
holding the restart's job, does not fail the restart; a program whose working
directory was inside the dead mount gets ENOTCONN there (the kernel aborted
that FUSE connection with its bridge) while paths through the directory work;
a bridge that keeps dying is given up on, the log says why, and nothing is left
mounted; an anchor stopped during a restart says so; two bridges killed at
once are each restarted once; and `unmount` after a restart leaves nothing
mounted.  Two primitives of slates.node.mounts for a bridge that cannot finish
dying (a thread of it waiting on its own mount) are checked on their own:
exited_unreaped on a process whose main thread ended, and abort_mount on a
mount whose bridge answers nothing.  No timing is asserted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slates import Client
from slates.node.anchor import MAX_BRIDGE_RESTARTS, is_mounted
from slates.node.mounts import abort_mount, exited_unreaped
from tests.anchor_fixture import Service, service
from tests.test_anchor_spare import _bridges, _pending_job_bytes, _spares, _the_spare, _wait_for
from tests.test_bridge_unit import needs_fuse
from tests.test_mount import wait_for_restart

__all__ = ["service"]  # the anchor fixture, shared

pytestmark = needs_fuse


@pytest.fixture
def base(tmp_path: Path) -> Path:
    root = tmp_path / "base"
    (root / "src").mkdir(parents=True)
    (root / "src" / "main.c").write_text("int main(void) { return 0; }\n")
    (root / "README").write_text("from the base\n")
    return root


def _mount(client: Client, base: Path, where: Path, name: str) -> tuple[str, int]:
    """A volume over `base` mounted at `where`, with a file written in the mount: the
    volume's id and the bridge's pid."""
    volume = client.create_volume(name, base=base)
    where.mkdir()
    info = client.mount(volume["id"], where)
    (where / "written.txt").write_bytes(b"before the kill\n")
    return volume["id"], int(info["pid"])


def _anchor_log(service: Service) -> str:
    return (service.runtime.parent / f"{service.runtime.name}.log").read_text()


def _serves(where: Path, files: dict[str, bytes]) -> None:
    assert (where / "README").read_text() == "from the base\n"  # the base, through the mount
    assert (where / "src" / "main.c").read_text() == "int main(void) { return 0; }\n"
    for name, content in files.items():
        assert (where / name).read_bytes() == content, name


def _unmount_leaves_nothing(client: Client, where: Path) -> None:
    client.unmount(where)
    assert not is_mounted(str(where))
    assert client.mounts() == []
    assert os.listdir(where) == []  # the directory itself was never written


def test_a_bridge_killed_twice_is_restarted_each_time(
    service: Service, base: Path, tmp_path: Path
) -> None:
    where = tmp_path / "mnt"
    with Client(service.runtime) as client:
        volume, pid = _mount(client, base, where, "twice")
        os.kill(pid, signal.SIGKILL)
        second = wait_for_restart(client, where, pid)
        _serves(where, {"written.txt": b"before the kill\n"})
        (where / "between.txt").write_bytes(b"written to the restarted bridge\n")
        os.kill(second, signal.SIGKILL)
        third = wait_for_restart(client, where, second)
        assert third not in (pid, second)
        _serves(
            where,
            {
                "written.txt": b"before the kill\n",
                "between.txt": b"written to the restarted bridge\n",
            },
        )
        assert [m["volume"] for m in client.mounts()] == [volume]  # the same volume
        _unmount_leaves_nothing(client, where)
    log = _anchor_log(service)
    assert log.count(f"restarted the bridge for {where}") == 2


def test_two_bridges_killed_at_once_are_each_restarted_once(
    service: Service, base: Path, tmp_path: Path
) -> None:
    """Two mounts' bridges killed together: the second is found dead while the first's
    restart waits, and is restarted after it (once: no bridge is left serving nothing)."""
    with Client(service.runtime) as client:
        first, second = tmp_path / "one", tmp_path / "two"
        _one, first_pid = _mount(client, base, first, "one")
        _two, second_pid = _mount(client, base, second, "two")
        os.kill(first_pid, signal.SIGKILL)
        os.kill(second_pid, signal.SIGKILL)
        serving = {
            wait_for_restart(client, first, first_pid),
            wait_for_restart(client, second, second_pid),
        }
        for where in (first, second):
            _serves(where, {"written.txt": b"before the kill\n"})
        assert {int(m["pid"]) for m in client.mounts()} == serving
        spares = set(_spares(service))
        assert set(_bridges(service.runtime)) == serving | spares, "a bridge serves nothing"
        client.unmount(second)
        assert not is_mounted(str(second))
        _unmount_leaves_nothing(client, first)
    log = _anchor_log(service)
    assert log.count(f"restarted the bridge for {first}") == 1
    assert log.count(f"restarted the bridge for {second}") == 1


def test_a_bridge_killed_with_the_spare_is_restarted(
    service: Service, base: Path, tmp_path: Path
) -> None:
    """The spare and the mount's bridge killed at once: whichever the anchor sees first,
    the restart is served (by the next spare, or by a fresh bridge)."""
    where = tmp_path / "mnt"
    with Client(service.runtime) as client:
        _volume, pid = _mount(client, base, where, "both")
        spare = _the_spare(service)
        os.kill(spare, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        restarted = wait_for_restart(client, where, pid)
        assert restarted != spare
        _serves(where, {"written.txt": b"before the kill\n"})
        _unmount_leaves_nothing(client, where)


def test_a_spare_killed_holding_the_restart_job_is_replaced(
    service: Service, base: Path, tmp_path: Path
) -> None:
    """The restart's job is handed to the spare (stopped, so it cannot read it), which is
    then killed: a fresh bridge serves the restart, and the mount stays listed as
    restarting, with the dead bridge's pid, while the spare holds the job."""
    where = tmp_path / "mnt"
    with Client(service.runtime) as client:
        _volume, pid = _mount(client, base, where, "held")
        spare = _the_spare(service)
        os.kill(spare, signal.SIGSTOP)
        try:
            os.kill(pid, signal.SIGKILL)
            _wait_for(lambda: _pending_job_bytes(spare) > 0, "the restart never used the spare")
            _wait_for(
                lambda: [(m["pid"], m["health"]) for m in client.mounts()] == [(pid, "restarting")],
                "the restarting mount is not listed (dead pid, restarting)",
            )
        finally:
            os.kill(spare, signal.SIGKILL)
        restarted = wait_for_restart(client, where, pid)
        assert restarted not in (pid, spare)
        _serves(where, {"written.txt": b"before the kill\n"})
        _unmount_leaves_nothing(client, where)
    assert f"the spare bridge (pid {spare}) died with its job" in _anchor_log(service)


def test_stopping_the_anchor_during_a_restart_says_so_and_leaves_nothing(
    service: Service, base: Path, tmp_path: Path
) -> None:
    """The anchor stopped while a restart waits for its bridge (the spare holding the
    job, stopped): the log says the restart ended because the anchor stops, not that
    the bridge failed, and no mount or bridge is left."""
    where = tmp_path / "mnt"
    with Client(service.runtime) as client:
        _volume, pid = _mount(client, base, where, "stopped")
        spare = _the_spare(service)
        os.kill(spare, signal.SIGSTOP)
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: _pending_job_bytes(spare) > 0, "the restart never used the spare")
    service.stop()
    assert service.process.returncode == 0
    assert not is_mounted(str(where))
    _wait_for(lambda: not _bridges(service.runtime), "a bridge outlived its anchor")
    log = _anchor_log(service)
    assert f"at {where}: it could not be mounted again: the mount bridge was stopped" in log
    assert "the anchor is stopping" in log
    assert "failed to start" not in log


_INSIDE = textwrap.dedent(
    """
    import errno, json, os, sys
    print("inside", flush=True)
    sys.stdin.readline()  # the test says when: after the restart
    found = {}
    for name, call in (("listdir", lambda: os.listdir(".")),
                       ("create", lambda: open("made-inside", "w").close())):
        try:
            call()
            found[name] = "ok"
        except OSError as exc:
            found[name] = errno.errorcode.get(exc.errno, str(exc.errno))
    print(json.dumps(found))
    """
)


def test_a_program_inside_the_dead_mount_gets_enotconn_and_paths_work(
    service: Service, base: Path, tmp_path: Path
) -> None:
    """A program whose working directory was the mount point stays in the dead FUSE
    connection (the kernel aborted it): ENOTCONN there, while the same paths through the
    directory serve the restarted mount.  What it created before the kill is kept."""
    where = tmp_path / "mnt"
    with Client(service.runtime) as client:
        _volume, pid = _mount(client, base, where, "inside")
        inside = subprocess.Popen(
            [sys.executable, "-P", "-c", _INSIDE],  # -P: nothing imported from the cwd
            cwd=where,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert inside.stdout is not None
            assert inside.stdout.readline() == b"inside\n"  # in the mount, imports done
            os.kill(pid, signal.SIGKILL)
            wait_for_restart(client, where, pid)
            out, _ = inside.communicate(b"go\n", timeout=60)
        finally:
            if inside.poll() is None:
                inside.kill()
                inside.wait()
        lost = {errno.errorcode[errno.ENOTCONN], errno.errorcode[errno.ECONNABORTED]}
        found = json.loads(out)
        assert found["listdir"] in lost and found["create"] in lost, found
        _serves(where, {"written.txt": b"before the kill\n"})
        assert not (where / "made-inside").exists()  # it never reached the volume
        _unmount_leaves_nothing(client, where)


def test_a_bridge_that_keeps_dying_is_given_up(
    service: Service, base: Path, tmp_path: Path
) -> None:
    """Restarts are bounded: the death after MAX_BRIDGE_RESTARTS restarts within the
    window removes the mount, the log says why, and nothing stays mounted.  The volume
    itself keeps everything, and mounts again."""
    where = tmp_path / "mnt"
    with Client(service.runtime) as client:
        volume, pid = _mount(client, base, where, "dying")
        for _restart in range(MAX_BRIDGE_RESTARTS):
            os.kill(pid, signal.SIGKILL)
            pid = wait_for_restart(client, where, pid)
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: client.mounts() == [], f"still listed: {client.mounts()}")
        assert not is_mounted(str(where))
        assert os.listdir(where) == []
        log = _anchor_log(service)
        assert f"removed the mount of {volume} at {where}: it keeps dying" in log
        assert client.read(volume, "/written.txt") == b"before the kill\n"
        client.mount(volume, where)
        _serves(where, {"written.txt": b"before the kill\n"})
        _unmount_leaves_nothing(client, where)


_LEADER_EXITS = textwrap.dedent(
    """
    import ctypes, threading, time
    threading.Thread(target=time.sleep, args=(120,)).start()
    print("started", flush=True)
    ctypes.CDLL(None).pthread_exit(None)  # the main thread ends; the process goes on
    """
)


def test_exited_unreaped_sees_an_exit_waitpid_cannot() -> None:
    """A process whose main thread ended while another thread lives on: waitpid cannot
    reap it, and exited_unreaped says it exited (a live one is not said to)."""
    child = subprocess.Popen([sys.executable, "-P", "-c", _LEADER_EXITS], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"started\n"
        _wait_for(lambda: exited_unreaped(child.pid), "its main thread never ended")
        assert child.poll() is None  # waitpid: not yet
        assert not exited_unreaped(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert not exited_unreaped(child.pid)  # reaped: gone


_LOOKS_UP = textwrap.dedent(
    """
    import errno, os, sys
    try:
        os.stat(sys.argv[1])
        print("ok")
    except OSError as exc:
        print(errno.errorcode.get(exc.errno, exc.errno))
    """
)


def _waiting_on_fuse(pid: int) -> bool:
    """Waiting for the bridge: on its own request, or on the directory's lock behind
    another one in flight (the bridge's prefetch walk may be listing it)."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text() in ("request_wait_answer", "fuse_lock_inode")
    except OSError:
        return False


def test_abort_mount_frees_a_program_waiting_on_a_bridge_that_never_answers(
    service: Service, base: Path, tmp_path: Path
) -> None:
    """A bridge that answers nothing (stopped): a program's lookup waits in the kernel
    until abort_mount aborts the connection (it then fails with ECONNABORTED or
    ENOTCONN) and detaches the mount; the bridge then killed is restarted as any."""
    where = tmp_path / "mnt"
    with Client(service.runtime) as client:
        _volume, pid = _mount(client, base, where, "hung")
        os.kill(pid, signal.SIGSTOP)
        looking = subprocess.Popen(
            [sys.executable, "-P", "-c", _LOOKS_UP, str(where / "never-looked-up")],
            stdout=subprocess.PIPE,
        )
        try:
            _wait_for(lambda: _waiting_on_fuse(looking.pid), "the lookup never waited")
            how = abort_mount(str(where))
            out, _ = looking.communicate(timeout=60)
        finally:
            if looking.poll() is None:
                # Waiting uninterruptibly on the directory's lock: only the
                # connection's end (the bridge's death) lets a kill reach it.
                os.kill(pid, signal.SIGKILL)
                looking.kill()
                looking.wait()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert out.strip() in (b"ECONNABORTED", b"ENOTCONN"), (out, how)
        assert not is_mounted(str(where)), how
        wait_for_restart(client, where, pid)
        _serves(where, {"written.txt": b"before the kill\n"})
        _unmount_leaves_nothing(client, where)
