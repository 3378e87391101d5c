"""Merging agents' work into a green volume vs the same edits made directly, side by side.

A seeded tree of N files (200 B to 8 KiB of printable text, ~100 directories)
becomes a green volume (its base captured).  For each agent count, that many
work volumes are cloned from the green head; every agent makes two byte-range
edits (an insert near the start, a replace in the middle) to a file no other
agent touches, then all of them submit.  The submissions run sequentially
(one awaited after the other) and, for more than one agent, concurrently (one
trio task per agent in a nursery), each time with fresh work volumes and
fresh files.  All requests go through one AsyncClient, which sends one
request at a time per shard, so a concurrent submit's latency includes its
wait in that queue.

Measured per row: the wall time of the submit phase, merges per second, the
median and p99 latency of one submit, and conflicts (must be 0).  Baseline:
the same 2 x agents edits to the same files, applied by the same client with
`edit` to a plain volume cloned from the same green version (no work volumes,
no merge), the median of BASELINE_ROUNDS fresh volumes.  Also timed, outside
the ratios: deleting the submitted work volumes.  Afterwards the benchmark
checks every submission's result, the head version, the paths the ledger
reports changed, and reads every edited file back from the head (and the
baseline volume) against the expected bytes; any mismatch fails the run.  The
anchor runs in a temporary runtime directory and is stopped, and the
directory removed, however the run ends.

    python bench/merge_bench.py [--files 10000] [--agents 1,10,100]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import random
import shutil
import statistics
import string
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slates import AsyncClient
from slates.node.anchor import spawn_anchor, stop_process

__all__ = ["main"]

DIRECTORIES = 100
MIN_SIZE, MAX_SIZE = 200, 8192
INSERT_AT = 16  # the insert near the start
REPLACED = 8  # bytes replaced in the middle
BASELINE_ROUNDS = 5  # the baseline is short: its median over fresh plain volumes
_PRINTABLE = (string.ascii_letters + string.digits + " " * 12 + "\n" * 2 + "(){};=+-*/,.").encode()
_TEXT = bytes(_PRINTABLE[b % len(_PRINTABLE)] for b in range(256))


class BenchFailure(RuntimeError):
    """The merged head (or a submission) is not what the edits should have produced."""


@dataclass(frozen=True)
class Edit:
    """One agent's file and its two edits, with the bytes the file must then hold."""

    path: str
    insert: bytes  # at INSERT_AT
    middle: int  # where the replace starts, after the insert
    replace: bytes  # instead of [middle, middle + REPLACED)
    expected: bytes


@dataclass
class Row:
    agents: int
    mode: str
    plain_s: float  # baseline: 2 x agents edits on a plain volume (median of rounds)
    work_s: float  # creating the work volumes
    edit_s: float  # the same edits, made in the work volumes
    submit_s: float  # the submit phase, wall time
    delete_s: float  # deleting the submitted work volumes
    latencies: list[float]
    conflicts: int


def _tree(root: Path, files: int, rng: random.Random) -> dict[str, bytes]:
    """Seeded printable files in ~DIRECTORIES directories; returns {volume path: content}."""
    per_directory = max(1, math.ceil(files / DIRECTORIES))
    contents: dict[str, bytes] = {}
    for i in range(files):
        relative = f"d{i // per_directory:03}/f{i:05}.c"
        data = rng.randbytes(rng.randint(MIN_SIZE, MAX_SIZE)).translate(_TEXT)
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        contents["/" + relative] = data
    return contents


def _edit_for(path: str, original: bytes, tag: str) -> Edit:
    insert = f"/* agent {tag} */\n".encode()
    replace = f"<<agent {tag} was here>>".encode()
    middle = len(original) // 2  # past INSERT_AT: every file has at least MIN_SIZE bytes
    expected = (
        original[:INSERT_AT]
        + insert
        + original[INSERT_AT:middle]
        + replace
        + original[middle + REPLACED :]
    )
    return Edit(path, insert, middle + len(insert), replace, expected)


