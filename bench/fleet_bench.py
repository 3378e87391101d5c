"""Submit latency per durability scope, and remote first reads, on the namespace testbed.

Brings up a private four-host testbed (deploy/testbed, under its own
$SLATES_TESTBED_NAME and $SLATES_TESTBED_DIR; root), makes a green on h1
and, from an AsyncClient on h2 (so every request crosses the fleet links
over QUIC to h1), runs `--rounds` submissions of one small file at each
durability, first from a work volume made on h1 (`at="owner"`: each request
forwarded), then from one made on h2 (`at="here"`: its changes travel to
h1's link in one request at submit): none (the shard's reply), `restart`
(the same: the shard journals before it replies) and `host` (f+1 = 2 holders outside h1, i.e.
h2 and h3, hold the version: the owner's link exports it and ships it).
Prints p50/p90/max per scope.  Then it writes a `--mib` MiB file on h1,
submits it, and reads it from h2 in 8 MiB pieces (the SDK's read size):
the remote first-read throughput through the links.  Then the same read
from a work volume made on another host (`create_work(..., at="here")`):
on h2, which holds the version (pieces from its own holder copy), and on
h4, which holds nothing (pieces fetched from h2 and h3 over QUIC, checked
and stored on h4).  Always runs `down`.

    python bench/fleet_bench.py [--rounds 20] [--mib 32]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import trio

import slates
from slates.fleet.link_client import call_link, link_socket

REPO = Path(__file__).resolve().parent.parent
TESTBED = REPO / "deploy" / "testbed"
PIECE = 8 << 20


def _bed(env: dict[str, str], verb: str, *args: str) -> None:
    done = subprocess.run(
        [str(TESTBED / verb), *args], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{verb} {args} failed:\n{done.stdout}{done.stderr}")


def _profile(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return (
        f"p50 {statistics.median(ordered) * 1e3:7.1f} ms  p90 {p90 * 1e3:7.1f} ms  "
        f"max {ordered[-1] * 1e3:7.1f} ms"
    )


async def _submits(
    runtime: Path, green: str, rounds: int, durability: str | None, at: str
) -> list[float]:
    samples: list[float] = []
    async with slates.AsyncClient(runtime_dir=runtime) as client:
        name = f"bench-{uuid.uuid4().hex[:6]}"
        work = (await client.create_work(green, name, at=at))["id"]
        for n in range(rounds):
            await client.write(work, f"/{durability}-{n}.txt", os.urandom(256))
            started = time.perf_counter()
            result = await client.submit(work, durability=durability)
            samples.append(time.perf_counter() - started)
            if not result["ok"] or (durability and result["durability"] != durability):
                raise SystemExit(f"submission {n} at {durability}: {result}")
    return samples


async def _first_read(runtime: Path, volume: str, size: int, *, here: bool = False) -> float:
    """Seconds to read /big.bin of `volume` (a green, or with `here` a new work volume
    of it made on this host) in PIECE reads."""
    async with slates.AsyncClient(runtime_dir=runtime) as client:
        if here:
            name = f"remote-{uuid.uuid4().hex[:6]}"
            volume = (await client.create_work(volume, name, at="here"))["id"]
        started = time.perf_counter()
        got = 0
        while got < size:
            got += len(await client.read(volume, "/big.bin", offset=got, size=PIECE))
        return time.perf_counter() - started


def _held(runtime: Path, green: str) -> int:
    listing = call_link(link_socket(runtime), {"op": "hosts"})
    return int(listing["held"].get(green, 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--mib", type=int, default=32)
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="sfbench-", dir="/tmp"))
    env = {**os.environ, "SLATES_TESTBED_NAME": "sfb", "SLATES_TESTBED_DIR": str(state)}
    try:
        _bed(env, "up", "4")
        runtime = {h: state / h / "runtime" for h in ("h1", "h2", "h3", "h4")}
        for host in runtime.values():
            while not (host / "fleet-link.json").exists():
                time.sleep(0.2)
        with slates.Client(runtime["h1"]) as h1:
            local = h1.create_green("bench")
        green = f"{local}@h1"
        time.sleep(3)  # the green registered with all three holders (one poll or two)
        print(f"testbed: 4 hosts; green {green}; submits from h2 of one 256-byte file")
        for place, where in (("owner", "on h1, reached through the links"), ("here", "on h2")):
            print(f"  work volume {where}:")
            for durability in (None, "restart", "host"):
                samples = trio.run(_submits, runtime["h2"], green, args.rounds, durability, place)
                print(f"    durability {durability or 'none':8} {_profile(samples)}")
        size = args.mib << 20
        with slates.Client(runtime["h1"]) as h1:
            work = h1.create_work(local, "big")["id"]
            data = os.urandom(size)
            for at in range(0, size, PIECE):
                h1.write(work, "/big.bin", data[at : at + PIECE], offset=at)
            started = time.perf_counter()
            version = h1.submit(work)["version"]
            ship = time.perf_counter() - started
        held_since = time.perf_counter()
        while _held(runtime["h3"], green) < version + 1:  # shipping done: the read alone
            time.sleep(0.2)
        shipped = time.perf_counter() - held_since + ship
        print(f"  submit and ship the {args.mib} MiB version to h2 and h3: {shipped:.1f} s")
        seconds = trio.run(_first_read, runtime["h2"], green, size)
        rate = args.mib / seconds
        print(f"  first read of {args.mib} MiB from h2: {seconds:.2f} s, {rate:.1f} MiB/s")
        for name, where in (("h2", "holds the version"), ("h4", "holds nothing")):
            seconds = trio.run(
                functools.partial(_first_read, runtime[name], green, size, here=True)
            )
            rate = args.mib / seconds
            print(
                f"  first read of {args.mib} MiB from a work volume made on {name} ({where}): "
                f"{seconds:.2f} s, {rate:.1f} MiB/s"
            )
    finally:
        _bed(env, "down")


if __name__ == "__main__":
    main()
