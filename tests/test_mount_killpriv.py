"""What a write takes from a file, done by the shard (FUSE_HANDLE_KILLPRIV_V2).

Without it the kernel asks for "security.capability" before every write(2) to
a FUSE file (FUSE never gives its inodes S_NOSEC): one GETXATTR round trip per
write, 1,097 of a lua build's 3,500 requests.  The bridge claims
FUSE_HANDLE_KILLPRIV_V2, so the kernel asks once per file (then marks the
inode S_NOSEC) and leaves the rest to the file system: the shard drops the
capability xattr on every write, truncate, fallocate, copy and chown that
comes through a mount, and set-ID bits when the kernel flags the request
(native/bridge_session.c's request_seen; slates/node/fsops.py's
_drop_privileges).  That those end as on tmpfs for several users is checked
by tests/test_agent_users.py's permission steps; here, the probes saved, and
the case only the shard can catch: a capability set through another mount
while this mount's kernel holds the inode as S_NOSEC.  Both write modes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from slates import Client
from slates.fuse.bridge import read_counters
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted
from tests.test_mount_clean_reads import MODES

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)

WRITES = 200
# cap_net_raw, effective: a VFS_CAP_REVISION_2 value (the kernel checks its form)
CAPABILITY = bytes.fromhex("0100000200200000" + "00" * 12)


def getxattrs(runtime: Path, volume: str) -> int:
    return sum(
        read_counters(path).get("GETXATTR", 0) for path in runtime.glob(f"counters-{volume}-*")
    )


@MODES
def test_a_file_written_many_times_is_probed_for_its_capability_once(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    with Client(service.runtime) as client:
        vid = client.create_volume("probes")["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            for name in ("new", "again"):
                fd = os.open(mnt / name, os.O_CREAT | os.O_WRONLY, 0o644)
                try:
                    for index in range(WRITES):
                        os.write(fd, b"%05d\n" % index)
                finally:
                    os.close(fd)
            asked = getxattrs(service.runtime, vid)
            assert asked <= 4, asked  # a probe per file at most, not one per write
            expected = b"".join(b"%05d\n" % index for index in range(WRITES))
            assert (mnt / "new").read_bytes() == expected == (mnt / "again").read_bytes()


@MODES
def test_a_capability_set_between_two_writes_goes_with_the_second(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    """The kernel marked the inode S_NOSEC after the first write (nothing to drop
    then), and a setxattr does not unmark it: it does not look again before the
    second write, so dropping the capability is the shard's alone."""
    with Client(service.runtime) as client:
        vid = client.create_volume("caps")["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            fd = os.open(mnt / "tool", os.O_CREAT | os.O_WRONLY, 0o755)
            try:
                os.write(fd, b"first\n")
                os.setxattr(mnt / "tool", "security.capability", CAPABILITY)
                assert os.getxattr(mnt / "tool", "security.capability") == CAPABILITY
                os.write(fd, b"second\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            assert "security.capability" not in os.listxattr(mnt / "tool")
            assert (mnt / "tool").read_bytes() == b"first\nsecond\n"
            assert stat.S_IMODE((mnt / "tool").stat().st_mode) == 0o755
