"""A deterministic simulator of 3 to 5 hosts running the fleet's pure machines.

Theory of operation (DESIGN.md section 7, "pure core first").  One seed
fixes everything: the number of hosts (3-5, f = 1, or f = 2 with five),
the holder candidates, the owner, an optional mirror region (1 or 3
hosts), the clients, and every fault.  The only randomness is the
`random.Random(seed)` inside `Sim`, and events are ordered by (time,
sequence number), so `run(seed)` replays exactly.

The world (`world.World`) is an event queue: message deliveries, host
ticks, client actions, configuration deliveries, restarts and chaos.  The
network loses, duplicates, delays (and so reorders) messages, corrupts a
chunk's bytes in transit, and drops everything across a partition.  Chaos
crashes hosts (a restart keeps RAM, or loses it within the fault budget:
at most f members of each configured holder set may have lost their RAM
and not yet been replaced), partitions and heals, jumps host clocks, rots
a held chunk, and makes the council (the simulated configuration group)
fail the owner over, rightly or on a false suspicion.  The council also
replaces members that lost their RAM by joint reconfiguration, and moves
ownership on a TransferRequest.  After the fault window everything heals
and the schedule runs on, so stuck recoveries show up in the statistics.

`invariants.Checker` is consulted after every step; any violation (or any
exception from a machine) raises `InvariantViolated` naming the seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

from slates.fleet.world import DEFAULT_MIX, NO_FAULTS, FaultMix, InvariantViolated, Stats, World

__all__ = ["run", "run_many", "main", "FaultMix", "DEFAULT_MIX", "NO_FAULTS", "InvariantViolated"]


def run(
    seed: int, mix: FaultMix = DEFAULT_MIX, *, trace: bool = False, wire: bool = False
) -> Stats:
    """Run one seeded schedule to its end; raises InvariantViolated on any violation."""
    world = World(seed, mix, trace=trace, wire=wire)
    try:
        world.run()
    except InvariantViolated:
        raise
    except Exception as error:
        raise InvariantViolated(
            f"seed {seed}: a machine raised {type(error).__name__}: {error}", seed=seed
        ) from error
    return world.stats


@dataclasses.dataclass(slots=True)
class Summary:
    schedules: int = 0
    failures: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    total: Stats = dataclasses.field(default_factory=Stats)

    def add(self, stats: Stats) -> None:
        self.total.merge(stats)


def run_many(
    seeds: range,
    mix: FaultMix = DEFAULT_MIX,
    *,
    stop_on_failure: bool = True,
    wire: bool = False,
) -> Summary:
    summary = Summary()
    for seed in seeds:
        summary.schedules += 1
        try:
            summary.add(run(seed, mix, wire=wire))
        except InvariantViolated as failure:
            summary.failures.append((seed, str(failure)))
            if stop_on_failure:
                break
    return summary


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def report(summary: Summary, mix: FaultMix, seconds: float) -> str:
    t = summary.total
    latency = [x / mix.mean_rtt for x in t.latencies]
    lines = [
        f"schedules: {summary.schedules} in {seconds:.1f}s; failures: {len(summary.failures)}",
        f"fault mix: {mix.describe()}",
        f"steps: {t.steps}, commits: {t.commits}, acknowledged: {t.acked}, "
        f"failovers: {t.failovers}, transfers: {t.transfers}, reconfigurations: {t.joints}",
        f"faults: crashes {t.crashes} (RAM lost {t.ram_losses}), partitions {t.partitions}, "
        f"clock jumps {t.clock_jumps}, rotted chunks {t.rots}, false suspicions "
        f"{t.false_suspicions}; messages {t.messages}, lost {t.lost}, duplicated "
        f"{t.duplicated}, corrupted {t.corrupted}",
        f"served reads verified: {t.reads_ok}, refused: {t.reads_refused}; alarms {t.alarms}; "
        f"schedules ending with their configured owner serving: {t.serving_at_end}",
        f"commit latency (first Place to commit, in mean round trips): "
        f"median {_percentile(latency, 0.5):.2f}, p90 {_percentile(latency, 0.9):.2f}, "
        f"p99 {_percentile(latency, 0.99):.2f} over {len(latency)} commits",
    ]
    for seed, message in summary.failures:
        lines.append(f"FAILED seed {seed}: {message}")
        lines.append(f"replay: python -m slates.fleet.sim --seed {seed}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slates.fleet.sim", description=__doc__)
    parser.add_argument("--seeds", type=int, default=1000, help="how many schedules to run")
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument("--seed", type=int, default=None, help="replay exactly this seed")
    parser.add_argument("--no-faults", action="store_true", help="a fault-free network")
    parser.add_argument("--keep-going", action="store_true", help="do not stop at a failure")
    parser.add_argument("--trace", action="store_true", help="print every event (with --seed)")
    parser.add_argument("--wire", action="store_true", help="every message through msgpack")
    args = parser.parse_args(argv)
    if args.trace and args.seed is not None:
        run(args.seed, NO_FAULTS if args.no_faults else DEFAULT_MIX, trace=True, wire=args.wire)
        return 0
    mix = NO_FAULTS if args.no_faults else DEFAULT_MIX
    seeds = (
        range(args.seed, args.seed + 1)
        if args.seed is not None
        else range(args.start, args.start + args.seeds)
    )
    began = time.monotonic()
    summary = run_many(seeds, mix, stop_on_failure=not args.keep_going, wire=args.wire)
    print(report(summary, mix, time.monotonic() - began))
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