async def _apply(client: AsyncClient, volume: str, edit: Edit) -> None:
    await client.edit(volume, edit.path, INSERT_AT, INSERT_AT, edit.insert)
    await client.edit(volume, edit.path, edit.middle, edit.middle + REPLACED, edit.replace)


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise BenchFailure(message)


async def _read_back(client: AsyncClient, volume: str, edits: list[Edit], what: str) -> None:
    for edit in edits:
        got = await client.read(volume, edit.path)
        if got != edit.expected:
            raise BenchFailure(
                f"{what}: {edit.path} does not hold its edits "
                f"({len(got)} bytes, expected {len(edit.expected)}; "
                f"insert present: {edit.insert in got}, replace present: {edit.replace in got})"
            )


async def _phase(
    client: AsyncClient,
    green: str,
    agents: int,
    mode: str,
    edits: list[Edit],
) -> Row:
    """One row: baseline edits, then work volumes, their edits, and their submissions."""
    before = await client.versions(green)
    head_snapshot = (await client.ledger(green, limit=1))["versions"][0]["snapshot"]

    plain_times = []
    for round_ in range(BASELINE_ROUNDS):
        plain = (await client.clone(head_snapshot, f"plain-{mode}-{agents}-{round_}"))["id"]
        started = time.perf_counter()
        for edit in edits:
            await _apply(client, plain, edit)
        plain_times.append(time.perf_counter() - started)
        await _read_back(client, plain, edits, "the baseline volume")
        await client.delete_volume(plain)
    plain_s = statistics.median(plain_times)

    started = time.perf_counter()
    works = []
    for i in range(agents):
        work = await client.create_work(green, f"agent-{mode}-{agents}-{i}")
        _check(work["base"] == before, f"work volume on version {work['base']}, not {before}")
        works.append(str(work["id"]))
    work_s = time.perf_counter() - started
    started = time.perf_counter()
    for work_id, edit in zip(works, edits, strict=True):
        await _apply(client, work_id, edit)
    edit_s = time.perf_counter() - started

    latencies: list[float] = []
    results: list[dict[str, Any]] = []

    async def submit(work_id: str) -> None:
        began = time.perf_counter()
        result = await client.submit(work_id)
        latencies.append(time.perf_counter() - began)
        results.append(result)

    started = time.perf_counter()
    if mode == "sequential":
        for work_id in works:
            await submit(work_id)
    else:
        async with trio.open_nursery() as nursery:
            for work_id in works:
                nursery.start_soon(submit, work_id)
    submit_s = time.perf_counter() - started

    conflicts = sum(len(r["conflicts"]) for r in results)
    _check(conflicts == 0, f"{agents} agents ({mode}): {conflicts} conflicts: {results}")
    _check(all(r["ok"] for r in results), f"{agents} agents ({mode}): a submit failed: {results}")
    head = await client.versions(green)
    _check(head == before + agents, f"head is v{head}, expected v{before + agents}")
    changed = set(await client.changed_since(green, before))
    _check(changed == {e.path for e in edits}, f"the ledger reports {sorted(changed)[:5]}...")
    await _read_back(client, green, edits, f"green head v{head}")
    started = time.perf_counter()
    for work_id in works:
        await client.delete_volume(work_id)
    delete_s = time.perf_counter() - started
    return Row(agents, mode, plain_s, work_s, edit_s, submit_s, delete_s, latencies, conflicts)


async def _run(
    runtime: Path, source: Path, contents: dict[str, bytes], agents: list[int], seed: int
) -> tuple[float, list[Row]]:
    rng = random.Random(seed + 1)
    plan = [(n, mode) for n in agents for mode in ("sequential", "concurrent")[: 1 + (n > 1)]]
    chosen = rng.sample(sorted(contents), sum(n for n, _ in plan))
    rows: list[Row] = []
    every_edit: list[Edit] = []
    async with AsyncClient(runtime) as client:
        started = time.perf_counter()
        green = await client.create_green("bench-green", base=source)
        green_s = time.perf_counter() - started
        for n, mode in plan:
            tag = f"{n}{mode[0]}"
            edits = [
                _edit_for(path, contents[path], f"{tag}-{i}")
                for i, path in enumerate(chosen[len(every_edit) : len(every_edit) + n])
            ]
            every_edit.extend(edits)
            rows.append(await _phase(client, green, n, mode, edits))
        # Later merges must have kept the earlier ones, and left the other files alone.
        await _read_back(client, green, every_edit, "final head")
        edited = {e.path for e in every_edit}
        untouched = rng.sample([p for p in sorted(contents) if p not in edited], 20)
        for path in untouched:
            _check(await client.read(green, path) == contents[path], f"{path} changed")
    return green_s, rows


