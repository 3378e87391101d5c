"""`slates demo`: the Quick start's walk through the pure core, as data.

Theory of operation: `run_demo` drives slates.core and slates.base the way a
daemon shard will, minus the daemon: it writes a small sample "image
service" project to a real directory, then makes real calls and measures
what they did.  Nothing is hard-coded: every figure in the returned dict is
read back from a volume, a host, the base reader or the disk after the call
that it describes.  The CLI (slates_cli.main) only prints the dict, as rich
tables or as JSON.

The steps:
1. write the sample project (deterministic bytes; `model.bin` is 1 MiB of
   SHAKE-256 output, so no global random state is touched);
2. open a volume over the live directory through a reader that counts base
   reads, replace [8, 10) of /image.conf, rename the base directory /src
   (a redirect, nothing copied) and unlink /README.md (a whiteout); the
   files on disk stay as they were;
3. capture the sample into a snapshot, clone it three times and change two
   bytes of /assets/model.bin in each clone: each clone references the
   whole project, owns one page, and the host holds one shared copy; a
   snapshot of a clone is cloned with zero unique bytes; a bounded clone
   refuses a write beyond its quota and keeps its content;
4. seal a clone, then a twin that made the identical edit: the twin's
   chunk is shared, not stored again.

Errors are slates.errors.SlatesError: an unusable `keep` directory is
InvalidArgument (the caller's fault) and nothing is written to it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from typing import TypedDict

from slates.base import LiveDirectory, capture
from slates.core import (
    PAGE,
    ROOT_INO,
    BaseEntry,
    Capacity,
    Fingerprint,
    Host,
    Kind,
    Snapshot,
    Volume,
)
from slates.core.volume import DirBody
from slates.errors import AccessDenied, CapacityExhausted, InvalidArgument

__all__ = [
    "CONF_BASE",
    "MODEL_SIZE",
    "SAMPLE_FILES",
    "BoundedResult",
    "CloneResult",
    "ClonesResult",
    "CountingReader",
    "DemoResult",
    "OverlayResult",
    "RenameResult",
    "SampleResult",
    "SealResult",
    "SnapshotCloneResult",
    "UnlinkResult",
    "model_bytes",
    "run_demo",
    "write_sample",
]

CONF_BASE = b"quality=80\ncache=off\n"
MODEL_SIZE = 1 << 20
MODEL_SEED = b"slates demo model.bin v1"

SAMPLE_FILES: dict[str, bytes] = {
    "image.conf": CONF_BASE,
    "src/decoder.rs": (
        b"// Decodes images for the service.\n"
        b"pub fn decode(bytes: &[u8]) -> Option<Image> {\n"
        b"    png::decode(bytes).or_else(|| jpeg::decode(bytes))\n"
        b"}\n"
    ),
    "src/cache.rs": (
        b"// Keeps decoded images while cache=on.\n"
        b"pub struct Cache { enabled: bool }\n"
        b"impl Cache {\n"
        b"    pub fn new(enabled: bool) -> Self { Cache { enabled } }\n"
        b"}\n"
    ),
    "README.md": b"# image service\n\nDecodes PNG and JPEG. Settings live in image.conf.\n",
}
MODEL_PATH = "assets/model.bin"

# Step 2: the edit from the product description ("Recording File Operations").
CONF_EDIT_START, CONF_EDIT_END, CONF_EDIT_DATA = 8, 10, b"90"

# Step 3: each clone changes 2 bytes at its own offset inside model.bin.
CLONE_OFFSETS = (100_000, 400_000, 900_000)
BOUNDED_QUOTA = 4 * PAGE
BOUNDED_SMALL_OFFSET = 50_000
BOUNDED_BIG_OFFSET = 256 * 1024
BOUNDED_BIG_SIZE = 64 * 1024


# -- the result, as plain JSON-ready data ------------------------------------


class SampleResult(TypedDict):
    path: str  # where the sample was written (removed afterwards unless kept)
    kept: bool
    files: dict[str, int]  # volume path -> size on disk
    total_bytes: int


class RenameResult(TypedDict):
    old_path: str
    new_path: str
    inode: int
    inode_base_path: str | None  # the redirect: still the original base path
    listing: list[str]  # /source, listed through the redirect
    decoder_matches_disk: bool
    base_bytes_read: int  # by the rename itself
    referenced_bytes_delta: int  # content copied by the rename
    metadata_bytes_delta: int  # the one inode the rename had to bind


class UnlinkResult(TypedDict):
    path: str
    visible_in_volume: bool
    on_disk: bool


class OverlayResult(TypedDict):
    base_reads_at_create: int
    base_bytes_read_at_create: int
    edit_path: str
    edit_start: int
    edit_end: int
    edit_data: str
    volume_reads: str
    disk_holds: str
    base_bytes_read_by_write: int
    unique_bytes_after_write: int
    rename: RenameResult
    unlink: UnlinkResult
    root_whiteouts: list[str]
    root_listing: list[str]
    disk_listing: list[str]


class CloneResult(TypedDict):
    name: str
    offset: int
    length: int
    referenced_bytes: int
    unique_bytes: int
    host_physical_bytes: int  # right after this clone's write


class SnapshotCloneResult(TypedDict):
    snapshot_id: str
    source: str
    source_unique_after_snapshot: int
    referenced_bytes: int
    unique_bytes: int
    sees_source_edit: bool
    host_physical_bytes: int  # after the snapshot and its clone


class BoundedResult(TypedDict):
    quota_bytes: int
    small_write_bytes: int
    charged_after_small_write: int
    refused_write_offset: int
    refused_write_bytes: int
    error_code: str
    error_message: str
    error_details: dict[str, int]
    content_unchanged: bool
    charged_after_refusal: int


class SealResult(TypedDict):
    volume: str
    same_edit_as: str  # the volume whose edit this one repeated ("" for none)
    files: int
    chunks_new: int
    chunks_shared: int
    bytes_sealed: int
    host_physical_before: int
    host_physical_after: int


class ClonesResult(TypedDict):
    snapshot_id: str
    snapshot_referenced_bytes: int
    host_physical_after_capture: int
    clones: list[CloneResult]
    host_physical_bytes: int  # after all three clone writes
    host_chunk_bytes: int
    host_private_bytes: int
    full_copies_bytes: int  # what three independent copies would hold
    snapshot_clone: SnapshotCloneResult
    bounded: BoundedResult


class DemoResult(TypedDict):
    page_bytes: int
    sample: SampleResult
    overlay: OverlayResult
    clones: ClonesResult
    seal: list[SealResult]


# -- step 1: the sample project ----------------------------------------------


def model_bytes(size: int = MODEL_SIZE) -> bytes:
    """Deterministic pseudo-random content: SHAKE-256 of a fixed seed."""
    return hashlib.shake_256(MODEL_SEED).digest(size)


def write_sample(directory: str) -> dict[str, int]:
    """Write the sample project into `directory` (which exists); returns path -> size."""
    files = {**SAMPLE_FILES, MODEL_PATH: model_bytes()}
    sizes: dict[str, int] = {}
    try:
        for relative, data in files.items():
            path = os.path.join(directory, *relative.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            sizes["/" + relative] = os.stat(path).st_size
    except PermissionError as exc:
        raise AccessDenied(
            f"cannot write the sample project to {directory}", path=directory
        ) from exc
    return dict(sorted(sizes.items()))


def _prepare_keep(directory: str) -> str:
    """Check (before writing anything) that `directory` is absent or empty; create it."""
    directory = os.path.abspath(directory)
    if os.path.lexists(directory):
        if not os.path.isdir(directory) or os.path.islink(directory):
            raise InvalidArgument(f"--keep {directory} is not a directory", path=directory)
        present = sorted(os.listdir(directory))
        if present:
            raise InvalidArgument(
                f"--keep {directory} is not empty ({len(present)} entries); "
                "give an empty or new directory, nothing was written",
                path=directory,
                entries=present[:10],
            )
        return directory
    try:
        os.makedirs(directory)
    except PermissionError as exc:
        raise AccessDenied(f"cannot create --keep {directory}", path=directory) from exc
    except OSError as exc:  # a parent is a file, a name is too long, ...
        raise InvalidArgument(
            f"cannot create --keep {directory}: {exc.strerror}", path=directory
        ) from exc
    return directory


@contextlib.contextmanager
def _sample_dir(keep: str | None) -> Iterator[str]:
    if keep is not None:
        yield _prepare_keep(keep)
        return
    with tempfile.TemporaryDirectory(prefix="slates-demo-") as temporary:
        yield temporary


# -- step 2: a volume over the live directory ---------------------------------


class CountingReader:
    """A BaseReader that forwards to a LiveDirectory and counts content reads."""

    def __init__(self, live: LiveDirectory) -> None:
        self.live = live
        self.reads = 0
        self.bytes_read = 0

    def stat(self, path: str) -> BaseEntry | None:
        return self.live.stat(path)

    def list(self, path: str) -> list[tuple[str, Kind]]:
        return self.live.list(path)

    def read(self, path: str, fingerprint: Fingerprint, offset: int, size: int) -> bytes:
        data = self.live.read(path, fingerprint, offset, size)
        self.reads += 1
        self.bytes_read += len(data)
        return data


def _disk(sample: str, path: str) -> bytes:
    with open(os.path.join(sample, *path.strip("/").split("/")), "rb") as f:
        return f.read()


def _read_all(volume: Volume, path: str) -> bytes:
    ino = volume.resolve(path)
    return volume.read(ino, 0, volume.getattr(ino).size)


def _dir_body(volume: Volume, ino: int) -> DirBody:
    body = volume.root.inodes[ino].body
    if not isinstance(body, DirBody):
        raise InvalidArgument("not a directory", ino=ino)
    return body


def _overlay(host: Host, sample: str) -> OverlayResult:
    reader = CountingReader(LiveDirectory(sample))
    volume = Volume.new(host, base=reader)
    try:
        reads_at_create, bytes_at_create = reader.reads, reader.bytes_read

        conf = volume.resolve("/image.conf")
        before = reader.bytes_read
        volume.write(conf, CONF_EDIT_START, CONF_EDIT_DATA, time_ns=time.time_ns())
        write_read = reader.bytes_read - before
        volume_reads = _read_all(volume, "/image.conf")
        unique_after_write = volume.counters().unique_bytes

        before_counters, before = volume.counters(), reader.bytes_read
        volume.rename(ROOT_INO, "src", ROOT_INO, "source", time_ns=time.time_ns())
        rename_read = reader.bytes_read - before
        after_counters = volume.counters()
        source = volume.resolve("/source")
        listing = [item.name for item in volume.readdir(source)]
        decoder = _read_all(volume, "/source/decoder.rs")

        volume.unlink(ROOT_INO, "README.md", time_ns=time.time_ns())
        root_listing = [item.name for item in volume.readdir(ROOT_INO)]
        return {
            "base_reads_at_create": reads_at_create,
            "base_bytes_read_at_create": bytes_at_create,
            "edit_path": "/image.conf",
            "edit_start": CONF_EDIT_START,
            "edit_end": CONF_EDIT_END,
            "edit_data": CONF_EDIT_DATA.decode(),
            "volume_reads": volume_reads.decode(),
            "disk_holds": _disk(sample, "/image.conf").decode(),
            "base_bytes_read_by_write": write_read,
            "unique_bytes_after_write": unique_after_write,
            "rename": {
                "old_path": "/src",
                "new_path": "/source",
                "inode": source,
                "inode_base_path": _dir_body(volume, source).base_path,
                "listing": listing,
                "decoder_matches_disk": decoder == _disk(sample, "/src/decoder.rs"),
                "base_bytes_read": rename_read,
                "referenced_bytes_delta": after_counters.referenced_bytes
                - before_counters.referenced_bytes,
                "metadata_bytes_delta": after_counters.metadata_bytes
                - before_counters.metadata_bytes,
            },
            "unlink": {
                "path": "/README.md",
                "visible_in_volume": "README.md" in root_listing,
                "on_disk": os.path.exists(os.path.join(sample, "README.md")),
            },
            "root_whiteouts": sorted(_dir_body(volume, ROOT_INO).whiteouts),
            "root_listing": root_listing,
            "disk_listing": sorted(os.listdir(sample)),
        }
    finally:
        volume.close()


# -- step 3: snapshot, clones, capacity ---------------------------------------


def _clone_edit(index: int) -> bytes:
    return bytes([0xC0 + index, 0xDE])


def _seal_one(name: str, volume: Volume, host: Host, same_edit_as: str = "") -> SealResult:
    before = host.physical_bytes
    report = volume.seal()
    return {
        "volume": name,
        "same_edit_as": same_edit_as,
        "files": report.files,
        "chunks_new": report.chunks_new,
        "chunks_shared": report.chunks_shared,
        "bytes_sealed": report.bytes_sealed,
        "host_physical_before": before,
        "host_physical_after": host.physical_bytes,
    }


def _snapshot_clone(
    name: str, source: Volume, host: Host, stack: contextlib.ExitStack, offset: int, edit: bytes
) -> SnapshotCloneResult:
    """Snapshot `source` and clone it: O(1), nothing unique yet, sees the source's edit."""
    later = source.snapshot(f"{name}@1")
    again = Volume.clone(later, host)
    stack.callback(again.close)
    seen = again.read(again.resolve("/" + MODEL_PATH), offset, len(edit))
    counters = again.counters()
    return {
        "snapshot_id": later.snapshot_id,
        "source": name,
        "source_unique_after_snapshot": source.counters().unique_bytes,
        "referenced_bytes": counters.referenced_bytes,
        "unique_bytes": counters.unique_bytes,
        "sees_source_edit": seen == edit,
        "host_physical_bytes": host.physical_bytes,
    }


