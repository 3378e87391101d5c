"""A user-space netem for kernels without one: relays Ethernet frames with delay and loss.

Theory of operation.  testbed.py's `slow` uses tc netem where the kernel has
it.  Where it does not (CONFIG_NET_SCH_NETEM unset, as on some VM kernels),
it takes the host's link end `veth-hI` off the bridge, adds a veth pair
whose one end joins the bridge in its place, and starts this program in the
bridge namespace to carry every frame between `veth-hI` and the pair's free
end, in both directions, each held for DELAY seconds and dropped with
probability LOSS: the same effect as netem on both ends of the link.

Frames are read and written on AF_PACKET sockets with PACKET_VNET_HDR, so a
frame keeps its offload state (a TCP segment larger than the MTU, a
checksum left for the device to fill): the kernel finishes it on the way
out, as it would have on the bridge.  Frames this program sent itself come
back on its sockets as PACKET_OUTGOING and are skipped.  Everything is
bounded: at most MAX_QUEUED frames wait (more are dropped and counted), at
most MAX_BATCH are read per wake-up; counts go to stderr (the relay's log)
every few seconds when they changed.  The loss draws come from a seeded
generator; the seed is logged at start.  SIGTERM ends it.

Called only by testbed.py (`slow` with the relay); `python delay_relay.py
HOST_SIDE BRIDGE_SIDE DELAY_SECONDS LOSS_FRACTION SEED`.
"""

from __future__ import annotations

import heapq
import random
import select
import signal
import socket
import sys
import time
from types import FrameType

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
MAX_FRAME = 65536 + 256
MAX_QUEUED = 20000
MAX_BATCH = 256
REPORT_SECONDS = 5.0


def open_link(device: str) -> socket.socket:
    link = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    link.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    link.bind((device, ETH_P_ALL))
    link.setblocking(False)
    return link


def relay(host_side: str, bridge_side: str, delay: float, loss: float, seed: int) -> None:
    draws = random.Random(seed)
    links = {name: open_link(name) for name in (host_side, bridge_side)}
    other = {
        links[host_side].fileno(): links[bridge_side],
        links[bridge_side].fileno(): links[host_side],
    }
    by_fd = {link.fileno(): link for link in links.values()}
    poller = select.poll()
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    due: list[tuple[float, int, int, bytes]] = []  # (when, order, out fd, frame)
    order = 0
    counts = {"relayed": 0, "lost": 0, "overflow": 0, "send_errors": 0}
    reported = dict(counts)
    next_report = time.monotonic() + REPORT_SECONDS
    print(f"delay_relay: {host_side} <-> {bridge_side} delay {delay}s loss {loss} seed {seed}",
          file=sys.stderr, flush=True)  # fmt: skip
    while True:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, out_fd, frame = heapq.heappop(due)
            try:
                by_fd[out_fd].send(frame)
                counts["relayed"] += 1
            except OSError:
                counts["send_errors"] += 1
        if now >= next_report:
            if counts != reported:
                print(f"delay_relay: {counts}", file=sys.stderr, flush=True)
                reported = dict(counts)
            next_report = now + REPORT_SECONDS
        wait = min(next_report, due[0][0] if due else next_report) - now
        for fd, _ in poller.poll(max(0.0, wait) * 1000):
            for _ in range(MAX_BATCH):
                try:
                    frame, address = by_fd[fd].recvfrom(MAX_FRAME)
                except BlockingIOError:
                    break
                if address[2] == PACKET_OUTGOING:
                    continue
                if draws.random() < loss:
                    counts["lost"] += 1
                elif len(due) >= MAX_QUEUED:
                    counts["overflow"] += 1
                else:
                    heapq.heappush(
                        due, (time.monotonic() + delay, order, other[fd].fileno(), frame)
                    )
                    order += 1


def stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    host_side, bridge_side, delay, loss, seed = argv
    signal.signal(signal.SIGTERM, stop)
    relay(host_side, bridge_side, float(delay), float(loss), int(seed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
