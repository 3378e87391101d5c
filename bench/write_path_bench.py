"""A quick harness for the mount's write path (issue 14): a new 64 MiB file written
in 1 MiB writes then fsync'd, and 2,000 small files created (open O_CREAT|O_EXCL,
a 100-byte write, close), through a Slates mount over a base directory.

Theory of operation: starts a private anchor (slates.node.anchor.spawn_anchor) in a
temporary runtime directory, creates a volume over --base and mounts it through the
CLI as a user would, then runs each workload --rounds times and prints the median
(and every round), plus the shard's pid so a profiler can attach (--pause waits for
Enter before the timed rounds).  Everything it made is undone at the end.

Run as root: `.venv/bin/python bench/write_path_bench.py [--base DIR] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slates.node.anchor import spawn_anchor, stop_process
from slates.node.protocol import shard_of
from slates.sdk import Client

BIG = 64 << 20
SMALL_FILES = 2000


def _cli(runtime: Path, *args: str | Path) -> dict[str, Any]:
    slates = Path(sys.executable).parent / "slates"
    out = subprocess.run(
        [slates, *args, "--runtime-dir", str(runtime), "--json"],
        check=True,
        capture_output=True,
    ).stdout
    answer: dict[str, Any] = json.loads(out)
    return answer


def write_big(mount: Path, payload: bytes) -> float:
    name = mount / "new.bin"
    started = time.perf_counter()
    with open(name, "xb", buffering=0) as f:
        for at in range(0, BIG, 1 << 20):
            f.write(payload[at : at + (1 << 20)])
        os.fsync(f.fileno())
    took = time.perf_counter() - started
    if os.stat(name).st_size != BIG:
        raise SystemExit("the new file has the wrong size")
    with open(name, "rb") as f:
        if f.read() != payload:
            raise SystemExit("the new file reads back wrong")
    os.unlink(name)
    return took


def small_files(mount: Path, round_: int) -> float:
    scratch = mount / f"scratch-{round_}"
    names = [os.path.join(scratch, f"f{i:04}.txt") for i in range(SMALL_FILES)]
    payload = b"x" * 100
    started = time.perf_counter()
    os.mkdir(scratch)
    for name in names:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, payload)
        os.close(fd)
    took = time.perf_counter() - started
    for name in names:
        os.unlink(name)
    os.rmdir(scratch)
    return took


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="/tmp/trees/git")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="big,small")
    parser.add_argument("--pause", action="store_true", help="wait for Enter before timing")
    args = parser.parse_args()
    payload = random.Random(64).randbytes(BIG)
    top = Path(tempfile.mkdtemp(prefix="slates-wbench-"))
    runtime, mount = top / "run", top / "mnt"
    mount.mkdir()
    log = open(top / "anchor.log", "wb")  # noqa: SIM115 (closed below)
    anchor = spawn_anchor(runtime, shards=2, capacity="8GiB", log=log)
    client = Client(runtime)
    try:
        client.status()
        volume = str(_cli(runtime, "volume", "create", "wbench", "--base", args.base)["id"])
        _cli(runtime, "mount", volume, mount)
        shard = client.status()["shards"][shard_of(volume)]
        print(f"shard pid {shard['pid']}", flush=True)
        if args.pause:
            input("attach a profiler, then press Enter ")
        pid = int(shard["pid"])
        results: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        workloads: dict[str, tuple[str, Callable[[int], float]]] = {
            "big": ("write 64 MiB (fsync)", lambda _round: write_big(mount, payload)),
            "small": ("create 2,000 small", lambda round_: small_files(mount, round_)),
        }
        chosen = [workloads[key] for key in args.only.split(",")]
        for round_ in range(args.rounds):
            for name, run in chosen:
                before = cpu_seconds(pid)
                results.setdefault(name, []).append(run(round_))
                cpu.setdefault(name, []).append(cpu_seconds(pid) - before)
        for name, times in results.items():
            rounds = " ".join(f"{t:.3f}" for t in times)
            used = statistics.median(cpu[name])
            median = statistics.median(times)
            print(f"{name:22} median {median:.3f} s  shard CPU {used:.2f} s  [{rounds}]")
        client.unmount(mount)
        client.delete_volume(volume)
    finally:
        client.close()
        stop_process(anchor, timeout=30)
        log.close()
        subprocess.run(["rm", "-rf", str(top)], check=False)


if __name__ == "__main__":
    main()
