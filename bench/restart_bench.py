"""Restart time of a killed shard: empty, after 1,000 submissions, after 100,000 writes.

What it does: starts an anchor with 2 shards in a temporary runtime
directory.  First the empty case: SIGKILL shard 1 (nothing on it) and time
from the kill until it answers `status` again.  Then it fills one shard
with 1,000 submissions (a green volume captured from a small project, one
work volume making an `edit` and a `submit` 1,000 times: the green's
ledger and pruned versions, the work volume moved onto each version) and
the other, separately, with 100,000 small writes (100 B at distinct offsets
over 100 files of one volume), and kills each in turn.  Where a kill
falls between checkpoints decides what replay costs, so a last case writes
--more-writes again (49,800: one event each, just under the shard's
event trigger) and kills it with the journal nearly at its trigger.  Every case is
killed --rounds times (the state does not change between kills) and the
median is printed, with the ratio to the empty shard, and what the shard
itself says it replayed (its "recovered ... in Ns" log line: the
checkpoint load and journal replay, without process start-up).

The issue's goal: a restart after 1,000 submissions or 100,000 writes
answers within 2 s on this machine.  Nothing is asserted.

Run: `python bench/restart_bench.py [--rounds 3] [--submissions 1000] [--writes 100000]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import blake3

from slates import Client
from slates.errors import SlatesError
from slates.node.anchor import spawn_anchor, stop_process

__all__ = ["main"]

SHARDS = 2
ANSWER_SECONDS = 120.0  # a shard that does not answer by then is reported, not waited for
_RECOVERED = re.compile(r"shard (\d+) recovered (\d+) volumes, (\d+) events, in ([0-9.]+)s")


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _name_on(shard: int, prefix: str) -> str:
    """A name the SDK homes on `shard` (slates.sdk.client: _home)."""
    for counter in range(10_000):
        name = f"{prefix}-{counter}"
        digest = blake3.blake3(name.encode()).digest()[:8]
        if int.from_bytes(digest, "big") % SHARDS == shard:
            return name
    raise RuntimeError("no name found for the shard")


def _shard_pid(runtime: Path, index: int) -> int:
    state = json.loads((runtime / "anchor.json").read_text())
    return int(state["shards"][index]["pid"])


def _restart_seconds(runtime: Path, client: Client, index: int) -> float:
    """SIGKILL shard `index`; seconds until it answers `status` again."""
    client.call(index, "status")  # connected and serving before the clock starts
    pid = _shard_pid(runtime, index)
    started = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    deadline = started + ANSWER_SECONDS
    while True:
        try:
            client.call(index, "status")
            return time.perf_counter() - started
        except (SlatesError, OSError):
            if time.perf_counter() > deadline:
                raise
            time.sleep(0.005)


def _recovered(log: Path, index: int) -> tuple[int, float] | None:
    """Events replayed and seconds the shard's last recovery took, from its log line."""
    found = None
    for line in log.read_text(errors="replace").splitlines():
        match = _RECOVERED.search(line)
        if match and int(match.group(1)) == index:
            found = (int(match.group(3)), float(match.group(4)))
    return found


def _measure(
    runtime: Path, client: Client, log: Path, index: int, rounds: int
) -> tuple[float, list[float], tuple[int, float] | None]:
    times = [_restart_seconds(runtime, client, index) for _ in range(rounds)]
    return statistics.median(times), times, _recovered(log, index)


def _submissions(client: Client, top: Path, shard: int, count: int) -> None:
    project = top / "project"
    project.mkdir()
    for index in range(20):
        (project / f"file{index}.txt").write_text(f"line {index}\n" * 50)
    green = client.create_green(_name_on(shard, "restart-green"), base=project)
    work = client.create_work(green, "restart-work")["id"]
    started = time.monotonic()
    for number in range(count):
        path = f"/file{number % 20}.txt"
        client.edit(work, path, 0, 0, f"edit {number}\n".encode())
        result = client.submit(work)
        if not result.get("made_version"):
            raise RuntimeError(f"submission {number} made no version: {result}")
        if number % 200 == 199:
            _log(f"  {number + 1} submissions ({time.monotonic() - started:.0f} s)")


def _writes(client: Client, shard: int, count: int, first: int = 0) -> None:
    name = _name_on(shard, "restart-writes")
    volume = client.create_volume(name)["id"] if not first else client.resolve(name)
    data = b"w" * 100
    started = time.monotonic()
    for number in range(first, first + count):
        client.write(volume, f"/f{number % 100}", data, offset=(number // 100) * 100)
        if number % 20_000 == 19_999:
            _log(f"  {number + 1} writes ({time.monotonic() - started:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--submissions", type=int, default=1000)
    parser.add_argument("--writes", type=int, default=100_000)
    parser.add_argument("--more-writes", type=int, default=49_800)
    args = parser.parse_args()
    top = Path(tempfile.mkdtemp(prefix="slates-restart-"))
    runtime = top / "run"
    log_path = top / "anchor.log"
    anchor = None
    try:
        with open(log_path, "wb") as log:
            anchor = spawn_anchor(runtime, shards=SHARDS, capacity="4GiB", log=log)
        with Client(runtime) as client:
            client.status()
            rows: list[tuple[str, float, list[float], tuple[int, float] | None]] = []
            _log("empty shard ...")
            rows.append(("empty shard", *_measure(runtime, client, log_path, 1, args.rounds)))
            _log(f"{args.submissions} submissions on shard 0 ...")
            _submissions(client, top, 0, args.submissions)
            rows.append(
                (
                    f"{args.submissions:,} submissions",
                    *_measure(runtime, client, log_path, 0, args.rounds),
                )
            )
            _log(f"{args.writes} writes on shard 1 ...")
            _writes(client, 1, args.writes)
            rows.append(
                (f"{args.writes:,} writes", *_measure(runtime, client, log_path, 1, args.rounds))
            )
            if args.more_writes:
                _log(f"{args.more_writes} more writes on shard 1 ...")
                _writes(client, 1, args.more_writes, first=args.writes)
                rows.append(
                    (
                        f"+{args.more_writes:,} writes",
                        *_measure(runtime, client, log_path, 1, args.rounds),
                    )
                )
        empty = rows[0][1]
        print(
            f"Shard restart: SIGKILL until `status` answers again, median of {args.rounds} "
            f"(2 shards, {os.cpu_count()} cores)"
        )
        print(f"{'state':<22}{'restart':>10}{'x empty':>9}   {'rounds':<24}{'shard: replayed':>28}")
        for label, median, times, recovered in rows:
            replay = f"{recovered[0]:,} events in {recovered[1]:.3f} s" if recovered else "-"
            rounds = ", ".join(f"{t:.2f}" for t in times)
            print(f"{label:<22}{median:>9.2f}s{median / empty:>8.1f}x   {rounds:<24}{replay:>28}")
    finally:
        if anchor is not None:
            stop_process(anchor, timeout=60)
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
