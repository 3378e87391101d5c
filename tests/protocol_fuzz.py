"""A seeded fuzzer of the shards' socket protocol (issue 12): hostile clients never
stall or crash the service for the others.

Each round a hostile client connects to a shard and sends one of: random
bytes, a frame header claiming a huge frame, a truncated frame, a hello
with wrong field types or a random token, or, after a valid hello, requests
with real operation names and random arguments (wrong types, absent
fields, huge numbers, odd paths, the operator's volume ids), as an agent.
After every round a well-behaved client must still create, write and read
a file on every shard, and no shard may have restarted (a crash is a
finding).  Everything random comes from one `random.Random(seed)`; a failure
prints the seed and the round, and the same seed replays the same rounds.

    python -m tests.protocol_fuzz --rounds 5000 [--seed N]   (`make fuzz`)

The suite runs a bounded number of rounds (tests/test_protocol_fuzz.py).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from slates import Client
from slates.node.protocol import frame, pack
from slates.node.runtime import Runtime
from tests.anchor_fixture import Service, start_service

OPS = [
    "status", "volume.list", "volume.show", "volume.create", "volume.delete", "clone",
    "green.create", "work.create", "submit", "rebase", "versions", "changed_since",
    "snapshot", "snapshot.delete", "seal", "gc", "read", "write", "edit", "truncate",
    "mkdir", "symlink", "unlink", "rmdir", "rename", "list", "stat", "readlink",
    "land.plan", "land.show", "land.read_base", "land.grant", "land.apply", "land.rewitness",
    "fs.lookup", "fs.getattr", "fs.read", "fs.write", "fs.create", "fs.setxattr",
    "fs.forget", "fs.rename", "fs.mkdir", "fs.readdir", "bye", "no.such.op",
]  # fmt: skip
KEYS = [
    "volume", "green", "name", "path", "data", "offset", "start", "end", "size", "base",
    "snapshot", "target", "manifest", "grant", "ino", "parent", "version", "force",
    "dry_run", "private", "keep", "src", "dst", "flags", "mode", "count", "truncate",
]  # fmt: skip


def value(rng: random.Random, volumes: list[str]) -> Any:
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice(volumes) if volumes else "vol-0-1"
    if kind == 1:
        return rng.choice(["/", "/a", "/../../etc", "//x", "/" + "a" * 300, "rel", ""])
    if kind == 2:
        return rng.choice([0, 1, -1, 2**31, 2**63 - 1, 2**64 - 1])
    if kind == 3:
        return rng.randbytes(rng.randrange(64))
    if kind == 4:
        return None
    if kind == 5:
        return rng.choice([True, False])
    if kind == 6:
        return [value(rng, volumes) for _ in range(rng.randrange(3))]
    if kind == 7:
        return {"x": value(rng, volumes)}
    if kind == 8:
        return rng.choice(["vol-9-9", "snap-0-1", "man-0-x", "vol-0-99999999999", "caf\udce9"])
    if kind == 9:
        return 1.5
    return "".join(rng.choice("abc/._-") for _ in range(rng.randrange(12)))


def request(rng: random.Random, seq: int, volumes: list[str]) -> dict[str, Any]:
    args = {rng.choice(KEYS): value(rng, volumes) for _ in range(rng.randrange(6))}
    if volumes and rng.random() < 0.5:
        args["volume"] = rng.choice(volumes)
    return {
        "seq": seq,
        "ack": max(0, seq - 1 - rng.randrange(3)),
        "op": rng.choice(OPS),
        "args": args,
    }


def hostile_round(rng: random.Random, path: str, volumes: list[str], token: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(path)
        kind = rng.randrange(6)
        if kind == 0:
            sock.sendall(rng.randbytes(rng.randrange(1, 2048)))
        elif kind == 1:
            sock.sendall(
                struct.pack(">I", rng.choice([2**32 - 1, 64 << 20, 70 << 20])) + b"x" * 100
            )
        elif kind == 2:
            whole = frame(pack({"client": "fuzz", "rings": False}))
            sock.sendall(whole[: rng.randrange(1, len(whole))])
        elif kind == 3:
            hello = {
                rng.choice(["client", "rings", "token", "watch", "mount"]): value(rng, volumes)
            }
            sock.sendall(frame(pack(hello)))
        else:
            # As an agent (its token, or a wrong one): the probes are the operator's, so
            # whatever it asks, they must stay as they are.
            greeting: dict[str, Any] = {"client": f"fuzz-{rng.randrange(1000)}", "rings": False}
            greeting["token"] = token if kind == 4 or rng.random() < 0.7 else "slates-nobody-x"
            sock.sendall(frame(pack(greeting)))
            for seq in range(1, rng.randrange(2, 12)):
                sock.sendall(frame(pack(request(rng, seq, volumes))))
        sock.shutdown(socket.SHUT_WR)  # the shard sees the end at once
        with contextlib.suppress(OSError):
            while sock.recv(1 << 16):  # whatever it answers, until it closes
                pass
    except OSError:
        pass  # refused or closed by the shard: fine
    finally:
        sock.close()


def check_service(service: Service, client: Client, probes: list[str], pids: list[int]) -> None:
    for probe in probes:
        client.write(probe, "/probe", b"alive")
        if client.read(probe, "/probe") != b"alive":
            raise AssertionError("a well-behaved client read back other bytes")
    if service.shard_pids() != pids:
        raise AssertionError(f"a shard restarted: {pids} -> {service.shard_pids()}")


def fuzz(service: Service, seed: int, rounds: int) -> None:
    """Run `rounds` hostile rounds against a running service; raise on a finding."""
    rng = random.Random(seed)
    token = subprocess.run(
        [str(Path(sys.executable).with_name("slates")), "agent", "add", f"fuzz{seed}",
         "--runtime-dir", str(service.runtime)],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    runtime = Runtime(service.runtime)
    shards = len(service.shard_pids())
    with Client(service.runtime) as client:
        probes = [client.create_volume(f"probe-{seed}-{i}")["id"] for i in range(shards * 3)]
        probes = list({p.split("-")[1]: p for p in probes}.values())  # one per shard
        volumes = [*probes]
        pids = service.shard_pids()
        for number in range(rounds):
            path = str(runtime.shard_socket(rng.randrange(shards)))
            try:
                hostile_round(rng, path, volumes, token)
                check_service(service, client, probes, pids)
            except Exception as exc:
                raise AssertionError(f"seed {seed}, round {number}: {exc}") from exc


def main() -> int:
    parser = argparse.ArgumentParser(prog="protocol_fuzz")
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"protocol fuzz: seed {seed}, {args.rounds} rounds", flush=True)
    with tempfile.TemporaryDirectory() as top:
        service = start_service(Path(top) / "run")
        try:
            fuzz(service, seed, args.rounds)
        except AssertionError as exc:
            print(f"FAILED: {exc}\nreplay: python -m tests.protocol_fuzz --seed {seed}", flush=True)
            return 1
        finally:
            service.stop()
    print("no findings", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