@contextmanager
def _anchor(top: Path, shards: int) -> Iterator[Path]:
    """An anchor in a temporary runtime directory, stopped (by its pid) however we leave."""
    runtime, log_path = top / "run", top / "anchor.log"
    with open(log_path, "wb") as log:
        process = spawn_anchor(runtime, shards=shards, capacity="4GiB", log=log)
    try:
        yield runtime
    finally:
        stop_process(process)
        if process.returncode not in (0, None):
            print(log_path.read_text(errors="replace"), file=sys.stderr)


def _machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = ", " + line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable{model}), "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )


def _agents(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("a comma-separated list of agent counts") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("agent counts are positive")
    return counts


def _print(rows: list[Row]) -> None:
    header = (
        f"{'agents':>6}  {'mode':<10} {'plain s':>8} {'work s':>8} {'edit s':>8} "
        f"{'submit s':>9} {'merges/s':>9} {'med ms':>8} {'p99 ms':>8} {'confl':>5} "
        f"{'submit x':>9} {'total x':>8} {'delete s':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        total = r.work_s + r.edit_s + r.submit_s
        print(
            f"{r.agents:>6}  {r.mode:<10} {r.plain_s:>8.4f} {r.work_s:>8.4f} {r.edit_s:>8.4f} "
            f"{r.submit_s:>9.3f} {r.agents / r.submit_s:>9.1f} "
            f"{statistics.median(r.latencies) * 1000:>8.2f} {_p99(r.latencies) * 1000:>8.2f} "
            f"{r.conflicts:>5} {r.submit_s / r.plain_s:>9.1f} {total / r.plain_s:>8.1f} "
            f"{r.delete_s:>9.3f}"
        )
    print(
        f"\nplain s = 2 x agents edits applied directly to a plain volume (the baseline, "
        f"median of {BASELINE_ROUNDS});\n"
        "work s = creating the work volumes; edit s = the same edits made in them;\n"
        "submit s = the submit phase (wall); med/p99 ms = one submit's latency;\n"
        "merge cost vs plain edits: submit x = submit s / plain s, "
        "total x = (work + edit + submit s) / plain s;\n"
        "delete s = deleting the agents' work volumes afterwards (not in the ratios)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--agents", type=_agents, default=[1, 10, 100])
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    needed = sum(n * (1 + (n > 1)) for n in args.agents)
    if args.files < needed + 20:
        parser.error(
            f"--agents {args.agents} edits {needed} distinct files: use --files >= {needed + 20}"
        )
    began = time.monotonic()
    print(_machine())
    top = Path(tempfile.mkdtemp(prefix="slates-merge-bench-"))
    try:
        source = top / "source"
        started = time.perf_counter()
        contents = _tree(source, args.files, random.Random(args.seed))
        tree_s = time.perf_counter() - started
        with _anchor(top, args.shards) as runtime:
            green_s, rows = trio.run(_run, runtime, source, contents, args.agents, args.seed)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    size = sum(len(c) for c in contents.values())
    print(
        f"{args.files:,} files in {len({p.rsplit('/', 1)[0] for p in contents})} directories, "
        f"{size / 2**20:.1f} MiB (written in {tree_s:.2f} s); "
        f"create_green (capture) {green_s:.2f} s; {args.shards} shards\n"
    )
    _print(rows)
    print("\nverified: 0 conflicts, head version = submissions, every edit read back from the head")
    print(f"finished in {time.monotonic() - began:.1f} s")


if __name__ == "__main__":
    main()
