"""The fence table as a file: written by the fleet link, read by its host's shards.

Theory of operation (the rules are slates.fleet.fencing's).  The link
(slates.fleet.link_lease's fence loop) rebuilds the table a few times a second
from what it knows (its lease's proof, etcd's configurations) and, when it
changed, `FenceWriter.write`s RUNTIME/fleet-fence.msgpack: written to a
temporary file in the same directory (mode 0600) and renamed over the old
one, so a reader sees one whole table or the previous one.  When the link
leaves it writes the table once more with `until` 0 (it revokes its lease
next, so a successor may take over at once), and a link that dies leaves a
table whose `until` passes: either way its owned greens are fenced.  The
anchor removes the file when it starts (slates.node.anchor: a new boot's
greens are none of the old table's business); `remove` is for tests.

`FenceReader.admit(shard, green)` is what a shard calls before it makes a
version (slates.node.green_ops's submit): it stats the file and re-reads it
only when its (inode, size, mtime) changed, so a submission costs one stat;
no file means no table.  A file that cannot be read or decoded fences
nothing but is reported once per distinct error through `log`: a broken
link must not stop a host that has no other owner to defer to, and `until`
still protects the case that matters (a link that stopped renewing).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from slates.errors import SlatesError
from slates.fleet.fencing import FenceTable, admit, decode_table, encode_table

__all__ = ["FENCE_FILE", "FenceReader", "FenceWriter"]

FENCE_FILE: Final = "fleet-fence.msgpack"
MAX_FILE: Final = 8 << 20


class FenceWriter:
    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / FENCE_FILE
        self._last: bytes | None = None

    def write(self, table: FenceTable) -> bool:
        """Write the table if it changed; returns whether it wrote."""
        data = encode_table(table)
        if data == self._last:
            return False
        temporary = self.path.with_name(f".{FENCE_FILE}.{os.getpid()}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        self._last = data
        return True

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._last = None


class FenceReader:
    def __init__(self, runtime_dir: str | None, log: Callable[[str], None] | None = None) -> None:
        self.path = None if runtime_dir is None else Path(runtime_dir) / FENCE_FILE
        self._log = log
        self._seen: tuple[int, int, int] | None = None
        self._table: FenceTable | None = None
        self._reported = ""

    def table(self) -> FenceTable | None:
        if self.path is None:
            return None
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._table = None, None
            return None
        except OSError as exc:
            self._report(f"cannot stat the fence table: {exc}")
            return self._table
        key = (found.st_ino, found.st_size, found.st_mtime_ns)
        if key == self._seen:
            return self._table
        try:
            if found.st_size > MAX_FILE:
                raise OSError(f"over {MAX_FILE} bytes")
            table = decode_table(self.path.read_bytes())
        except (OSError, SlatesError) as exc:
            self._report(f"cannot read the fence table: {exc}")
            self._seen, self._table = key, None
            return None
        self._seen, self._table = key, table
        return table

    def admit(self, shard: int, green: str) -> None:
        """Raise EpochFenced or NotOwner unless `shard` may make a version of `green`."""
        admit(self.table(), shard, green, time.monotonic())

    def _report(self, message: str) -> None:
        if message != self._reported and self._log is not None:
            self._log(message)
        self._reported = message