def _bounded(
    snapshot: Snapshot, host: Host, stack: contextlib.ExitStack, model_on_disk: bytes
) -> BoundedResult:
    """A bounded clone: its quota covers one small edit, not a 64 KiB rewrite."""
    bounded = Volume.clone(snapshot, host, capacity=Capacity.reserved(BOUNDED_QUOTA))
    stack.callback(bounded.close)
    model = bounded.resolve("/" + MODEL_PATH)
    small = b"ok"
    bounded.write(model, BOUNDED_SMALL_OFFSET, small, time_ns=time.time_ns())
    charged_small = bounded.counters().charged_bytes
    refused: CapacityExhausted | None = None
    try:
        bounded.write(model, BOUNDED_BIG_OFFSET, bytes(BOUNDED_BIG_SIZE), time_ns=time.time_ns())
    except CapacityExhausted as exc:
        refused = exc
    end = BOUNDED_BIG_OFFSET + BOUNDED_BIG_SIZE
    now = bounded.read(model, BOUNDED_BIG_OFFSET, BOUNDED_BIG_SIZE)
    details = refused.details if refused is not None else {}
    return {
        "quota_bytes": BOUNDED_QUOTA,
        "small_write_bytes": len(small),
        "charged_after_small_write": charged_small,
        "refused_write_offset": BOUNDED_BIG_OFFSET,
        "refused_write_bytes": BOUNDED_BIG_SIZE,
        "error_code": refused.code if refused is not None else "",
        "error_message": refused.message if refused is not None else "",
        "error_details": {k: v for k, v in details.items() if isinstance(v, int)},
        "content_unchanged": now == model_on_disk[BOUNDED_BIG_OFFSET:end],
        "charged_after_refusal": bounded.counters().charged_bytes,
    }


