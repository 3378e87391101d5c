"""A real mount end to end: anchor, daemon shards, and a bridge process.

The anchor (tests/anchor_fixture.py) runs the real shards; a volume over a
base directory is created with the SDK, and `python -m slates.fuse.bridge`
mounts it on a temporary directory.  Every test unmounts and stops what it
started, by pid.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slates.sdk.client import Client
from tests.anchor_fixture import Service, start_service
from tests.test_bridge_unit import (
    MountedBridge,
    _mounted,
    _sh,
    _tree_digest,
    needs_fuse,
    start_bridge,
    warm_passes,
)

pytestmark = needs_fuse


@pytest.fixture
def base(tmp_path: Path) -> Path:
    root = tmp_path / "base"
    (root / "src" / "lib").mkdir(parents=True)
    (root / "README.md").write_text("# project\n")
    (root / "src" / "main.c").write_text('#include <stdio.h>\nint main(void) { puts("hi"); }\n')
    for i in range(40):
        (root / "src" / "lib" / f"m{i:02}.py").write_text(f"VALUE = {i}\n" * (i + 1))
    (root / "data.bin").write_bytes(os.urandom(2 << 20))
    return root


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    running = start_service(tmp_path / "run", shards=2)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def volume(service: Service, base: Path) -> str:
    with Client(service.runtime) as client:
        return str(client.create_volume("smoke", base=str(base))["id"])


@pytest.fixture
def mount(service: Service, volume: str, tmp_path: Path) -> Iterator[MountedBridge]:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    bridge = start_bridge(service.runtime, mountpoint, volume)
    try:
        yield bridge
    finally:
        bridge.stop()
        assert not _mounted(mountpoint)


def test_shell_tools_work_and_the_base_is_untouched(
    base: Path, service: Service, volume: str, mount: MountedBridge
) -> None:
    before = _tree_digest(base)
    m = mount.mountpoint
    out = _sh(m, "ls; cat README.md; cat src/lib/m03.py | wc -l")
    assert out.split() == ["README.md", "data.bin", "src", "#", "project", "4"]
    assert (m / "data.bin").read_bytes() == (base / "data.bin").read_bytes()
    _sh(
        m,
        """
        echo hello > notes.txt
        mkdir -p build/out
        mv notes.txt build/out/notes.txt
        echo more >> README.md
        rm src/lib/m00.py
        mv src/lib src/pkg
        ln -s ../README.md build/readme
        cp data.bin build/copy.bin
        """,
    )
    assert (m / "build" / "out" / "notes.txt").read_text() == "hello\n"
    assert (m / "README.md").read_text() == "# project\nmore\n"
    assert sorted(os.listdir(m / "src")) == ["main.c", "pkg"]
    assert len(os.listdir(m / "src" / "pkg")) == 39
    assert (m / "build" / "readme").read_text() == "# project\nmore\n"
    assert (m / "build" / "copy.bin").read_bytes() == (base / "data.bin").read_bytes()
    os.sync()
    # Another client of the shard sees what the mount wrote.
    with Client(service.runtime) as client:
        assert client.read(volume, "/build/out/notes.txt") == b"hello\n"
        assert client.read(volume, "/README.md") == b"# project\nmore\n"
    assert _tree_digest(base) == before, "the base directory was written"


def test_warm_pass_sends_only_getattrs(base: Path, mount: MountedBridge) -> None:
    cold, second, third = warm_passes(mount)
    assert cold.get("READ", 0) > 0 and cold.get("READDIRPLUS", 0) > 0
    opened = sum(1 for p in base.rglob("*") if p.is_file())
    dirs = 1 + sum(1 for p in base.rglob("*") if p.is_dir())
    for sent in (second, third):
        assert set(sent) <= {"GETATTR", "round_trips", "meta_answers", "attr_answers"}, sent
        assert sent.get("GETATTR", 0) <= opened + dirs


WRITER = r"""
import os, sys
root = sys.argv[1]
for i in range(int(sys.argv[2])):
    path = os.path.join(root, f"w{i:03}.bin")
    with open(path, "wb") as f:
        for k in range(16):
            f.write(bytes([(i + k) % 251]) * 65536)
        f.flush()
        os.fsync(f.fileno())
print("done", flush=True)
"""


def _expected(i: int) -> bytes:
    return b"".join(bytes([(i + k) % 251]) * 65536 for k in range(16))


def test_shard_sigkill_during_writes_is_a_pause(
    service: Service, volume: str, mount: MountedBridge
) -> None:
    m = mount.mountpoint
    (m / "out").mkdir()
    count = 40
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(m / "out"), str(count)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while len(os.listdir(m / "out")) < 5:
            assert time.monotonic() < deadline and writer.poll() is None
            time.sleep(0.02)
        shard = int(volume.split("-")[1])
        old = service.kill_shard(shard)
        service.wait_restarted(shard, old)
        stdout, stderr = writer.communicate(timeout=120)
    finally:
        if writer.poll() is None:
            writer.send_signal(signal.SIGKILL)
            writer.wait()
    assert writer.returncode == 0, stderr.decode()
    assert stdout.decode().strip() == "done"
    for i in range(count):
        data = (m / "out" / f"w{i:03}.bin").read_bytes()
        assert hashlib.sha256(data).digest() == hashlib.sha256(_expected(i)).digest(), i
    assert mount.counts()["reconnects"] >= 1
