"""A spare bridge (`python -m slates.fuse.bridge --spare`): started before its mount.

Theory of operation: a spare does a bridge's whole start (interpreter,
imports, the anchor tie, the spin calibration) with no job, then mounts the
one MountJob it reads from --job-fd (issue 14: a supervisor that keeps one
ready makes a mount cost only connect, probe, mount and INIT).  The job's
parser is checked as a pure function (every well-formed job round-trips,
wrong types and unknown fields are refused); the process is checked on a
real service and a real mount, with this test as its supervisor: it waits
without mounting (and leaves the calibration behind), serves its job once
told (clean reads from the base included: the spare made C's table while
it waited, and a volume with no base reads nothing from one), unmounts on
SIGTERM, and a spare let go (EOF) or given a bad job exits without
mounting.  No timing is asserted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slates.errors import InvalidArgument
from slates.fuse.bridge import (
    JOB_LIMIT,
    MountJob,
    parse_mount_job,
    read_counters,
    read_mount_job,
)
from slates.node.anchor import stop_process
from slates.node.ring import SPIN_CACHE_NAME
from slates.sdk.client import Client
from tests.anchor_fixture import Service, service
from tests.test_bridge_unit import _mounted, needs_fuse

__all__ = ["service"]  # the fixture, re-exported for pytest

_texts = st.text(max_size=40)
jobs = st.builds(
    MountJob,
    volume=_texts,
    mountpoint=_texts,
    counters=st.none() | _texts,
    allow_other=st.booleans(),
    auto_unmount=st.booleans(),
    writeback=st.booleans(),
    uncached=st.booleans(),
    spin_ns=st.none() | st.integers(min_value=-(2**40), max_value=2**40),
    token=st.none() | _texts,
)


@given(jobs)
def test_every_job_round_trips(job: MountJob) -> None:
    assert parse_mount_job(json.dumps(dataclasses.asdict(job)).encode()) == job


@given(
    jobs,
    st.sampled_from([f.name for f in dataclasses.fields(MountJob)]),
    st.sampled_from([None, True, 1, 1.5, "x", [], {}]),
)
def test_a_field_of_the_wrong_type_is_refused(job: MountJob, field: str, value: Any) -> None:
    fields = dataclasses.asdict(job) | {field: value}
    allowed = {
        "volume": (str,),
        "mountpoint": (str,),
        "counters": (str, type(None)),
        "spin_ns": (int, type(None)),
        "token": (str, type(None)),
    }.get(field, (bool,))
    fits = type(value) in allowed
    line = json.dumps(fields).encode()
    if fits:
        assert getattr(parse_mount_job(line), field) == value
    else:
        with pytest.raises(InvalidArgument):
            parse_mount_job(line)


@pytest.mark.parametrize(
    "line",
    [b"", b"[]", b"not json", b"\xff", b'{"volume": "vol-0-1"}', b'{"mountpoint": "/m"}'],
    ids=repr,
)
def test_what_is_not_a_job_is_refused(line: bytes) -> None:
    with pytest.raises(InvalidArgument):
        parse_mount_job(line)


def test_an_unknown_field_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        parse_mount_job(b'{"volume": "v", "mountpoint": "m", "uid": 0}')


def _read_from(data: bytes) -> MountJob | None:
    fd = os.memfd_create("job")  # a file, not a pipe: the over-long job would not fit
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        return read_mount_job(fd)
    finally:
        os.close(fd)


def test_reading_a_job_is_bounded_and_takes_one() -> None:
    assert _read_from(b"") is None  # let go
    assert _read_from(b'{"volume": "v", "mountpoint": "m"}\n') == MountJob("v", "m")
    for bad in (
        b'{"volume": "v", "mountpoint": "m"}',  # no newline: cut short
        b'{"volume": "v", "mountpoint": "m"}\n{}\n',  # two jobs
        b" " * (JOB_LIMIT + 1),
    ):
        with pytest.raises(InvalidArgument):
            _read_from(bad)


# -- a real spare on a real service -------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Spare:
    process: subprocess.Popen[bytes]
    ready: int  # our end of its --ready-fd
    log: Path

    def give(self, job: MountJob | bytes) -> None:
        stdin = self.process.stdin
        if stdin is None:
            raise AssertionError("the spare has no job pipe")
        raw = job if isinstance(job, bytes) else json.dumps(dataclasses.asdict(job)).encode()
        stdin.write(raw + b"\n")
        stdin.close()

    def ready_byte(self, timeout: float = 60) -> bytes:
        readable, _, _ = select.select([self.ready], [], [], timeout)
        return os.read(self.ready, 1) if readable else b""


@pytest.fixture
def spare(service: Service, tmp_path: Path) -> Iterator[Spare]:
    read_end, write_end = os.pipe()
    log = tmp_path / "spare.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "slates.fuse.bridge",
                "--spare",
                "--runtime-dir",
                str(service.runtime),
                "--ready-fd",
                str(write_end),
            ],
            pass_fds=(write_end,),
            stdin=subprocess.PIPE,
            stderr=out,
        )
    os.close(write_end)
    try:
        yield Spare(process, read_end, log)
    finally:
        stop_process(process)
        os.close(read_end)


@pytest.fixture
def volume(service: Service, tmp_path: Path) -> str:
    base = tmp_path / "base"
    base.mkdir()
    (base / "hello.txt").write_text("from the base\n")
    with Client(service.runtime) as client:
        return str(client.create_volume("spare", base=str(base))["id"])


@needs_fuse
def test_a_spare_waits_then_serves_its_job(
    spare: Spare, service: Service, volume: str, tmp_path: Path
) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    counters = tmp_path / "counters"
    readable, _, _ = select.select([spare.ready], [], [], 1.0)
    assert not readable and spare.process.poll() is None and not _mounted(mountpoint)
    try:
        spare.give(MountJob(volume, str(mountpoint), counters=str(counters)))
        assert spare.ready_byte() == b"1", spare.log.read_text()
        assert (mountpoint / "hello.txt").read_text() == "from the base\n"
        (mountpoint / "new.txt").write_text("made in the mount\n")
        assert counters.exists()
        assert read_counters(counters)["clean_reads"] >= 1  # its table, made while waiting
        assert (service.runtime / SPIN_CACHE_NAME).exists()  # calibrated while waiting
        spare.process.send_signal(signal.SIGTERM)
        assert spare.process.wait(timeout=30) == 0, spare.log.read_text()
        assert not _mounted(mountpoint)
    finally:
        if _mounted(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
    with Client(service.runtime) as client:  # what the mount wrote is the volume's
        assert client.read(volume, "/new.txt") == b"made in the mount\n"


@needs_fuse
def test_a_spare_serving_a_volume_without_a_base_reads_nothing_from_one(
    spare: Spare, service: Service, tmp_path: Path
) -> None:
    """The table a spare makes while it waits comes with a stand-in base ("/") that is
    unset at once: a volume with no base has every READ answered by its shard."""
    with Client(service.runtime) as client:
        volume = str(client.create_volume("baseless")["id"])
        client.mkdir(volume, "/etc")
        client.write(volume, "/etc/hostname", b"from the volume\n")  # a path "/" has too
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    counters = tmp_path / "counters"
    try:
        spare.give(MountJob(volume, str(mountpoint), counters=str(counters)))
        assert spare.ready_byte() == b"1", spare.log.read_text()
        assert (mountpoint / "etc" / "hostname").read_bytes() == b"from the volume\n"
        seen = read_counters(counters)
        assert seen["clean_reads"] == 0 and seen["READ"] >= 1, seen
    finally:
        spare.process.send_signal(signal.SIGTERM)
        spare.process.wait(timeout=30)
        if _mounted(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)


@needs_fuse
def test_a_spare_let_go_exits_quietly(spare: Spare) -> None:
    stdin = spare.process.stdin
    assert stdin is not None
    stdin.close()
    assert spare.process.wait(timeout=30) == 0
    assert spare.ready_byte() == b""  # EOF: it never served
    assert spare.log.read_text() == ""


@needs_fuse
def test_a_spare_given_a_bad_job_fails_without_mounting(
    spare: Spare, volume: str, tmp_path: Path
) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    spare.give(json.dumps({"volume": volume, "mountpoint": str(mountpoint), "spin": 1}).encode())
    assert spare.process.wait(timeout=30) == 1
    assert spare.ready_byte() == b""
    assert "unknown mount job fields" in spare.log.read_text()
    assert not _mounted(mountpoint)


def test_a_spare_takes_its_job_not_arguments() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "slates.fuse.bridge", "--spare", "--volume", "vol-0-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--spare" in done.stderr