def _shared(
    host: Host, sample: str, stack: contextlib.ExitStack
) -> tuple[ClonesResult, list[SealResult]]:
    snapshot = capture(sample, host, snapshot_id="sample@capture")
    physical_after_capture = host.physical_bytes
    model_on_disk = _disk(sample, "/" + MODEL_PATH)

    clones: list[Volume] = []
    rows: list[CloneResult] = []
    for index, offset in enumerate(CLONE_OFFSETS):
        clone = Volume.clone(snapshot, host)
        stack.callback(clone.close)
        edit = _clone_edit(index)
        clone.write(clone.resolve("/" + MODEL_PATH), offset, edit, time_ns=time.time_ns())
        counters = clone.counters()
        clones.append(clone)
        rows.append(
            {
                "name": f"clone-{index + 1}",
                "offset": offset,
                "length": len(edit),
                "referenced_bytes": counters.referenced_bytes,
                "unique_bytes": counters.unique_bytes,
                "host_physical_bytes": host.physical_bytes,
            }
        )
    physical = host.physical_bytes
    chunk_bytes, private_bytes = host.chunk_bytes, host.private_bytes

    snapshot_clone = _snapshot_clone(
        rows[0]["name"], clones[0], host, stack, CLONE_OFFSETS[0], _clone_edit(0)
    )
    bounded = _bounded(snapshot, host, stack, model_on_disk)

    # Step 4: seal clone-2, then a twin that made the identical edit.
    seals = [_seal_one(rows[1]["name"], clones[1], host)]
    twin = Volume.clone(snapshot, host)
    stack.callback(twin.close)
    twin.write(
        twin.resolve("/" + MODEL_PATH), CLONE_OFFSETS[1], _clone_edit(1), time_ns=time.time_ns()
    )
    seals.append(_seal_one("twin", twin, host, same_edit_as=rows[1]["name"]))

    clones_result: ClonesResult = {
        "snapshot_id": snapshot.snapshot_id,
        "snapshot_referenced_bytes": snapshot.root.referenced_bytes,
        "host_physical_after_capture": physical_after_capture,
        "clones": rows,
        "host_physical_bytes": physical,
        "host_chunk_bytes": chunk_bytes,
        "host_private_bytes": private_bytes,
        "full_copies_bytes": sum(row["referenced_bytes"] for row in rows),
        "snapshot_clone": snapshot_clone,
        "bounded": bounded,
    }
    return clones_result, seals


# -- the whole demo -------------------------------------------------------------


def run_demo(keep: str | None = None) -> DemoResult:
    """Run every step; `keep` names an absent or empty directory to leave the sample in."""
    with _sample_dir(keep) as sample, contextlib.ExitStack() as stack:
        files = write_sample(sample)
        host = Host()
        overlay = _overlay(host, sample)
        clones, seals = _shared(host, sample, stack)
        return {
            "page_bytes": PAGE,
            "sample": {
                "path": sample,
                "kept": keep is not None,
                "files": files,
                "total_bytes": sum(files.values()),
            },
            "overlay": overlay,
            "clones": clones,
            "seal": seals,
        }
