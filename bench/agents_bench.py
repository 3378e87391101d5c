"""Several agents of one project building at once: is the green's one shard the bottleneck?

Why: every work volume of a green lives on the green's shard (issue 14, lever 6
"Use every core" would let a work volume live on the least loaded shard), so
all agents of one project share one Python shard process.  This measures
whether that shard limits N agents that build at the same time.

What it does: N agents (N = 1, 2, 4; --agents) each run lua/lua's clean build
(`make -s -j2`, checked by running the built `./lua -v`) in a workspace of
their own, all started at the same moment, in three arrangements, interleaved
round by round (the arrangements' order rotates each round) so load drifts hit
each alike:

  plain      a `cp -a` of the tree per agent, no FUSE: the floor
  one shard  one green volume over the tree (`green create --base`), N work
             volumes of it, each mounted: every one on the green's shard
  spread     N green volumes of the same tree, named so their shards
             (`shard_of(id)`) alternate over the anchor's shards, one work
             volume of each, mounted: the agents' requests spread over the shards

Per arrangement and N, the medians over --rounds of: the wall time of the
slowest agent and of the median agent, the slowest's ratio to plain's at the
same N; CPU seconds (/proc/PID/stat utime+stime, all threads) of each shard
process and each bridge during the run, and each shard's run-queue wait
(/proc/PID/task/*/schedstat: time it was runnable but had no core); the
agents' own CPU (each make's rusage: the compilers, their system time
included, which holds the kernel's FUSE side); and the requests each bridge
sent its shard (its counters' round_trips; their total also from
workspaces_bench.slates_requests).  A shard whose CPU over the slowest wall
comes near 1.0, or whose run-queue wait grows with N in "one shard" but not
in "spread", is the bottleneck; one mostly idle is not.

Workspaces are made before the clock starts and removed after each run.
Everything mounted or started is undone by the Cleanup stack; the anchor is
private (a temporary runtime directory, 2 shards).  Nothing is asserted;
recorded figures go in bench/RESULTS.md.

Run as root: `python bench/agents_bench.py --lua DIR [--rounds 2] [--agents 1,2,4]`,
DIR from `git --git-dir=<lua mirror> archive HEAD | tar -x -C DIR`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import Cleanup, cpu_seconds, median, run
from workspaces_bench import slates_requests

from slates import Client
from slates.errors import InvalidArgument
from slates.fuse.bridge import read_counters
from slates.node.anchor import is_mounted, spawn_anchor, stop_process
from slates.node.protocol import shard_of

__all__ = ["ARRANGEMENTS", "Outcome", "main", "render"]

ARRANGEMENTS = ("plain", "one shard", "spread")
SHARDS = 2
BUILD_SECONDS = 900.0  # one run's bound: past it the builds are killed and the run fails
NAME_ATTEMPTS = 64  # green names tried to find enough on each shard


@dataclasses.dataclass(frozen=True, slots=True)
class Agent:
    """One agent's finished build."""

    seconds: float
    cpu_seconds: float  # the make and everything it ran (rusage)


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """One run: N agents building at once in one arrangement."""

    agents: tuple[Agent, ...]
    shard_cpu: tuple[float, ...]  # per shard, seconds during the run
    shard_wait: tuple[float, ...]  # per shard, run-queue wait during the run
    bridge_cpu: tuple[float, ...]  # per agent's bridge (empty for plain)
    bridge_round_trips: tuple[int, ...]  # per agent's bridge
    round_trips: int  # every bridge of the runtime directory (slates_requests)
    top_requests: tuple[tuple[str, int], ...]  # the kernel's most frequent, every bridge

    def busy_share(self, cores: int) -> float:
        """CPU the agents, shards and bridges used over what `cores` could give in the
        slowest agent's time (the rest: idle, waiting, or other users' processes)."""
        used = sum(a.cpu_seconds for a in self.agents) + sum(self.shard_cpu)
        return (used + sum(self.bridge_cpu)) / (cores * self.slowest)

    @property
    def slowest(self) -> float:
        return max(a.seconds for a in self.agents)

    @property
    def median_agent(self) -> float:
        return float(statistics.median(a.seconds for a in self.agents))


