"""Several /dev/fuse loop threads (native/bridge_loop.c) under concurrent load.

Real anchors and mounts (root and /dev/fuse), with and without the kernel's
writeback cache.  Several reader processes walk a fresh mount of a live base
at once - lstat, listing and reading every entry, so LOOKUP, READDIRPLUS and
READ answered from the base run on several loop threads together - while
another client (the SDK) rewrites, creates and removes files in the volume.
Every read must give a content the file had (its base bytes or the SDK's), and
once the writer is done every file must read as the SDK left it.  Then the
kernel forgets every entry (dropping the dentry cache), and the shard, asked
the way a reconnecting watcher asks, must hold no lookup reference of the
mount: the references the bridge counted and the shard's agree exactly
(bridge_meta.c), however the threads interleaved.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slates.fuse.bridge import THREADS_ENV, read_counters
from slates.node.protocol import FrameReader, check_ok, frame, pack, unpack
from slates.node.runtime import Runtime
from slates.node.service import shard_of
from tests.test_mount_clean_reads import MODES, live_mount

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)

READERS = 4
PASSES = 3

# One reader: PASSES walks of the mount; prints the paths whose bytes were none of
# the contents they may have (a JSON map path -> the contents, hex, or "gone").  A
# read racing another client's rewrite may, as on any Linux file system, take each
# page from either version and stop at either version's size (the kernel copies page
# by page and reads the size apart from the pages), so a read fits when its length
# is a version's size and each 4 KiB page of it is that page (or its start) of some
# version; bytes of no version at all never fit.
READER = r"""
import json, os, sys
root, allowed = sys.argv[1], json.load(open(sys.argv[2]))
bad, passes = [], int(sys.argv[3])
def fits(data, versions):
    contents = [bytes.fromhex(v) for v in versions if v != "gone"]
    if not any(len(data) == len(c) for c in contents):
        return False
    for at in range(0, len(data), 4096):
        page = data[at : at + 4096]
        if not any(c[at : at + len(page)] == page for c in contents):
            return False
    return True
for _ in range(passes):
    for top, dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(top, name)
            rel = os.path.relpath(path, root)
            versions = allowed.get(rel, ["gone"])
            try:
                os.lstat(path)
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                if "gone" not in versions:
                    bad.append([rel, "gone"])
                continue
            if not fits(data, versions):
                bad.append([rel, data.hex()[:64]])
print(json.dumps(bad))
"""


def make_base(base: Path, rng: random.Random) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for d in range(8):
        for f in range(20):
            rel = f"d{d}/s{f % 3}/f{f}.txt"
            data = rng.randbytes(rng.choice([1, 700, 4096, 9000]))
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            (base / rel).write_bytes(data)
            files[rel] = data
    return files


def held_references(runtime: Path, volume: str) -> list[int]:
    """The inodes the shard holds lookup references of, for this volume: what it
    sends a watcher that (re)connects, before anything else."""
    state = Runtime(runtime).read_state()
    (path,) = [s.socket for s in state.shards if s.index == shard_of(volume)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(frame(pack({"client": f"test-watch-{os.getpid()}", "watch": volume})))
        reader, first = FrameReader(), True
        held: list[int] = []
        while True:
            while (payload := reader.next_frame()) is None:
                if not first:
                    sock.settimeout(1.0)  # the refresh, if any, comes at once
                try:
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    return sorted(held)
                if not data:
                    return sorted(held)
                reader.feed(data)
            message = unpack(payload)
            if first:
                check_ok(message)
                first = False
                continue
            held += [note[1] for note in message.get("inval", []) if note[0] == "inode"]
            sock.sendall(frame(pack({"ack": message.get("id")})))


def forget_everything(runtime: Path, volume: str) -> None:
    """Make the kernel forget every entry it can (the dentry and inode caches),
    then wait until its FORGETs stop arriving."""
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")
    last, still = -1, 0
    deadline = time.monotonic() + 30
    while still < 5 and time.monotonic() < deadline:
        seen = counters_of(runtime, volume)
        now = seen.get("FORGET", 0) + seen.get("BATCH_FORGET", 0)
        still = still + 1 if now == last else 0
        last = now
        time.sleep(0.1)


def loop_thread_count(runtime: Path, volume: str) -> int:
    """Threads of the bridge process serving `volume` (its pid from the anchor's state:
    a bridge that began as the anchor's spare names neither mount nor counters in argv)."""
    state = json.loads((runtime / "anchor.json").read_text())
    (pid,) = [int(m["pid"]) for m in state["mounts"] if m["volume"] == volume]
    return len(os.listdir(f"/proc/{pid}/task"))


def counters_of(runtime: Path, volume: str) -> dict[str, int]:
    (path,) = runtime.glob(f"counters-{volume}-*")
    return read_counters(path)


@MODES
@pytest.mark.parametrize("threads", [1, 3], ids=["one-thread", "three-threads"])
def test_readers_on_several_threads_while_another_client_writes(
    tmp_path: Path, writeback: bool, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    monkeypatch.setenv(THREADS_ENV, str(threads))  # the anchor passes it to the bridge
    with live_mount(tmp_path, "threads", writeback=writeback) as (client, vid, base, mnt):
        files = make_base(base, rng)
        rewritten = rng.sample(sorted(files), 24)
        removed = [rel for rel in sorted(files) if rel not in rewritten][:6]
        created = [f"d{d}/new{d}.txt" for d in range(4)]
        final = dict(files)
        allowed: dict[str, list[str]] = {rel: [data.hex()] for rel, data in files.items()}
        for rel in rewritten:
            # The writeback cache keeps the kernel's own file sizes (README: such a
            # mount is for volumes only it changes), so there sizes stay as they were.
            size = len(files[rel]) if writeback else rng.choice([3, 5000])
            final[rel] = rng.randbytes(size)
            allowed[rel].append(final[rel].hex())
        for rel in created:
            final[rel] = rng.randbytes(100)
            allowed[rel] = [final[rel].hex(), "gone"]
        for rel in removed:
            del final[rel]
            allowed[rel].append("gone")
        table = tmp_path / "allowed.json"
        table.write_text(json.dumps(allowed))
        readers = [
            subprocess.Popen(
                [sys.executable, "-c", READER, str(mnt), str(table), str(PASSES)],
                stdout=subprocess.PIPE,
            )
            for _ in range(READERS)
        ]
        changes = [("write", r) for r in rewritten] + [("create", r) for r in created]
        changes += [("unlink", r) for r in removed]
        rng.shuffle(changes)
        for kind, rel in changes:  # another client, while the readers walk
            if kind == "unlink":
                client.unlink(vid, "/" + rel)
            else:
                client.write(vid, "/" + rel, final[rel], truncate=True)
        for reader in readers:
            out, _ = reader.communicate(timeout=300)
            assert reader.returncode == 0
            assert json.loads(out) == [], f"seed {seed}: reads of contents no file had"
        seen: dict[str, bytes] = {}
        for top, _dirs, names in os.walk(mnt):
            for name in names:
                path = Path(top, name)
                seen[str(path.relative_to(mnt))] = path.read_bytes()
        assert seen == final, f"seed {seed}"
        runtime = tmp_path / "run"
        # ... and the watcher and the directory prefetch thread (native/bridge_prefetch.c)
        assert loop_thread_count(runtime, vid) == threads + 2
        assert held_references(runtime, vid) != []  # the probe sees what the kernel holds
        forget_everything(runtime, vid)
        stats = counters_of(runtime, vid)
        assert stats["meta_answers"] > 0  # the base was answered by the bridge
        assert held_references(runtime, vid) == [], f"seed {seed}: leaked references"
