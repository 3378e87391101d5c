"""The testbed's hands: state files, processes and network namespaces, probes.

Theory of operation.  Thin I/O for testbed.py: where things live (`Layout`:
$SLATES_TESTBED_DIR and $SLATES_TESTBED_NAME), state.json read and written
whole (`load`, `save`, atomically by rename) under a lock (`locked`), commands
run with bounded time (`sh`, `probe`), daemons started detached inside a
namespace with `nsenter --net` (`spawn`), processes found (`netns_pids`) and
killed all at once (`kill_all`: SIGSTOP to all, then SIGKILL to all, again
until none is left, at most KILL_ROUNDS times), and the readiness checks of
etcd, serf and the anchor.  A zombie counts as gone (it holds nothing; init
reaps it).  Every failure is a SlatesError with the command's output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from testbed_plan import ETCD_CLIENT_PORT, NAME_PATTERN, SERF_RPC, Host, Testbed

from slates.errors import InvalidArgument, NotFound, SlatesError

PROBE_SECONDS = 5.0
KILL_ROUNDS = 100
LOG_TAIL = 3000


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    name: str
    root: Path

    @staticmethod
    def from_environment() -> Layout:
        name = os.environ.get("SLATES_TESTBED_NAME", "slates")
        if not NAME_PATTERN.match(name):
            raise InvalidArgument("SLATES_TESTBED_NAME: lowercase letters, digits, '-'", name=name)
        root = Path(os.environ.get("SLATES_TESTBED_DIR", "/run/slates-testbed")).absolute()
        return Layout(name, root)

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    def host_dir(self, host_id: str) -> Path:
        return self.root / host_id

    def runtime_dir(self, host_id: str) -> Path:
        return self.host_dir(host_id) / "runtime"

    def log(self, host_id: str, daemon: str) -> Path:
        return self.host_dir(host_id) / "logs" / f"{daemon}.log"


def load(layout: Layout) -> Testbed:
    try:
        data = json.loads(layout.state_file.read_text())
    except FileNotFoundError:
        raise NotFound("no testbed is up", state_dir=str(layout.root)) from None
    return Testbed.from_json(data)


def save(layout: Layout, testbed: Testbed) -> None:
    temporary = layout.state_file.with_suffix(".tmp")
    temporary.write_text(json.dumps(testbed.to_json(), indent=1) + "\n")
    temporary.replace(layout.state_file)


@contextlib.contextmanager
def locked(layout: Layout) -> Iterator[None]:
    layout.root.mkdir(parents=True, exist_ok=True)
    with open(layout.root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# -- processes and namespaces ---------------------------------------------------------


def sh(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    try:
        done = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, timeout=60, check=False
        )
    except subprocess.TimeoutExpired:
        raise SlatesError(f"{argv[0]} did not finish within 60 s", argv=list(argv)) from None
    if check and done.returncode != 0:
        raise SlatesError(
            f"{argv[0]} failed (exit {done.returncode})",
            argv=list(argv),
            output=(done.stdout + done.stderr)[-LOG_TAIL:],
        )
    return done.stdout


def in_netns(netns: str, argv: Sequence[str]) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{netns}", "--", *argv]


def host_environment(layout: Layout, host: Host) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "SLATES_RUNTIME_DIR": str(layout.runtime_dir(host.id)),
        "SLATES_TESTBED_HOST": host.id,
    }


def spawn(layout: Layout, host: Host, daemon: str, argv: Sequence[str]) -> int:
    """Start a daemon in the host's namespace, detached, logging to its log; its pid."""
    log_path = layout.log(host.id, daemon)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            in_netns(host.netns, argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=host_environment(layout, host),
            cwd=layout.host_dir(host.id),
            start_new_session=True,
        )
    return process.pid


def alive(pid: int) -> bool:
    """Whether the pid is a live process (a zombie is not: it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def netns_list() -> list[str]:
    return [line.split()[0] for line in sh(["ip", "netns", "list"]).splitlines() if line.strip()]


def link_exists(netns: str, device: str) -> bool:
    shown = subprocess.run(
        ["ip", "-n", netns, "link", "show", "dev", device], capture_output=True, check=False
    )
    return shown.returncode == 0


def netns_pids(netns: str) -> set[int]:
    if netns not in netns_list():
        return set()
    listed = sh(["ip", "netns", "pids", netns], check=False).split()
    return {int(p) for p in listed if p.isdigit() and alive(int(p))}


def kill_all(netns: str, recorded: Iterable[int], *, only_recorded: bool = False) -> None:
    """SIGKILL the namespace's processes (or only `recorded`) at once, until none is left."""
    extra = set(recorded)
    for _ in range(KILL_ROUNDS):
        found = set() if only_recorded else netns_pids(netns)
        victims = found | {p for p in extra if alive(p)}
        if not victims:
            return
        # Stopped first, none of them can react to another's death (an anchor
        # restarting its shard) before all of them are gone.
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        time.sleep(0.05)
    raise SlatesError("processes of the namespace keep appearing", netns=netns)


def log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL:]
    except FileNotFoundError:
        return ""


def wait_until(
    what: str, ready: Callable[[], bool], watched: Mapping[str, tuple[int, Path]], timeout: float
) -> None:
    """Poll `ready` until true; fail early if a watched daemon (pid, log) has died."""
    deadline = time.monotonic() + timeout
    while not ready():
        for daemon, (pid, log) in watched.items():
            if not alive(pid):
                raise SlatesError(f"{daemon} died while waiting for {what}", log=log_tail(log))
        if time.monotonic() > deadline:
            raise SlatesError(f"timed out waiting for {what}", timeout=timeout)
        time.sleep(0.2)


def probe(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str | None:
    """Run a short check; its stdout, or None if it failed or hung."""
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=PROBE_SECONDS + 5,
            env=None if env is None else dict(env),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    return done.stdout if done.returncode == 0 else None


HTTP_PROBE = (
    "import sys, urllib.request\n"
    "print(urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).read().decode())\n"
)


def etcd_healthy(netns: str, address: str) -> bool:
    url = f"http://{address}:{ETCD_CLIENT_PORT}/health"
    out = probe(in_netns(netns, [sys.executable, "-c", HTTP_PROBE, url, str(PROBE_SECONDS)]))
    try:
        return out is not None and json.loads(out).get("health") == "true"
    except (ValueError, AttributeError):
        return False


def serf_members(netns: str) -> dict[str, str]:
    """Node name -> status, as the serf agent in that namespace sees them."""
    out = probe(in_netns(netns, ["serf", "members", f"-rpc-addr={SERF_RPC}", "-format=json"]))
    try:
        members = json.loads(out or "{}").get("members", [])
        return {str(m["name"]): str(m["status"]) for m in members}
    except (ValueError, AttributeError, KeyError, TypeError):
        return {}


def anchor_ready(layout: Layout, host: Host) -> bool:
    argv = [sys.executable, "-m", "slates_cli.main", "status", "--json"]
    return probe(in_netns(host.netns, argv), host_environment(layout, host)) is not None


def anchor_takes_fleet() -> bool:
    argv = [sys.executable, "-m", "slates_cli.main", "anchor", "--help"]
    return "--fleet" in sh(argv)