def _schedstat_wait(pid: int) -> float:
    """Seconds a live process's threads have waited on a run queue (runnable, no core)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def build_all(workspaces: Sequence[Path], logs: Path) -> tuple[Agent, ...]:
    """Start `make -s -j2` in every workspace at once; each agent's wall time and CPU."""
    logs.mkdir(parents=True, exist_ok=True)
    finished: dict[int, Agent] = {}
    failures: list[str] = []
    processes: list[subprocess.Popen[bytes]] = []
    log_paths = [logs / f"agent-{i}.log" for i in range(len(workspaces))]
    started = time.perf_counter()
    for workspace, log_path in zip(workspaces, log_paths, strict=True):
        with open(log_path, "wb") as log:
            processes.append(
                subprocess.Popen(
                    ["make", "-s", "-j2"], cwd=workspace, stdout=subprocess.DEVNULL, stderr=log
                )
            )

    def wait(index: int, process: subprocess.Popen[bytes]) -> None:
        _pid, status, usage = os.wait4(process.pid, 0)
        ended = time.perf_counter()
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            failures.append(f"agent {index}: make exited with {process.returncode}")
        finished[index] = Agent(ended - started, usage.ru_utime + usage.ru_stime)

    waiters = [
        threading.Thread(target=wait, args=(i, p), daemon=True) for i, p in enumerate(processes)
    ]
    for waiter in waiters:
        waiter.start()
    deadline = started + BUILD_SECONDS
    for waiter in waiters:
        waiter.join(max(0.0, deadline - time.perf_counter()))
    if any(waiter.is_alive() for waiter in waiters):
        for process in processes:
            if process.returncode is None:
                process.kill()
        for waiter in waiters:
            waiter.join(30)
        raise RuntimeError(f"the builds did not finish within {BUILD_SECONDS:.0f} s")
    if failures:
        tails = "\n".join(p.read_text(errors="replace")[-1000:] for p in log_paths)
        raise RuntimeError("; ".join(failures) + "\n" + tails)
    for workspace in workspaces:
        out = run(["./lua", "-v"], workspace)
        if not out.startswith("Lua "):
            raise RuntimeError(f"the lua built in {workspace} said {out!r}")
    return tuple(finished[i] for i in range(len(workspaces)))


