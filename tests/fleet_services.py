"""Real etcd and serf processes on 127.0.0.1 for the fleet driver tests.

Each service gets free ports and a temporary directory, runs as a child
process, and is stopped by its pid (SIGKILL for a crash, SIGTERM to stop);
the context managers stop everything they started and remove the
directory, also when a test fails.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from slates.fleet.serf import SerfAgent

__all__ = ["EtcdCluster", "etcd_cluster", "free_port", "serf_agents"]

ETCD_BINARY = "/usr/bin/etcd"
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 (serf gossips on both)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = int(tcp.getsockname()[1])
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind(("127.0.0.1", port))
                except OSError:
                    continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port found")


@dataclasses.dataclass
class EtcdMember:
    name: str
    client_url: str
    process: subprocess.Popen[bytes]


class EtcdCluster:
    def __init__(self, members: list[EtcdMember]) -> None:
        self.members = members

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    def kill(self, index: int) -> None:
        """SIGKILL one member by its pid and reap it."""
        process = self.members[index].process
        process.kill()
        process.wait()

    def stop(self) -> None:
        """SIGTERM every member, SIGKILL what is still running a second later.

        A leader that lost a peer spends seconds on a leadership transfer
        before exiting; the data directory is thrown away, so it need not.
        """
        for member in self.members:
            if member.process.poll() is None:
                member.process.terminate()
        for member in self.members:
            try:
                member.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                member.process.kill()
                member.process.wait()


def _start_etcd(base: Path, size: int, timeout: float) -> EtcdCluster:
    names = [f"m{i}" for i in range(size)]
    client_ports = {n: free_port() for n in names}
    peer_ports = {n: free_port() for n in names}
    initial = ",".join(f"{n}=http://127.0.0.1:{peer_ports[n]}" for n in names)
    members: list[EtcdMember] = []
    cluster = EtcdCluster(members)
    try:
        for name in names:
            client_url = f"http://127.0.0.1:{client_ports[name]}"
            peer_url = f"http://127.0.0.1:{peer_ports[name]}"
            with (base / f"{name}.log").open("wb") as log:
                process = subprocess.Popen(
                    [ETCD_BINARY, "--name", name, "--data-dir", str(base / name),
                     "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                     "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                     "--initial-cluster", initial, "--initial-cluster-state", "new",
                     "--initial-cluster-token", base.name,
                     # Fast elections keep the failover test short on loopback.
                     "--heartbeat-interval", "50", "--election-timeout", "500",
                     "--log-level", "warn"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                )  # fmt: skip
            members.append(EtcdMember(name, client_url, process))
        _wait_healthy(cluster, base, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_healthy(cluster: EtcdCluster, base: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(cluster.members)
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while pending:
            member = pending[0]
            if member.process.poll() is not None:
                log = (base / f"{member.name}.log").read_text(errors="replace")
                raise RuntimeError(f"etcd {member.name} exited:\n{log[-2000:]}")
            try:
                if client.get(member.client_url + "/health").json().get("health") == "true":
                    pending.pop(0)
                    continue
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd {member.name} did not become healthy")
            time.sleep(0.05)


@contextmanager
def etcd_cluster(size: int = 1, timeout: float = 30.0) -> Iterator[EtcdCluster]:
    base = Path(tempfile.mkdtemp(prefix="slates-etcd-"))
    try:
        cluster = _start_etcd(base, size, timeout)
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def serf_agents(count: int, *, boot: str = "boot-1") -> Iterator[list[SerfAgent]]:
    """`count` agents named n0.. on loopback; n1.. join n0 at start.  Tags: boot."""
    base = Path(tempfile.mkdtemp(prefix="slates-serf-"))
    agents: list[SerfAgent] = []
    try:
        for i in range(count):
            join = [] if i == 0 else [f"127.0.0.1:{serf_bind_port(agents[0])}"]
            agents.append(start_serf(base, f"n{i}", join, boot=boot))
        yield agents
    finally:
        for agent in agents:
            agent.kill()
        shutil.rmtree(base, ignore_errors=True)


def start_serf(
    base: Path, name: str, join: list[str], *, boot: str, bind_port: int | None = None
) -> SerfAgent:
    port = free_port() if bind_port is None else bind_port
    return SerfAgent.start(
        name,
        f"127.0.0.1:{port}",
        f"127.0.0.1:{free_port()}",
        {"boot": boot},
        join,
        data_dir=base / name,
        profile="local",
    )


def serf_bind_port(agent: SerfAgent) -> int:
    members = {m.name: m for m in agent.members()}
    return int(members[agent.node_name].addr.rsplit(":", 1)[1])
