"""The simulated world: hosts, network, council, clients, faults (see sim.py).

Theory of operation.  `World` owns an event heap ordered by (time, seq)
and one `random.Random(seed)`; nothing else draws randomness, and the
machines get each host's clock (simulated time plus that host's offset,
which clock jumps move either way).  Endpoints: host names (a `Node`
each), client names, and "council", the simulated configuration group:
it holds the authoritative `GreenConfig`, commits changes (failover,
ownership transfer, joint reconfiguration and retirement) by revision,
and delivers every committed configuration to every host with a delay,
again after a restart or a partition heals.  The `Checker`
(invariants.py) sees every step.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from typing import Any

from slates.fleet.config import Candidate, GreenConfig, HolderSet, Peer
from slates.fleet.council import Council
from slates.fleet.invariants import Checker, InvariantViolated
from slates.fleet.messages import (
    Chunk,
    Message,
    Outgoing,
    decode,
    encode,
)
from slates.fleet.node import Node
from slates.fleet.owner import State
from slates.fleet.simclients import Clients

__all__ = ["World", "FaultMix", "DEFAULT_MIX", "NO_FAULTS", "Stats", "InvariantViolated"]

GREEN = "g"
CAPACITY = 1 << 20
TICK = 2.0
FAULT_WINDOW = 100.0
END = 170.0
MAX_EVENTS = 30000


@dataclasses.dataclass(frozen=True, slots=True)
class FaultMix:
    loss: float = 0.05
    duplicate: float = 0.05
    corrupt: float = 0.02  # a Chunk's bytes flipped in transit
    delay: tuple[float, float] = (0.2, 1.5)
    straggle: float = 0.02  # a message delayed by 10-40 (a stale reply across epochs)
    small_holder: float = 0.2  # a schedule where one host can hold only a few chunks
    chaos_every: float = 7.0  # mean time between chaos events in the fault window
    crash: float = 0.3  # the chaos event's weights
    partition: float = 0.2
    clock_jump: float = 0.15
    rot: float = 0.05
    suspect: float = 0.15
    ram_loss: float = 0.5  # the share of crashes that lose RAM (within the fault budget)

    @property
    def mean_rtt(self) -> float:
        return self.delay[0] + self.delay[1]

    def describe(self) -> str:
        if self.chaos_every == 0:
            chaos = "no chaos"
        else:
            chaos = (
                f"chaos every ~{self.chaos_every} time units for {FAULT_WINDOW:.0f} "
                f"(crash {self.crash}, of which RAM lost {self.ram_loss}; partition "
                f"{self.partition}; clock jump {self.clock_jump}; chunk rot {self.rot}; "
                f"owner suspected {self.suspect})"
            )
        reorder = " (reorders)" if self.delay[0] != self.delay[1] else ""
        return (
            f"loss {self.loss}, duplication {self.duplicate}, chunk corruption {self.corrupt}, "
            f"delay uniform{self.delay}{reorder}, stragglers {self.straggle} delayed 10-40, "
            f"a small holder in {self.small_holder} of schedules, {chaos}"
        )


DEFAULT_MIX = FaultMix()
NO_FAULTS = FaultMix(
    loss=0.0,
    duplicate=0.0,
    corrupt=0.0,
    delay=(0.5, 0.5),
    straggle=0.0,
    small_holder=0.0,
    chaos_every=0.0,
    crash=0.0,
    partition=0.0,
    clock_jump=0.0,
    rot=0.0,
    suspect=0.0,
    ram_loss=0.0,
)


@dataclasses.dataclass(slots=True)
class Stats:
    steps: int = 0
    messages: int = 0
    lost: int = 0
    duplicated: int = 0
    corrupted: int = 0
    crashes: int = 0
    ram_losses: int = 0
    partitions: int = 0
    clock_jumps: int = 0
    rots: int = 0
    false_suspicions: int = 0
    failovers: int = 0
    transfers: int = 0
    joints: int = 0
    commits: int = 0
    acked: int = 0
    reads_ok: int = 0
    reads_refused: int = 0
    serving_at_end: int = 0  # schedules whose configured owner serves when they end
    alarms: int = 0  # holders' and owners' alarms (corrupted chunks, refused reads)
    latencies: list[float] = dataclasses.field(default_factory=list)

    def merge(self, other: Stats) -> None:
        for field in dataclasses.fields(self):
            if field.name == "latencies":
                self.latencies.extend(other.latencies)
            else:
                setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


class World:
    def __init__(
        self, seed: int, mix: FaultMix, *, trace: bool = False, wire: bool = False
    ) -> None:
        self.seed = seed
        self.mix = mix
        self.rng = random.Random(seed)
        self.trace = trace
        self.wire = wire  # every message through its msgpack form
        self.stats = Stats()
        self.now = 0.0
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        rng = self.rng
        count = rng.choice((3, 4, 5))
        f = 2 if count == 5 and rng.random() < 0.3 else 1
        self.hosts = [f"h{i}" for i in range(count)]
        self.mirror_hosts = [f"m{i}" for i in range(rng.choice((0, 0, 1, 3)))]
        self.boot: dict[str, int] = {}
        self.nodes: dict[str, Node] = {}
        self.up: dict[str, bool] = {}
        self.offset: dict[str, float] = {}
        small = rng.choice(self.hosts) if rng.random() < mix.small_holder else ""
        self.capacity = {h: 24 if h == small else CAPACITY for h in self.hosts + self.mirror_hosts}
        for host in self.hosts + self.mirror_hosts:
            self.boot[host] = 0
            self.nodes[host] = Node(self.peer(host), self.capacity[host])
            self.up[host] = True
            self.offset[host] = 0.0
        self.isolated: set[str] = set()
        holders = HolderSet(
            f, tuple(self.candidate(h) for h in sorted(rng.sample(self.hosts, 2 * f + 1)))
        )
        mirror = None
        if self.mirror_hosts:
            mirror_f = (len(self.mirror_hosts) - 1) // 2
            mirror = HolderSet(mirror_f, tuple(self.candidate(h) for h in self.mirror_hosts))
        owner = rng.choice(self.hosts)
        self.council = Council(
            self, GreenConfig(GREEN, 1, 1, self.peer(owner), holders, None, mirror)
        )
        self.checker = Checker(self)
        self.checker.configured(self.config)
        self.chunk_data: dict[bytes, bytes] = {}
        routes = [rng.choice(self.hosts) for _ in range(rng.randint(1, 3))]
        self.clients = Clients(self, routes)
        for host in self.hosts + self.mirror_hosts:
            self.schedule(rng.uniform(0, 0.5), "config", host)
            self.schedule(rng.uniform(0, TICK), "tick", host)
        for client in self.clients.clients:
            self.schedule(rng.uniform(1, 4), "client", client.name)
        if mix.chaos_every:
            self.schedule(rng.expovariate(1 / mix.chaos_every), "chaos", None)
        self.schedule(FAULT_WINDOW, "heal_all", None)

    @property
    def config(self) -> GreenConfig:
        return self.council.config

    # -- identities --

    def peer(self, host: str) -> Peer:
        return Peer(host, f"{host}.boot{self.boot[host]}")

    def candidate(self, host: str) -> Candidate:
        region = "mirror" if host.startswith("m") else "home"
        return Candidate(self.peer(host), f"domain-{host}", region)

    def clock(self, host: str) -> float:
        return self.now + self.offset[host]

    # -- the event loop --

    def schedule(self, delay: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.now + delay, self._seq, kind, payload))

    def run(self) -> None:
        while self._heap and self.stats.steps < MAX_EVENTS:
            at, _, kind, payload = heapq.heappop(self._heap)
            if at > END:
                break
            self.now = at
            self.stats.steps += 1
            self._step(kind, payload)
        self.checker.final()
        owner = self.nodes[self.config.owner.host].owners.get(GREEN)
        if (
            owner is not None
            and owner.me == self.config.owner
            and owner.epoch == self.config.epoch
            and owner.recovered
            and owner.state in (State.SERVING, State.SEALING)
        ):
            self.stats.serving_at_end += 1
        for node in self.nodes.values():
            self.stats.alarms += len(node.holder.alarms)
            self.stats.alarms += sum(len(o.alarms) for o in node.owners.values())

    def _step(self, kind: str, payload: Any) -> None:
        if self.trace:
            print(f"{self.now:8.2f} {kind} {payload!r}"[:400])
        match kind:
            case "msg":
                dest, message = payload
                self._deliver(dest, message)
            case "tick":
                host = payload
                if self.up[host]:
                    self._host_output(host, self.nodes[host].tick(self.clock(host)))
                self.schedule(TICK, "tick", host)
            case "config":
                self._deliver_config(payload)
            case "client":
                self.clients.act(self.clients.get(payload))
            case "restart":
                self._restart(payload)
            case "heal":
                self.isolated = set()
                for host in self.hosts:
                    self.schedule(self.rng.uniform(0.1, 1), "config", host)
            case "chaos":
                self._chaos()
                if self.now < FAULT_WINDOW:
                    self.schedule(self.rng.expovariate(1 / self.mix.chaos_every), "chaos", None)
            case "heal_all":
                self._heal_all()
            case "repair":
                self.council.repair()
                self.schedule(5.0, "repair", None)
            case _:
                raise InvariantViolated(f"seed {self.seed}: unknown event {kind}", seed=self.seed)

    # -- the network --

    def _reachable(self, a: str, b: str) -> bool:
        return (a in self.isolated) == (b in self.isolated)

    def _host_output(self, host: str, outgoing: list[Outgoing]) -> None:
        self.checker.after_host(host)  # first: replies are checked against its commits
        self._emit(host, outgoing)

    def _emit(self, source: str, outgoing: list[Outgoing]) -> None:
        for out in outgoing:
            self.checker.emitted(source, out)
            self.send(source, out.dest, out.message)

    def send(self, source: str, dest: str, message: Message) -> None:
        rng = self.rng
        mix = self.mix
        self.stats.messages += 1
        if not self._reachable(source, dest):
            self.stats.lost += 1
            return
        if mix.loss and rng.random() < mix.loss:
            self.stats.lost += 1
            return
        copies = 2 if mix.duplicate and rng.random() < mix.duplicate else 1
        self.stats.duplicated += copies - 1
        for _ in range(copies):
            sent = message
            if isinstance(message, Chunk) and mix.corrupt and rng.random() < mix.corrupt:
                self.stats.corrupted += 1
                sent = dataclasses.replace(message, data=message.data + b"!")
            if dest == source:
                delay = 0.01  # the host's own holder: no network
            elif mix.straggle and rng.random() < mix.straggle:
                delay = rng.uniform(10, 40)
            else:
                delay = rng.uniform(*mix.delay)
            if self.wire:
                sent = decode(encode(sent))
            self.schedule(delay, "msg", (dest, sent))

    def _deliver(self, dest: str, message: Message) -> None:
        if dest == "council":
            self.council.receive(message)
        elif dest in self.nodes:
            if not self.up[dest]:
                return
            self._host_output(dest, self.nodes[dest].receive(message, self.clock(dest)))
        else:
            self.clients.receive(self.clients.get(dest), message)

    def _deliver_config(self, host: str) -> None:
        if not self.up[host] or host in self.isolated:
            return  # delivered again at restart or when the partition heals
        self._host_output(host, self.nodes[host].install(self.config, self.clock(host)))

    # -- faults --

    def _chaos(self) -> None:
        mix = self.mix
        rng = self.rng
        kinds = ("crash", "partition", "clock_jump", "rot", "suspect")
        weights = (mix.crash, mix.partition, mix.clock_jump, mix.rot, mix.suspect)
        kind = rng.choices(kinds, weights)[0]
        if kind == "crash":
            live = [h for h in self.hosts + self.mirror_hosts if self.up[h]]
            if live:
                host = rng.choice(live)
                lose = rng.random() < mix.ram_loss and self.checker.may_lose_ram(host)
                self.up[host] = False
                self.stats.crashes += 1
                if lose:
                    self._lose_ram(host)
                self.schedule(rng.uniform(4, 30), "restart", host)
        elif kind == "partition" and not self.isolated:
            size = rng.randint(1, max(1, (len(self.hosts) - 1) // 2))
            self.isolated = set(rng.sample(self.hosts, size))
            self.stats.partitions += 1
            self.schedule(rng.uniform(5, 25), "heal", None)
        elif kind == "clock_jump":
            host = rng.choice(self.hosts)
            self.offset[host] += rng.uniform(-10, 25)
            self.stats.clock_jumps += 1
        elif kind == "rot" and self.stats.rots == 0:
            host = rng.choice(self.hosts)
            held = sorted(self.nodes[host].holder.chunks.raw())
            if held:
                self.nodes[host].holder.chunks.corrupt(rng.choice(held))
                self.checker.rotted(host)
                self.stats.rots += 1
        elif kind == "suspect":
            self.council.failover(false_suspicion=not self.council.owner_dead())
        self.council.repair()

    def _lose_ram(self, host: str) -> None:
        """The crash took the host's RAM: it comes back as a new identity holding nothing."""
        self.boot[host] += 1
        self.nodes[host] = Node(self.peer(host), self.capacity[host])
        self.stats.ram_losses += 1
        self.checker.lost_ram(host)

    def _restart(self, host: str) -> None:
        self.up[host] = True
        self.schedule(self.rng.uniform(0.1, 1), "config", host)

    def _heal_all(self) -> None:
        self.isolated = set()
        for host in self.hosts + self.mirror_hosts:
            if not self.up[host]:
                self._restart(host)
            else:
                self.schedule(self.rng.uniform(0.1, 1), "config", host)
        self.schedule(0.5, "repair", None)