class Bench:
    """The anchor, the green volumes, and one run of an arrangement at a time."""

    def __init__(self, top: Path, source: Path, cleanup: Cleanup) -> None:
        self.top, self.source, self.cleanup = top, source, cleanup
        self.runtime = top / "slates-run"
        log = open(top / "anchor.log", "wb")  # noqa: SIM115 (closed by the cleanup)
        cleanup.push(log.close)
        anchor = spawn_anchor(self.runtime, shards=SHARDS, capacity="8GiB", log=log)
        cleanup.push(lambda: stop_process(anchor, timeout=30))
        self.client = Client(self.runtime)
        cleanup.push(self.client.close)
        self.shard_pids = [int(s["pid"]) for s in self.client.status()["shards"]]
        self.runs = 0
        self.greens: dict[int, list[str]] = {s: [] for s in range(SHARDS)}

    def make_greens(self, most_agents: int) -> None:
        """Green volumes over the tree, enough on each shard for both Slates arrangements
        (untimed): one on shard 0 for "one shard", and one per agent, shards in turn,
        for "spread".

        A new volume's shard follows its name, so names are tried in turn; a green
        that lands where enough already are is kept unused (the anchor is private)."""
        needed = Counter(i % SHARDS for i in range(most_agents))
        needed[0] += 1
        for attempt in range(NAME_ATTEMPTS):
            if all(len(self.greens[s]) >= n for s, n in needed.items()):
                return
            green = self.client.create_green(f"agents-green-{attempt}", base=self.source)
            self.greens[shard_of(green)].append(green)
        raise RuntimeError(f"not enough green volumes on each shard in {NAME_ATTEMPTS} names")

    def greens_for(self, arrangement: str, agents: int) -> list[str]:
        """The green each agent's work volume is made of."""
        if arrangement == "one shard":  # the last green of shard 0, for every agent
            return [self.greens[0][-1]] * agents
        # spread: shards 0, 1, 0, 1, ... (shard 0's last green is one shard's)
        return [self.greens[i % SHARDS][i // SHARDS] for i in range(agents)]

    def run(self, arrangement: str, agents: int) -> Outcome:
        self.runs += 1
        where = self.top / f"run-{self.runs}"
        with self.cleanup.scope() as scope:
            scope.push(lambda: shutil.rmtree(where, ignore_errors=True))
            workspaces = [where / f"agent-{i}" for i in range(agents)]
            bridges: list[tuple[int, str]] = []  # (pid, volume) per agent
            if arrangement == "plain":
                where.mkdir()
                for workspace in workspaces:
                    run(["cp", "-a", self.source, workspace])
            else:
                for index, (workspace, green) in enumerate(
                    zip(workspaces, self.greens_for(arrangement, agents), strict=True)
                ):
                    bridges.append(
                        self._mount_work(green, f"w{self.runs}-{index}", workspace, scope)
                    )
            if self.shard_pids != [int(s["pid"]) for s in self.client.status()["shards"]]:
                raise RuntimeError("a shard restarted: its CPU time is no longer comparable")
            cpu_before = [cpu_seconds(pid) for pid in self.shard_pids]
            wait_before = [_schedstat_wait(pid) for pid in self.shard_pids]
            bridge_before = [cpu_seconds(pid) for pid, _ in bridges]
            trips_before = [self._round_trips(volume) for _, volume in bridges]
            total_before = slates_requests(self.runtime)
            built = build_all(workspaces, where / "logs")
            requests = slates_requests(self.runtime) - total_before
            outcome = Outcome(
                agents=built,
                shard_cpu=tuple(
                    cpu_seconds(pid) - before
                    for pid, before in zip(self.shard_pids, cpu_before, strict=True)
                ),
                shard_wait=tuple(  # a thread that ended takes its wait along: never below 0
                    max(0.0, _schedstat_wait(pid) - before)
                    for pid, before in zip(self.shard_pids, wait_before, strict=True)
                ),
                bridge_cpu=tuple(
                    cpu_seconds(pid) - before
                    for (pid, _), before in zip(bridges, bridge_before, strict=True)
                ),
                bridge_round_trips=tuple(
                    self._round_trips(volume) - before
                    for (_, volume), before in zip(bridges, trips_before, strict=True)
                ),
                round_trips=requests["round_trips"],
                top_requests=tuple((op, n) for op, n in requests.most_common() if op.isupper())[:5],
            )
        return outcome

    def _mount_work(
        self, green: str, name: str, workspace: Path, scope: Cleanup
    ) -> tuple[int, str]:
        """A work volume of `green`, mounted at `workspace`: (its bridge's pid, its id)."""
        volume = str(self.client.create_work(green, name)["id"])
        if shard_of(volume) != shard_of(green):
            raise InvalidArgument("a work volume left its green's shard", volume=volume)
        scope.push(lambda: self.client.delete_volume(volume, force=True))
        workspace.mkdir(parents=True)
        mounted = self.client.mount(volume, workspace)

        def unmount() -> None:
            if is_mounted(str(workspace)):
                self.client.unmount(workspace, force=True)

        scope.push(unmount)
        return int(mounted["pid"]), volume

    def _round_trips(self, volume: str) -> int:
        """Requests the bridge of `volume` has had its shard answer (its counters file)."""
        files = sorted(self.runtime.glob(f"counters-{volume}-*"))
        if len(files) != 1:
            raise RuntimeError(f"{len(files)} counters files for {volume}")
        return read_counters(files[0])["round_trips"]


def _load() -> str:
    one, five, _fifteen = os.getloadavg()
    return f"{one:.2f}/{five:.2f}"


def _each(values: Sequence[float], digits: int = 2) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values) if values else "-"


def _medians(
    outcomes: Sequence[Outcome], pick: Callable[[Outcome], Sequence[float]]
) -> list[float]:
    """Per position (shard or agent), the median over rounds."""
    columns = zip(*(pick(o) for o in outcomes), strict=True)
    return [median(list(c)) for c in columns]


def render(
    results: dict[tuple[str, int], list[Outcome]], agent_counts: Sequence[int], cores: int
) -> str:
    """The figures as a Markdown table (medians over rounds)."""
    lines = [
        "| N | arrangement | slowest s | median s | slowest / plain | shard CPU s (0 / 1) "
        "| shard CPU / slowest wall (0 / 1) | shard run-queue wait s (0 / 1) "
        "| bridge CPU s (each) | agents' CPU s (sum) | busy share of the cores "
        "| round trips per bridge |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for agents in agent_counts:
        plain = median([o.slowest for o in results[("plain", agents)]])
        for arrangement in ARRANGEMENTS:
            outcomes = results[(arrangement, agents)]
            slowest = median([o.slowest for o in outcomes])
            shard_cpu = _medians(outcomes, lambda o: o.shard_cpu)
            is_plain = arrangement == "plain"
            share = [c / slowest for c in shard_cpu]
            trips = _medians(outcomes, lambda o: [float(t) for t in o.bridge_round_trips])
            cells = [
                str(agents),
                arrangement,
                f"{slowest:.2f}",
                f"{median([o.median_agent for o in outcomes]):.2f}",
                f"{slowest / plain:.2f}x",
                _each(shard_cpu),
                "-" if is_plain else _each(share),
                _each(_medians(outcomes, lambda o: o.shard_wait)),
                _each(_medians(outcomes, lambda o: o.bridge_cpu)),
                f"{median([sum(a.cpu_seconds for a in o.agents) for o in outcomes]):.1f}",
                f"{median([o.busy_share(cores) for o in outcomes]):.2f}",
                "-" if is_plain else _each(trips, 0),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lua", type=Path, required=True, help="lua/lua's source tree")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--agents", default="1,2,4", help="agent counts, comma-separated")
    args = parser.parse_args(argv)
    agent_counts = [int(n) for n in args.agents.split(",") if n]
    if not agent_counts or min(agent_counts) < 1 or args.rounds < 1:
        parser.error("--agents: positive counts; --rounds: at least 1")
    if os.geteuid() != 0:
        parser.error("run as root (mounts)")
    source = args.lua.resolve()
    if not (source / "makefile").is_file():
        parser.error(f"{source} holds no lua makefile")
    began = time.monotonic()
    print(f"load before (1/5 min): {_load()}, {os.cpu_count()} CPUs", flush=True)
    cleanup = Cleanup()
    top = Path(tempfile.mkdtemp(prefix="ab-bench-"))
    cleanup.remove_tree(top)
    results: dict[tuple[str, int], list[Outcome]] = {}
    loads: list[str] = []
    try:
        bench = Bench(top, source, cleanup)
        bench.make_greens(max(agent_counts))
        for round_ in range(args.rounds):
            for agents in agent_counts:
                shift = (round_ + agents) % len(ARRANGEMENTS)
                for arrangement in ARRANGEMENTS[shift:] + ARRANGEMENTS[:shift]:
                    outcome = bench.run(arrangement, agents)
                    results.setdefault((arrangement, agents), []).append(outcome)
                    loads.append(_load())
                    print(
                        f"round {round_ + 1} N={agents} {arrangement:<9} slowest "
                        f"{outcome.slowest:6.2f} s  shards CPU {_each(outcome.shard_cpu)} s  "
                        f"bridge trips {sum(outcome.bridge_round_trips):,} "
                        f"(all bridges {outcome.round_trips:,})  load {loads[-1]}",
                        flush=True,
                    )
    finally:
        cleanup.close()
    print()
    print(render(results, agent_counts, os.cpu_count() or 1))
    most = max(agent_counts)
    for arrangement in ARRANGEMENTS[1:]:
        last = results[(arrangement, most)][-1]
        ops = ", ".join(f"{op} {n:,}" for op, n in last.top_requests)
        print(f"N={most} {arrangement}, last round: the kernel's most frequent requests: {ops}")
    print()
    print(
        f"{args.rounds} rounds, medians; load (1/5 min) after each run: {', '.join(loads)}; "
        f"finished in {time.monotonic() - began:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
