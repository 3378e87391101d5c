"""Shared-memory ring pair vs a unix-domain socketpair, between two processes.

For msgpack-encoded requests of 64 B and 4 KiB, a forked server decodes each
request and sends back an encoded reply of the same size.  Measured per
transport: request/reply round-trip latency (median, p99; one request in
flight) and pipelined throughput (WINDOW requests in flight).  Ratios are
against the socketpair: above 1 means the ring is better.

Both sides block the way their real users would: the socketpair in recv(),
the ring in `Ring.receive_blocking` (spin for the calibrated wake cost, then
park on the eventfd).  "ring, park only" sets the spin to zero, so every
wait pays an eventfd wake-up.  Client and server are pinned to two different
CPUs, as a client and a busy shard would be; other load on those CPUs (see
the load average printed first) takes time from the spinning side.

    python bench/ring_bench.py
"""

from __future__ import annotations

import gc
import importlib.util
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgpack

if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slates.node.ring import Ring, RingPair, calibrate_spin

SIZES = (64, 4096)
WARMUP = 2_000
ROUND_TRIPS = 20_000
PIPELINED = 40_000
WINDOW = 16
FIRST_SEQ = 1 << 16  # every sequence number encodes as a uint32: fixed message size
RING_CAPACITY = 1 << 20
CPUS = sorted(os.sched_getaffinity(0))
CLIENT_CPU, SERVER_CPU = (CPUS[0], CPUS[1]) if len(CPUS) > 1 else (None, None)


@dataclass
class Endpoint:
    send: Callable[[bytes], object]
    recv: Callable[[], bytes]


@dataclass
class Result:
    transport: str
    size: int
    median_us: float
    p99_us: float
    msgs_per_s: float


def request(seq: int, payload: bytes) -> bytes:
    return msgpack.packb([seq, payload])  # type: ignore[no-any-return]


def payload_for(size: int) -> bytes:
    overhead = len(request(FIRST_SEQ, bytes(size))) - size
    payload = bytes(size - overhead)
    if len(request(FIRST_SEQ, payload)) != size:
        raise RuntimeError(f"cannot build a {size}-byte msgpack message")
    return payload


def serve(server: Endpoint) -> None:
    """Answer until an empty message: decode, then encode a same-sized reply."""
    while data := server.recv():
        seq, payload = msgpack.unpackb(data)
        server.send(msgpack.packb([seq, payload]))


def check(reply: bytes, seq: int) -> None:
    if msgpack.unpackb(reply)[0] != seq:
        raise RuntimeError(f"reply out of order: expected {seq}")


def measure(client: Endpoint, size: int) -> tuple[list[int], float]:
    payload = payload_for(size)
    seq = FIRST_SEQ
    samples: list[int] = []
    for i in range(WARMUP + ROUND_TRIPS):
        start = time.perf_counter_ns()
        client.send(request(seq, payload))
        reply = client.recv()
        elapsed = time.perf_counter_ns() - start
        check(reply, seq)
        seq += 1
        if i >= WARMUP:
            samples.append(elapsed)

    start = time.perf_counter_ns()
    next_reply = seq
    for _ in range(WINDOW):
        client.send(request(seq, payload))
        seq += 1
    for _ in range(PIPELINED):
        check(client.recv(), next_reply)
        next_reply += 1
        client.send(request(seq, payload))
        seq += 1
    for _ in range(WINDOW):
        check(client.recv(), next_reply)
        next_reply += 1
    elapsed_s = (time.perf_counter_ns() - start) / 1e9
    return samples, (PIPELINED + WINDOW) / elapsed_s


@contextmanager
def forked_server(server: Endpoint, cpu: int | None) -> Iterator[None]:
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})
            gc.disable()
            serve(server)
        except BaseException:
            traceback.print_exc()
            status = 1
        finally:
            os._exit(status)
    try:
        yield
    finally:
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"server process failed (wait status {status})")


def run(transport: str, size: int, client: Endpoint, server: Endpoint) -> Result:
    with forked_server(server, SERVER_CPU):
        samples, rate = measure(client, size)
        client.send(b"")
    samples.sort()
    return Result(
        transport=transport,
        size=size,
        median_us=statistics.median(samples) / 1000,
        p99_us=samples[int(len(samples) * 0.99)] / 1000,
        msgs_per_s=rate,
    )


def bench_socketpair(size: int) -> Result:
    client, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with client, server:
        return run(
            "unix socketpair",
            size,
            Endpoint(client.send, lambda: client.recv(65536)),
            Endpoint(server.send, lambda: server.recv(65536)),
        )


def ring_endpoint(outgoing: Ring, incoming: Ring) -> Endpoint:
    def send(data: bytes) -> None:
        while not outgoing.push(data):
            pass  # full: the peer is draining it

    def recv() -> bytes:
        data = incoming.receive_blocking()
        if data is None:
            raise RuntimeError("receive_blocking without a timeout returned nothing")
        return data

    return Endpoint(send, recv)


def bench_ring(transport: str, size: int, spin_ns: int) -> Result:
    with RingPair.create(RING_CAPACITY, spin_ns=spin_ns) as pair:
        return run(
            transport,
            size,
            ring_endpoint(pair.requests, pair.replies),
            ring_endpoint(pair.replies, pair.requests),
        )


def main() -> None:
    began = time.monotonic()
    load = os.getloadavg()[0]
    spin_ns = calibrate_spin()
    if CLIENT_CPU is not None:
        os.sched_setaffinity(0, {CLIENT_CPU})
    print(
        f"{len(CPUS)} CPUs (client on {CLIENT_CPU}, server on {SERVER_CPU}), "
        f"load average {load:.2f}; eventfd wake cost (spin budget) {spin_ns / 1000:.1f} us\n"
        f"{ROUND_TRIPS} round trips, {PIPELINED} pipelined (window {WINDOW}), "
        "msgpack [seq, payload] requests and replies\n"
    )
    gc.disable()
    results: list[tuple[Result, Result]] = []
    for size in SIZES:
        base = bench_socketpair(size)
        results.append((base, base))
        for transport, spin in (
            (f"ring, spin {spin_ns / 1000:.0f} us", spin_ns),
            ("ring, park only", 0),
        ):
            results.append((bench_ring(transport, size, spin), base))
    gc.enable()

    header = (
        f"{'size':>6}  {'transport':<20} {'median us':>10} {'p99 us':>8} "
        f"{'msgs/s':>10} {'MiB/s':>8} {'latency x':>10} {'throughput x':>13}"
    )
    print(header)
    print("-" * len(header))
    for result, base in results:
        print(
            f"{result.size:>6}  {result.transport:<20} {result.median_us:>10.1f} "
            f"{result.p99_us:>8.1f} {result.msgs_per_s:>10,.0f} "
            f"{result.msgs_per_s * result.size / 2**20:>8.1f} "
            f"{base.median_us / result.median_us:>10.2f} "
            f"{result.msgs_per_s / base.msgs_per_s:>13.2f}"
        )
    print("\nlatency x = socketpair median / median; throughput x = msgs/s / socketpair msgs/s")
    print(f"finished in {time.monotonic() - began:.1f} s")


if __name__ == "__main__":
    main()
